"""`skillpool serve` (hf engine, the real SmolLM2) stopped as an orchestrator stops it, with streams in flight.

SIGTERM after the first tokens, with an in-process trainer or `--no-trainer` on Redis: a short stream finishes with its finish_reason, a long one ends at the deadline with
the final error event, a new request during the drain gets 503 with Retry-After, the server exits 0 within the
timeout and its close, and no process of its tree is alive 10 s later. SIGKILL: the streams are cut, and still no
process of the tree lives on. vLLM's engine processes: tests/e2e/test_vllm_stop_e2e.py; --replicas and
`skillpool worker`: test_stop_cluster_e2e.py, test_stop_worker_e2e.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import APIError

from skillpool.evaluation.process import ServerProcess
from skillpool.server.stopping import CLOSE_BUDGET_S
from tests.conftest import start_redis
from tests.e2e.stopping import assert_all_gone, sigkill_while_streaming, sigterm_while_streaming

pytestmark = pytest.mark.slow
TIMEOUT_S = 20.0  # --shutdown-timeout: the short stream's 24 tokens fit it, the long stream's 1,500 do not


@pytest.fixture(params=["trainer", "no-trainer"])
def trainer_flags(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[list[str]]:
    """An in-process trainer, or `--redis-url URL --no-trainer` (workers train elsewhere)."""
    if request.param == "trainer":
        yield []
        return
    redis_proc, url = start_redis(tmp_path / "redis")
    yield ["--redis-url", url, "--no-trainer"]
    redis_proc.terminate()
    redis_proc.wait(timeout=10)


def test_sigterm_drains_then_nothing_outlives_the_server(tmp_path: Path, trainer_flags: list[str]) -> None:
    flags = ["--shutdown-timeout", f"{TIMEOUT_S:g}", "--threads", "1", *trainer_flags]
    with ServerProcess(tmp_path / "data", flags) as srv:
        procs, long = sigterm_while_streaming(srv, TIMEOUT_S, TIMEOUT_S + CLOSE_BUDGET_S + 10, long_tokens=1500)
        assert isinstance(long.error, APIError) and long.error.code == "server_shutting_down", long.error
        assert "SIGTERM: stopping; 2 request(s) in flight" in srv.log_tail(20_000)  # both streams were drained
    assert_all_gone(procs)


def test_after_sigkill_nothing_the_server_started_lives_on(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "data", ["--threads", "1"]) as srv:
        procs = sigkill_while_streaming(srv, long_tokens=1500)
    assert_all_gone(procs)
