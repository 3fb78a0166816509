"""A string that is not UTF-8 text (a lone surrogate, or bytes that are not UTF-8) is a 400 naming its field, on
every endpoint of the real app on a tiny LLaMA, wherever it enters: a JSON body (at any depth, as a value or a key,
escaped or raw), a query or a path value, JSON in a form field or in metadata, and a dataset's lines. Nothing is
left behind, and the next request is answered."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skillpool.server.app import create_app
from tests.datasets import sst2_lines

CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
NOT_TEXT = ["\ud800", "x\udfffy", "\udc80\ud800", "a\ud83d", "\ude00b"]  # lone surrogates (a pair is text)
text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=8)  # any text: emoji, NUL, RTL...
clean = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), text),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(text, inner, max_size=3)),
    max_leaves=8,
)


@st.composite
def planted(draw: st.DrawFn) -> tuple[Any, str | None]:
    """(a JSON value with one string that is not text, at any depth, as a value or a key; the param naming it)."""
    steps = draw(st.lists(st.one_of(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), st.integers(0, 2)), max_size=4))
    bad = draw(st.sampled_from(NOT_TEXT))
    as_key = draw(st.booleans())
    value: Any = {bad: draw(clean)} if as_key else bad
    for step in reversed(steps):
        if isinstance(step, str):
            siblings = draw(st.dictionaries(text.filter(lambda k, s=step: k != s), clean, max_size=2))
            value = {**siblings, step: value}
        else:
            value = [*draw(st.lists(clean, min_size=step, max_size=step)), value, *draw(st.lists(clean, max_size=1))]
    path = ""
    for i, step in enumerate(steps):
        path += f"[{step}]" if isinstance(step, int) else (f".{step}" if i else step)
    return value, path or None


@pytest.fixture(scope="module")
def http(components) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    with TestClient(create_app(components)) as client:
        yield client


def routes(http: TestClient) -> list[tuple[str, str]]:
    """Every operation of the app, its path parameters filled in."""
    spec = http.get("/openapi.json").json()["paths"]
    return [(m.upper(), p.replace("{", "").replace("}", "")) for p, ops in spec.items() for m in ops]


def refused(r: Any, param: str | None) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_encoding" and err["param"] == param, err
    assert "not valid UTF-8 text" in err["message"]


def answered(http: TestClient) -> None:
    r = http.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200 and http.get("/healthz").status_code == 200, r.text


@given(doc=planted(), wire=st.sampled_from(["escaped", "raw"]), route=st.integers(0, 10**6))
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
def test_a_json_body_with_a_string_that_is_not_text_is_a_400_naming_it_on_every_endpoint(
    http: TestClient, doc: tuple[Any, str | None], wire: str, route: int
) -> None:
    value, param = doc
    writes = [(m, p) for m, p in routes(http) if m in ("POST", "DELETE")]
    method, path = writes[route % len(writes)]
    if wire == "escaped":  # "\ud800" as JSON writes it
        body = json.dumps(value).encode()
    else:  # its bytes as they would be in UTF-8 (CESU): no decoder takes them, JSON's own lets them through
        body = json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")
    r = http.request(method, path, content=body, headers={"content-type": "application/json"})
    refused(r, param)


@given(
    name=st.from_regex(r"[a-z_\[\]]{1,12}", fullmatch=True),
    raw=st.binary(min_size=1, max_size=6).filter(lambda b: not _decodes(b)),
    route=st.integers(0, 10**6),
)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_a_query_or_path_value_that_is_not_utf8_is_a_400_naming_it(
    http: TestClient, name: str, raw: bytes, route: int
) -> None:
    quoted = "".join(f"%{b:02X}" for b in raw)
    everything = routes(http)
    method, path = everything[route % len(everything)]
    refused(http.request(method, f"{path}?{name}={quoted}"), name)
    with_params = [(m, p) for m, p in everything if p.count("/") > 2 and not p.endswith("completions")]
    method, path = with_params[route % len(with_params)]
    parts = path.split("/")
    parts[3] = quoted  # the first path value: a model, a job, a file
    refused(http.request(method, "/".join(parts)), "path")


def _decodes(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_the_requests_of_the_report_and_what_follows_them(http: TestClient, components) -> None:  # type: ignore[no-untyped-def]
    """The chat request that was a 500 with a reset connection, then JSON in form fields and metadata, a dataset's
    line and a fine-tuning job's metadata: each a 400 naming its field, nothing recorded, the server answering."""
    jobs = {j.id for j in components.jobs.list()}
    chat = {**CHAT, "messages": [{"role": "user", "content": "x\ud800y"}]}
    refused(
        http.post("/v1/chat/completions", content=json.dumps(chat), headers={"content-type": "application/json"}),
        "messages[0].content",
    )
    answered(http)

    config = json.dumps({"target_modules": ["q_proj", "\udfff"]})  # JSON in a form field
    r = http.post("/tasks", data={"name": "text-probe", "config": config}, files={"file": ("a.jsonl", sst2_lines(12))})
    refused(r, "config.target_modules[1]")

    lines = sst2_lines(12).split(b"\n")
    row = json.loads(lines[4])
    lines[4] = json.dumps({**row, "input": row["input"] + "\ud800"}).encode()
    r = http.post("/tasks", data={"name": "text-probe"}, files={"file": ("a.jsonl", b"\n".join(lines))})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_dataset", r.text
    assert r.json()["error"]["errors"][0] | {"message": ""} == {"line": 5, "field": "input", "message": ""}

    f = http.post("/v1/files", files={"file": ("s.jsonl", sst2_lines(12))}, data={"purpose": "fine-tune"}).json()
    body = {
        "model": "tiny-llama",
        "training_file": f["id"],
        "metadata": {"config": json.dumps({"seed": 1, "\ud800": 2})},
    }
    refused(
        http.post("/v1/fine_tuning/jobs", content=json.dumps(body), headers={"content-type": "application/json"}),
        "metadata.config",
    )
    body["metadata"] = {"note": "\ud800"}
    refused(
        http.post("/v1/fine_tuning/jobs", content=json.dumps(body), headers={"content-type": "application/json"}),
        "metadata.note",
    )
    assert {j.id for j in components.jobs.list()} == jobs  # nothing half-made
    answered(http)


def test_text_passes_untouched(http: TestClient) -> None:
    """Escaped pairs (an emoji as json.dumps writes it), any script, NUL: text, answered as before."""
    for content in ("😀 \ud83d\ude00", "Grüße, 日本語, עברית", "nul \x00 here", "\\ud800 is how JSON escapes it"):
        body = {**CHAT, "messages": [{"role": "user", "content": content}]}
        r = http.post("/v1/chat/completions", content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code == 200, (content, r.text)
