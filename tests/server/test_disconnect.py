"""A client that goes away frees its engine slot, streaming or not (a real uvicorn server on a free port)."""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.server.config import ServerConfig
from tests.conftest import LONG_ANSWER, served, until


@pytest.fixture(scope="module")
def url(tiny_long, embedder, tmp_path_factory) -> Iterator[str]:  # type: ignore[no-untyped-def]
    # one slot: a second request waits in the queue while the first decodes
    cfg = ServerConfig.of(data_dir=tmp_path_factory.mktemp("data"), max_batch_size=1)
    c = build_components(cfg, base=tiny_long, embedder=embedder)
    with served(create_app(c)) as root:
        yield root
    c.close()


BODY = LONG_ANSWER


def running_after_wait(url: str, want: int, timeout: float = 10) -> int:
    deadline = time.time() + timeout
    running = -1
    while time.time() < deadline:
        running = httpx.get(url + "/healthz").json()["running"]
        if running == want:
            break
        time.sleep(0.05)
    return running


def aborted(url: str) -> int:
    return int(httpx.get(url + "/healthz").json()["aborted"])


def test_a_streaming_client_that_leaves_aborts_its_request(url: str) -> None:
    before = aborted(url)
    with (
        httpx.Client(timeout=60) as cl,
        cl.stream("POST", url + "/v1/chat/completions", json={**BODY, "stream": True}) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        seen = [next(lines) for _ in range(6)]
        assert any('"content"' in x for x in seen)
        assert running_after_wait(url, 1) == 1
    assert running_after_wait(url, 0) == 0
    assert aborted(url) == before + 1  # it ended by abort, not by running out of tokens


def health(url: str) -> dict[str, int]:
    return dict(httpx.get(url + "/healthz").json())


def leave_once(url: str, body: dict[str, object], state: str) -> None:
    """Send a chat request and close the connection, unanswered, once /healthz counts one more request in
    `state` ("running" or "waiting"): a client that gives up (a timeout, a closed tab) at a known point."""
    before = health(url)[state]
    conn = http.client.HTTPConnection(urlsplit(url).netloc, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        until(lambda: health(url)[state] == before + 1, timeout=10)
    finally:
        conn.close()


def test_a_non_streaming_client_that_gives_up_aborts_its_request(url: str) -> None:
    before = aborted(url)
    leave_once(url, BODY, "running")
    assert running_after_wait(url, 0) == 0
    assert aborted(url) == before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_while_queued_frees_its_place(url: str, stream: bool) -> None:
    before = aborted(url)
    with (
        httpx.Client(timeout=60) as cl,
        cl.stream("POST", url + "/v1/chat/completions", json={**BODY, "stream": True}) as running,
    ):
        assert running.status_code == 200
        lines = running.iter_lines()  # kept: a dropped line iterator closes the response
        next(lines)
        assert running_after_wait(url, 1) == 1  # the only slot is taken
        leave_once(url, {**BODY, "stream": stream}, "waiting")  # this one waits in the queue, and its client gives up
        deadline = time.time() + 10
        while health(url)["waiting"] and time.time() < deadline:
            time.sleep(0.05)
        h = health(url)
        assert (h["waiting"], h["running"]) == (0, 1)  # gone from the queue while the first still decodes
        assert aborted(url) == before + 1
    assert running_after_wait(url, 0) == 0
