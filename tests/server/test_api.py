"""API shapes and errors on a tiny LLaMA with the real router: chat, streaming, models, health, metrics, hostile
requests. Uploads, training and the skills they register: test_api_tasks.py."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.server.config import ServerConfig


def chat(client: TestClient, content: str, **kw):  # type: ignore[no-untyped-def]
    body = {
        "model": "auto",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 6,
        **kw,
    }
    return client.post("/v1/chat/completions", json=body)


def assert_error(resp, status: int, param: str | None, code: str | None = None) -> dict:  # type: ignore[no-untyped-def]
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if code:
        assert err["code"] == code
    return err


def streamed(client: TestClient, path: str, body: dict) -> list[dict]:
    """The chunks of an SSE answer, after checking it is one and that it ends with [DONE]."""
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]


def test_health_and_models(client: TestClient) -> None:
    assert client.get("/healthz").json()["status"] == "ok"
    ready = client.get("/readyz")
    checks = {"engine": True, "routing": True, "model": True, "accepting": True, "trainer": True}
    assert ready.status_code == 200 and ready.json()["checks"] == checks
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids[:2] == ["tiny-llama", "auto"]
    assert client.get("/v1/models/auto").json()["parent"] == "tiny-llama"
    assert_error(client.get("/v1/models/nope"), 404, "model", "model_not_found")


def test_chat_without_skills_uses_base(client: TestClient) -> None:
    r = chat(client, "Hello!")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "auto"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    u = body["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] and 0 < u["completion_tokens"] <= 6
    assert body["skillpool"] == {"route": [], "reason": "no_skills", "score": 0.0}
    assert r.headers["x-skillpool-route"] == "base"


def test_streaming_shape(client: TestClient) -> None:
    body = {
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "Hi"}],
        "temperature": 0,
        "max_tokens": 5,
        "stream_options": {"include_usage": True},
    }
    chunks = streamed(client, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["skillpool"]["reason"] == "base"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    plain = chat(client, "Hi", model="tiny-llama", max_tokens=5).json()["choices"][0]["message"]["content"]
    assert text == plain


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model", "model_not_found"),
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "model", None),
        ({"model": "auto", "messages": []}, 400, "messages", None),
        ({"model": "auto", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", None),
        ({"model": "auto", "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", None),
        ({"model": "auto", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, 400, "temperature", None),
        ({"model": "auto", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens", None),
        (
            {"model": "auto", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
            400,
            "max_tokens",
            "context_length_exceeded",
        ),
        ({"model": "auto", "messages": [{"role": "user", "content": "x"}], "n": 17}, 400, "n", "invalid_value"),
        (
            {"model": "auto", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"49152": 5}},
            400,
            "logit_bias",
            "invalid_value",
        ),
        ({"model": "auto", "messages": [{"role": "user", "content": "x"}], "stop": [1]}, 400, "stop", None),
        ({"model": "auto", "messages": [{"role": "user", "content": "x"}], "stop": ["x" * 257]}, 400, "stop", None),
        (
            {"model": "auto", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            400,
            "tools[0].type",
            "invalid_value",
        ),
        (
            {"model": "auto", "messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
            400,
            "functions",
            "unsupported_parameter",
        ),
    ],
)
def test_chat_errors_use_the_openai_envelope(
    client: TestClient, body: dict, status: int, param: str, code: str | None
) -> None:
    assert_error(client.post("/v1/chat/completions", json=body), status, param, code)


def test_invalid_json_body(client: TestClient) -> None:
    assert_error(
        client.post("/v1/chat/completions", content=b"{oops", headers={"content-type": "application/json"}),
        400,
        None,
        "invalid_json",
    )


def test_api_key_is_required_when_set(components, tiny_base, embedder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    c = build_components(components.cfg.replace(api_key="sekrit", data_dir=tmp_path), base=tiny_base, embedder=embedder)
    try:
        with TestClient(create_app(c)) as cl:
            assert_error(cl.get("/v1/models"), 401, None, "invalid_api_key")
            assert cl.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
            assert cl.get("/healthz").status_code == 200
    finally:
        c.close()


def test_a_bad_seed_fails_alone_next_to_good_requests(client: TestClient) -> None:
    """seed=2**64 once turned every request of its batch into a 500; now it is a 400 of its own."""
    seeds = [1, 2**64, 2, -(2**63) - 1, 3]
    with ThreadPoolExecutor(len(seeds)) as pool:
        resps = list(pool.map(lambda s: chat(client, "Hello there", seed=s, temperature=1.0), seeds))
    for seed, resp in zip(seeds, resps):
        if -(2**63) <= seed < 2**63:
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["message"]["content"] is not None
        else:
            assert_error(resp, 400, "seed", "invalid_value")


def test_a_full_waiting_queue_answers_429_with_retry_after(components, tiny_base, embedder, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    c = build_components(components.cfg.replace(max_waiting=0, data_dir=tmp_path), base=tiny_base, embedder=embedder)
    try:
        with TestClient(create_app(c)) as cl:
            resp = chat(cl, "Hello there")
            assert_error(resp, 429, None, "server_busy")
            assert int(resp.headers["retry-after"]) >= 1
            assert cl.get("/healthz").json()["status"] == "ok"
    finally:
        c.close()


def test_healthz_reports_the_engine(client: TestClient) -> None:
    body = client.get("/healthz").json()
    assert body["status"] == "ok" and body["engine"] == "hf"
    assert {"running", "waiting", "resident_skills", "known_skills"} <= set(body)


def test_sampling_numbers_at_their_edges_never_reach_the_engine_unchecked(client: TestClient) -> None:
    greedy = chat(client, "Hello there", model="base", max_tokens=6).json()["choices"][0]["message"]["content"]
    tiny = chat(client, "Hello there", model="base", max_tokens=6, temperature=1e-300, seed=3)
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["message"]["content"] == greedy  # greedy, not NaN
    assert chat(client, "Hello there", model="base", max_tokens=4, top_p=1e-300, temperature=2).status_code == 200
    top_only = chat(client, "Hello there", model="base", max_tokens=6, temperature=1.5, top_p=0, seed=4)
    assert top_only.json()["choices"][0]["message"]["content"] == greedy  # OpenAI's top_p 0: the top token only
    for field, value in [("temperature", 2.0000001), ("top_p", -0.1), ("max_tokens", 10**30), ("seed", 2**63)]:
        assert chat(client, "Hi", **{field: value}).status_code == 400, field
    raw = '{"model": "base", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    assert_error(post_raw(client, raw), 400, None, "invalid_json")
    assert client.get("/healthz").status_code == 200


def post_raw(client: TestClient, raw: str):  # type: ignore[no-untyped-def]
    return client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    "raw", ["[" * 100_000 + "]" * 100_000, '{"model": "base", "seed": ' + "9" * 5000 + "}", '{"a": Infinity}']
)
def test_bodies_the_json_parser_chokes_on_are_a_400(client: TestClient, raw: str) -> None:
    assert_error(post_raw(client, raw), 400, None, "invalid_json")
    assert chat(client, "Hello there", model="base").status_code == 200  # the connection and server carry on


def test_ignore_eos_decodes_the_whole_budget(client: TestClient) -> None:
    resp = chat(client, "Hello there", model="base", max_tokens=7, ignore_eos=True)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 7
    assert_error(chat(client, "Hi", ignore_eos="yes"), 400, "ignore_eos", "invalid_value")


def test_a_json_endpoint_refuses_a_body_not_declared_json(client: TestClient) -> None:
    """A web page may post text/plain (or a form) to a local server without a CORS preflight: 415."""
    body = json.dumps({"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}, {}):
        r = client.post("/v1/chat/completions", content=body, headers=headers)
        assert_error(r, 415, "content-type", "unsupported_media_type")
    ok = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200, ok.text


JSON = {"content-type": "application/json"}


def _stream_into(app, path: str, ctype: bytes, chunk: int, chunks: int, head: bytes = b"") -> tuple[int, dict, int]:  # type: ignore[no-untyped-def]
    """Send a chunked body (no Content-Length) to the ASGI app as a client would: `head`, then `chunks` pieces
    of `chunk` bytes, pulled one by one as the app reads. Returns the status, the JSON body and the pieces pulled."""
    pulled = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal pulled
        pulled += 1
        return {
            "type": "http.request",
            "body": (head if pulled == 1 else b"") + b"x" * chunk,
            "more_body": pulled < chunks,
        }

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"content-type", ctype), (b"transfer-encoding", b"chunked")]
    scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "query_string": b""}
    scope |= {"headers": headers, "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1)}
    asyncio.run(app(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body), pulled


def test_bodies_over_the_limit_are_cut_off_while_they_stream(client: TestClient, components) -> None:  # type: ignore[no-untyped-def]
    """A 400 MiB chunked upload stops being read just past the limit (never buffered): 413 in the envelope."""
    chunk = 64 * 1024
    part = b'--zz\r\nContent-Disposition: form-data; name="file"; filename="d.jsonl"\r\n\r\n'
    status, body, pulled = _stream_into(client.app, "/tasks", b"multipart/form-data; boundary=zz", chunk, 6400, part)
    assert status == 413 and body["error"]["code"] == "file_too_large"
    assert pulled <= (components.cfg.http.max_upload_bytes + 64 * 1024) // chunk + 2  # of 6400 offered
    status, body, pulled = _stream_into(client.app, "/v1/chat/completions", b"application/json", chunk, 6400)
    assert status == 413 and body["error"]["code"] == "request_too_large"  # not FastAPI's 400
    assert pulled <= components.cfg.http.max_request_bytes // chunk + 2
    declared = client.post(  # a declared length over the limit: refused before reading
        "/v1/chat/completions", content=b" " * (components.cfg.http.max_request_bytes + 1), headers=JSON
    )
    assert_error(declared, 413, None, "request_too_large")
    assert chat(client, "still fine").status_code == 200  # the server goes on


def _labelled(client: TestClient, skill: str, correct: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(f'skillpool_labelled_requests_total{{correct="{correct}",expected_skill="{skill}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_labelled_requests_feed_the_live_routing_accuracy(client: TestClient, components) -> None:  # type: ignore[no-untyped-def]
    """metadata.expected_skill on an auto-routed request counts its top-1 route as right or wrong; names the
    pool does not serve are counted as "other" (bounded labels); metadata is validated as OpenAI does."""
    before = {k: _labelled(client, *k) for k in (("base", "true"), ("other", "false"))}
    routed = chat(client, "Hello there, how are you?", metadata={"expected_skill": "base"})
    assert routed.status_code == 200 and routed.headers["x-skillpool-route"] == "base"  # nothing else fits it
    assert chat(client, "Hello again", metadata={"expected_skill": "no-such-skill"}).status_code == 200
    assert (
        chat(client, "Hi", model="base", metadata={"expected_skill": "base"}).status_code == 200
    )  # forced: not routing
    assert _labelled(client, "base", "true") == before[("base", "true")] + 1
    assert _labelled(client, "other", "false") == before[("other", "false")] + 1
    assert_error(chat(client, "x", metadata={f"k{i}": "v" for i in range(17)}), 400, "metadata", "invalid_value")
    assert_error(chat(client, "x", metadata={"expected_skill": 3}), 400, "metadata.expected_skill", "invalid_value")


def test_readiness_and_liveness_tell_a_dead_engine(tiny_base, embedder, tmp_path) -> None:  # type: ignore[no-untyped-def]
    c = build_components(ServerConfig.of(data_dir=tmp_path, default_max_tokens=2), base=tiny_base, embedder=embedder)
    try:
        with TestClient(create_app(c)) as http:
            assert http.get("/readyz").status_code == 200
            c.engine.close()  # the engine thread ends: nothing can be served
            ready = http.get("/readyz")
            assert ready.status_code == 503 and ready.json()["failing"] == ["engine"]
            assert http.get("/healthz").status_code == 503
            for stream in (False, True):  # no request waits on a dead loop: each fails at once, as vLLM's do
                assert_error(chat(http, "Hello", model="base", stream=stream), 503, None, "engine_unavailable")
    finally:
        c.close()
