"""Draining on a real uvicorn server (the tiny LLaMA with a long context, so an answer takes seconds): once the drain
begins, readiness is 503 and liveness 200, a new request gets 503 `server_shutting_down` with Retry-After and
Connection: close, and a stream in flight goes on to its finish_reason; at the deadline a stream still running ends
with a final error event, a request not yet answered gets the 503, and either frees its engine row."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from skillpool.evaluation.process import free_port
from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.server.config import ServerConfig
from skillpool.server.drain import Drain
from tests.conftest import LONG_ANSWER, until

CHAT = "/v1/chat/completions"
LONG = LONG_ANSWER


@pytest.fixture(scope="module")
def components(tiny_long, embedder, tmp_path_factory):  # type: ignore[no-untyped-def]
    c = build_components(
        ServerConfig.of(data_dir=tmp_path_factory.mktemp("data"), max_batch_size=2), base=tiny_long, embedder=embedder
    )
    yield c
    c.close()


class Serving:
    """One app (its own drain) on a real uvicorn server in a thread."""

    def __init__(self, components: Any) -> None:
        self.app = create_app(components)
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        until(lambda: self.server.started, timeout=30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def drain(self) -> Drain:
        drain: Drain = self.app.state.drain
        return drain

    def begin(self, timeout_s: float) -> tuple[int, cf.Future[int]]:
        """Begin the drain on the server's loop: the requests in flight at that moment, and the drain's end."""
        loop = self.server.servers[0].get_loop()

        async def begin() -> tuple[int, asyncio.Future[int]]:
            return self.drain.in_flight, asyncio.ensure_future(self.drain.stop(timeout_s))

        n, task = asyncio.run_coroutine_threadsafe(begin(), loop).result(10)
        ended: cf.Future[int] = cf.Future()
        task.add_done_callback(lambda t: ended.set_result(t.result()))
        return n, ended

    def healthz(self) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(self.url + "/healthz", timeout=10).json()
        return body

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture
def serving(components: Any) -> Iterator[Serving]:
    s = Serving(components)
    yield s
    s.close()


def _first_content(lines: Iterator[str]) -> None:
    for line in lines:
        if '"content": "' in line and '"content": ""' not in line:
            return
    raise AssertionError("the stream ended before any content")


def _events(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(x[len("data: ") :]) for x in lines if x.startswith("data: {")]


def test_a_stream_in_flight_finishes_while_new_requests_are_refused(serving: Serving) -> None:
    with (
        httpx.Client(timeout=120) as cl,
        cl.stream("POST", serving.url + CHAT, json={**LONG, "max_tokens": 1500, "stream": True}) as r,
    ):
        lines = r.iter_lines()
        _first_content(lines)
        in_flight, ended = serving.begin(timeout_s=600)
        assert in_flight == 1  # the stream was running when the drain began

        refused = httpx.post(serving.url + CHAT, json={**LONG, "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert refused.json()["error"]["type"] == "service_unavailable_error"
        assert refused.headers["retry-after"] == "5" and refused.headers["connection"] == "close"
        assert httpx.get(serving.url + "/v1/models", timeout=10).status_code == 503  # every endpoint, not just chat
        ready = httpx.get(serving.url + "/readyz", timeout=10)
        assert ready.status_code == 503 and ready.json()["failing"] == ["accepting"]
        assert httpx.get(serving.url + "/healthz", timeout=10).status_code == 200  # alive: nobody restarts it mid-drain

        rest = [x for x in lines if x]
    assert _events(rest)[-1]["choices"][0]["finish_reason"] == "length" and rest[-1] == "data: [DONE]"
    assert ended.result(60) == 0  # nothing had to be ended


def test_at_the_deadline_a_stream_ends_with_an_error_event_and_frees_its_row(serving: Serving) -> None:
    before = serving.healthz()["aborted"]
    with (
        httpx.Client(timeout=120) as cl,
        cl.stream("POST", serving.url + CHAT, json={**LONG, "stream": True}) as r,
    ):
        lines = r.iter_lines()
        _first_content(lines)
        _, ended = serving.begin(timeout_s=0.5)
        rest = [x for x in lines if x]  # the stream ends: no cut connection (httpx would raise)
    last = _events(rest)[-1]
    assert last["error"]["code"] == "server_shutting_down" and "retry" in last["error"]["message"]
    assert "data: [DONE]" not in rest  # as OpenAI's streams end on an error
    assert ended.result(30) == 1
    until(lambda: serving.healthz()["running"] == 0, timeout=10)
    assert serving.healthz()["aborted"] == before + 1


def test_at_the_deadline_a_request_not_yet_answered_gets_503(serving: Serving) -> None:
    answer: cf.Future[httpx.Response] = cf.Future()
    threading.Thread(
        target=lambda: answer.set_result(httpx.post(serving.url + CHAT, json=LONG, timeout=120)), daemon=True
    ).start()
    until(lambda: serving.healthz()["running"] == 1, timeout=30)
    _, ended = serving.begin(timeout_s=0.5)
    r = answer.result(60)
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"
    assert r.headers["retry-after"] == "5"
    assert ended.result(30) == 1
    until(lambda: serving.healthz()["running"] == 0, timeout=10)


def test_with_nothing_in_flight_the_drain_does_not_wait_for_its_timeout(serving: Serving) -> None:
    in_flight, ended = serving.begin(timeout_s=3600)
    assert in_flight == 0 and ended.result(60) == 0
