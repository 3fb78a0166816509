"""What every endpoint shares: x-request-id on every response (echoed or made) and in the access log, CORS only
with --allowed-origins (preflight answered), vLLM's /health and /version, and /tokenize, /detokenize and
/tokenizer_info in vLLM's shapes."""

from __future__ import annotations

import logging
import re
from dataclasses import replace

import pytest
from fastapi.testclient import TestClient

from skillpool.server.app import create_app
from skillpool.server.config import allowed_origins
from tests.server.test_api import assert_error, chat

ORIGIN = "https://app.example"


def test_every_response_has_a_request_id(client: TestClient) -> None:
    made = [
        client.get("/healthz"),
        client.get("/v1/models"),
        client.post("/v1/chat/completions", json={"model": "nope", "messages": []}),
        client.get("/no/such/path"),
        chat(client, "Hi"),
    ]
    ids = [r.headers["x-request-id"] for r in made]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids) and len(set(ids)) == len(ids)


def test_a_usable_request_id_is_echoed_and_logged(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="skillpool.access"):
        r = client.get("/v1/models", headers={"x-request-id": "trace-42:abc"})
    assert r.headers["x-request-id"] == "trace-42:abc"
    [line] = [rec.getMessage() for rec in caplog.records if rec.name == "skillpool.access"]
    assert '"GET /v1/models" 200' in line and line.endswith("request_id=trace-42:abc")
    for unusable in ("", "x" * 129, "two words"):
        got = client.get("/v1/models", headers={"x-request-id": unusable}).headers["x-request-id"]
        assert got != unusable and re.fullmatch(r"[0-9a-f]{32}", got)


def test_without_allowed_origins_there_is_no_cors(client: TestClient) -> None:
    pre = client.options("/v1/chat/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 405 and "access-control-allow-origin" not in pre.headers
    r = client.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_allowed_origins_answer_the_preflight_and_mark_responses(components) -> None:  # type: ignore[no-untyped-def]
    c = replace(components, cfg=components.cfg.replace(allowed_origins=f"{ORIGIN}, https://other.example"))
    with TestClient(create_app(c)) as cl:
        ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
        pre = cl.options("/v1/chat/completions", headers={"Origin": ORIGIN, **ask})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        assert pre.headers["x-request-id"]
        refused = cl.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **ask})
        assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
        r = cl.get("/v1/models", headers={"Origin": ORIGIN})
        assert r.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in r.headers["access-control-expose-headers"]


def test_allowed_origins_read_as_vllm_and_as_a_list() -> None:
    assert allowed_origins(None) == [] and allowed_origins(" ") == []
    assert allowed_origins("*") == ["*"]
    assert allowed_origins('["https://a.example", "https://b.example"]') == ["https://a.example", "https://b.example"]
    assert allowed_origins("https://a.example,https://b.example") == ["https://a.example", "https://b.example"]


def test_health_and_version(client: TestClient) -> None:
    h = client.get("/health")
    assert h.status_code == 200 and h.content == b""
    v = client.get("/version").json()["version"]
    assert isinstance(v, str) and v


def test_tokenize_and_detokenize_round_trip(client: TestClient, components) -> None:  # type: ignore[no-untyped-def]
    r = client.post("/tokenize", json={"prompt": "Hello wörld", "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == components.engine.max_context
    assert "".join(r["token_strs"]) == "Hello wörld"
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello wörld"}
    msgs = [{"role": "user", "content": "Hi"}]
    templated = client.post("/tokenize", json={"messages": msgs, "model": "tiny-llama"}).json()["tokens"]
    assert templated == components.engine.encode_chat(msgs)
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] and info["chat_template"] and info["vocab_size"] == components.vocab.size


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": [10**7]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [1], "model": "nope"}, "model"),
    ],
)
def test_tokenizer_endpoints_refuse_bad_input(client: TestClient, path: str, body: dict, param: str) -> None:
    resp = client.post(path, json=body)
    assert_error(resp, 404 if param == "model" else 400, param)


def test_tokenize_needs_a_key_when_keys_are_set(components, tmp_path) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys"
    keys.write_text("alice chat s3cret\n")
    c = replace(components, cfg=components.cfg.replace(api_keys_file=keys))
    with TestClient(create_app(c)) as cl:
        assert_error(cl.post("/tokenize", json={"prompt": "a"}), 401, None, "invalid_api_key")
        ok = cl.post("/tokenize", json={"prompt": "a"}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert cl.get("/health").status_code == 200 and cl.get("/version").status_code == 200
