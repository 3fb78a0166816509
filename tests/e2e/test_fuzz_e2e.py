"""Fuzzing a live server over real HTTP, with two properties: no input gives a 5xx, and no input harms the next
request (after every case a plain chat through the openai client is answered and /healthz stays 200).

Schemathesis fuzzes every operation of the OpenAPI schema, and a third of the JSON bodies it makes get a string
that is not text (a lone surrogate, which schemathesis never generates: it cannot be encoded as UTF-8) planted as
a value or a key at any depth: each must be a 400 naming that field. The schema types `model` as a plain string, so a
second, Hypothesis-driven test speaks the `model` grammar itself (skill names, explicit mixes with any floats,
the base id, `auto`) with the numeric sampling fields at their edges: the request class that once killed the
engine ('agnews=1e308,agnews=1e308'). The server runs the tiny LLaMA with one skill trained (forced past the
gate a random model cannot pass) and no admin key, so writes reach their handlers."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import OpenAI
from schemathesis.checks import not_a_server_error

from skillpool.evaluation.process import ServerProcess
from tests.conftest import until
from tests.datasets import sst2_lines

pytestmark = pytest.mark.slow
SKILL = "sst-2"


@pytest.fixture(scope="module")
def live(tiny_base, tmp_path_factory) -> Iterator[ServerProcess]:  # type: ignore[no-untyped-def]
    data = tmp_path_factory.mktemp("fuzz") / "data"
    with ServerProcess(data, ["--model", str(tiny_base.path), "--default-max-tokens", "2"]) as srv:
        r = httpx.post(
            srv.url + "/tasks",
            files={"file": ("sst2.jsonl", sst2_lines(30))},
            data={"name": SKILL, "config": json.dumps({"epochs": 1, "max_eval_examples": 8}), "force": "true"},
            timeout=120,
        )
        assert r.status_code == 202, r.text
        job = f"{srv.url}/tasks/{r.json()['id']}"
        until(lambda: httpx.get(job).json()["status"] in ("succeeded", "failed", "cancelled"), timeout=600)
        assert httpx.get(job).json()["status"] == "succeeded", httpx.get(job).text
        yield srv


class Unharmed:
    """The second property: the server answers an ordinary chat and stays live after each fuzzed case."""

    def __init__(self, url: str) -> None:
        self.url, self.client = url, OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.cases = 0

    def check(self, after: str) -> None:
        self.cases += 1
        assert httpx.get(self.url + "/healthz", timeout=30).status_code == 200, f"not live after {after}"
        r = self.client.chat.completions.create(
            model="base", messages=[{"role": "user", "content": "hi"}], max_tokens=1, temperature=0
        )
        assert r.choices[0].finish_reason in ("stop", "length"), f"a plain chat failed after {after}"


def test_no_input_gives_a_server_error_or_harms_the_next_request(live: ServerProcess) -> None:
    """Each operation's own hypothesis run (schemathesis' pytest plugin does not load under pytest 9)."""
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10  # chat, models, tasks, files, fine-tuning, health...
    seen: dict[str, set[int]] = {}
    unharmed = Unharmed(live.url)
    for op in operations:
        _fuzz(op, live.url, seen, unharmed)
    assert seen.pop("planted") == {400}  # strings that are not text were sent, each refused naming its field
    assert set(seen) == {op.label for op in operations}  # every operation was called
    assert not [label for label, codes in seen.items() if max(codes) >= 500], seen
    assert 200 in seen["POST /v1/chat/completions"], seen  # fuzzed bodies reached generation too
    print(f"schemathesis: {unharmed.cases} cases over {len(operations)} operations")


CROSS_FIELD = ("tools", "tool_choice", "response_format", "structured_outputs", "top_logprobs", "ignore_eos")
CROSS_FIELD += tuple(f"guided_{k}" for k in ("json", "regex", "choice", "grammar"))
NOT_TEXT = ["\ud800", "x\udfffy", "\udc80\ud800", "a\ud83d"]  # lone surrogates: valid JSON, never text


def _places(value: Any, path: str = "") -> list[tuple[Any, Any, bool, str]]:
    """Where a string can be planted in a JSON value: (container, key or index, as the key itself, its param)."""
    out: list[tuple[Any, Any, bool, str]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            out.append((value, k, True, path))
            out += [(value, k, False, f"{path}.{k}" if path else k), *_places(v, f"{path}.{k}" if path else k)]
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += [(value, i, False, f"{path}[{i}]"), *_places(v, f"{path}[{i}]")]
    return out


def _plant(body: Any, bad: str, pick: int) -> str | None:
    """Put `bad` at one place of `body` (replacing a value, or renaming a key); the param that names it."""
    places = _places(body)
    if not places:
        return None
    container, key, as_key, param = places[pick % len(places)]
    if as_key:
        container[bad] = container.pop(key)
    else:
        container[key] = bad
    return param


def _fuzz(op, url: str, seen: dict[str, set[int]], unharmed: Unharmed) -> None:  # type: ignore[no-untyped-def]
    @given(
        case=op.as_strategy(),
        routed=st.booleans(),
        plant=st.sampled_from([None, None, *NOT_TEXT]),
        pick=st.integers(0, 10**6),
    )
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def fuzz(case, routed: bool, plant: str | None, pick: int) -> None:  # type: ignore[no-untyped-def]
        if routed and op.label == "POST /v1/chat/completions" and isinstance(case.body, dict):
            # half the chat bodies name a model that exists and carry one user turn, without the fields whose
            # rules span several fields (tools, formats, top_logprobs needs logprobs), which the schema cannot
            # state and random values almost never meet: they reach the engine
            case.body["model"] = "auto"
            case.body["messages"] = [{"role": "user", "content": "hello"}]
            for key in CROSS_FIELD:
                case.body.pop(key, None)
        planted = None
        if plant is not None and "json" in (case.media_type or "") and isinstance(case.body, (dict, list)):
            planted = _plant(case.body, plant, pick)
        response = case.call(base_url=url, timeout=120)
        seen.setdefault(op.label, set()).add(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])
        if planted is not None:
            assert response.status_code == 400, (op.label, case.body, response.text)
            err = response.json()["error"]
            assert err["code"] == "invalid_encoding" and err["param"] == (planted or None), (case.body, err)
            seen.setdefault("planted", set()).add(400)
        unharmed.check(op.label)

    fuzz()


# --- the model grammar and the sampling fields at their edges ------------------------------------------------
EDGE_FLOATS = [0.0, -0.0, 5e-324, 1e-300, 1e-5, 0.5, 1.0, 2.0, 2.0000001, 1e6, 1e308, math.inf, -math.inf, math.nan]
weights = st.one_of(
    st.sampled_from(EDGE_FLOATS).map(repr),
    st.floats(min_value=0, max_value=10).map(repr),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", "x", "1e999", "-1e999", "0x10", "1_0", " 1", "nan", "+inf"]),
)
names = st.sampled_from([SKILL, SKILL, SKILL, "nope", "base", "auto", "tiny-llama", ""])


def mixes(names: st.SearchStrategy[str], weights: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.lists(st.tuples(names, weights), min_size=1, max_size=4).map(
        lambda ps: ",".join(f"{n}={w}" for n, w in ps)
    )


# a mix that must be served (any weight in the accepted range, the smallest subnormal included) or any mix at all
served = mixes(st.just(SKILL), st.floats(min_value=5e-324, max_value=1e6).map(repr))
models = st.one_of(names, served, mixes(names, weights), st.text(max_size=40))
numbers = st.one_of(
    st.sampled_from(EDGE_FLOATS),
    st.floats(min_value=0, max_value=2),
    st.floats(),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.none(),
)
integers = st.one_of(
    st.sampled_from([0, 1, 2, -1, 2**31, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64, 10**30]),
    st.integers(min_value=1, max_value=4),
    st.integers(min_value=1, max_value=4),
    st.integers(),
    st.floats(),
    st.none(),
)


@st.composite
def chat_bodies(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"model": draw(models), "messages": [{"role": "user", "content": "hello"}]}
    for key, values in [("temperature", numbers), ("top_p", numbers), ("max_tokens", integers), ("seed", integers)]:
        if draw(st.integers(0, 2)) == 0:  # each field in a third of the bodies: valid requests stay common
            body[key] = draw(values)
    sampling = [
        ("n", integers),
        ("presence_penalty", numbers),
        ("frequency_penalty", numbers),
        ("repetition_penalty", numbers),
        ("min_p", numbers),
        ("top_k", integers),
        ("min_tokens", integers),
        ("top_logprobs", integers),
        ("logprobs", st.one_of(st.booleans(), integers)),
        ("logit_bias", st.dictionaries(st.one_of(integers.map(str), st.text(max_size=4)), numbers, max_size=3)),
    ]
    for key, values in sampling:
        if draw(st.integers(0, 9)) == 0:  # each in a tenth of the bodies: requests with none of them stay common
            body[key] = draw(values)
    body["stream"] = draw(st.booleans())
    return body


def test_the_model_grammar_and_sampling_edges_never_harm_the_server(live: ServerProcess) -> None:
    codes: dict[int, int] = {}
    unharmed = Unharmed(live.url)
    with httpx.Client(base_url=live.url, timeout=120) as http:

        @given(body=chat_bodies())
        @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        def fuzz(body: dict[str, Any]) -> None:
            raw = json.dumps(body)  # NaN and Infinity go out as JSON's non-standard tokens: a 400 too
            r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
            assert r.status_code < 500, (body, r.status_code, r.text)
            if r.status_code == 200 and body["stream"]:
                assert '"error"' not in r.text, (body, r.text)  # an in-band error is a failure too
            unharmed.check(raw)

        fuzz()
    assert codes.get(200, 0) >= 10 and codes.get(400, 0) >= 10, codes  # both sides of the grammar were reached
    hostile = {"model": f"{SKILL}=1e308,{SKILL}=1e308", "messages": [{"role": "user", "content": "hello"}]}
    assert httpx.post(live.url + "/v1/chat/completions", json={**hostile, "max_tokens": 4}).status_code == 400
    unharmed.check("the issue's request")
    print(f"model grammar: {unharmed.cases} cases, status codes {codes}")
