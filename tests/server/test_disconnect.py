"""A client that goes away frees its engine slot, streaming or not (a real uvicorn server on a free port)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from skillpool.evaluation.process import free_port
from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.server.config import ServerConfig
from tests.conftest import LONG_ANSWER


@pytest.fixture(scope="module")
def url(tiny_long, embedder, tmp_path_factory) -> Iterator[str]:  # type: ignore[no-untyped-def]
    # one slot: a second request waits in the queue while the first decodes
    cfg = ServerConfig(data_dir=tmp_path_factory.mktemp("data"), max_batch_size=1)
    c = build_components(cfg, base=tiny_long, embedder=embedder)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(c), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    root = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            httpx.get(root + "/healthz", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield root
    server.should_exit = True
    thread.join(10)
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


def test_a_non_streaming_client_that_times_out_aborts_its_request(url: str) -> None:
    before = aborted(url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/chat/completions", json=BODY, timeout=1.0)
    assert running_after_wait(url, 0) == 0
    assert aborted(url) == before + 1


def health(url: str) -> dict[str, int]:
    return dict(httpx.get(url + "/healthz").json())


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
        with pytest.raises(httpx.ReadTimeout):  # this one waits in the queue, and its client gives up
            httpx.post(url + "/v1/chat/completions", json={**BODY, "stream": stream}, timeout=1.0)
        deadline = time.time() + 10
        while health(url)["waiting"] and time.time() < deadline:
            time.sleep(0.05)
        h = health(url)
        assert (h["waiting"], h["running"]) == (0, 1)  # gone from the queue while the first still decodes
        assert aborted(url) == before + 1
    assert running_after_wait(url, 0) == 0
