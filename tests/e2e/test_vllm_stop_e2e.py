"""`skillpool serve --engine vllm` stopped with streams in flight: vLLM's EngineCore and Worker processes end with it.

SIGTERM after the first tokens: the short stream finishes, the long one ends with the final error event at the
deadline, a new request during the drain gets 503, the server exits 0 in time and no process of its tree (engine
core, worker, resource tracker) is alive 10 s later. SIGKILL: the engine core learns from the kernel that its parent
is gone (PR_SET_PDEATHSIG, asked for by our vLLM plugin), and none lives on. A second SIGTERM during the drain exits
at once, taking them along."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from skillpool.evaluation.process import ServerProcess
from skillpool.server.stopping import CLOSE_BUDGET_S
from tests.e2e.stopping import (
    assert_all_gone,
    exits,
    names,
    refused_while_draining,
    sigkill_while_streaming,
    sigterm_while_streaming,
    streaming,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TIMEOUT_S = 20.0
FLAGS = ["--engine", "vllm", "--max-model-len", "1024", "--max-batch-size", "4", "--shutdown-timeout", f"{TIMEOUT_S:g}"]


def engine_processes(procs: dict[int, object]) -> None:
    found = [n for n in names(procs) if "VLLM::" in n]  # vLLM names its processes VLLM::EngineCore, VLLM::Worker
    assert any("EngineCore" in n for n in found) and any("Worker" in n for n in found), names(procs)


def test_sigterm_drains_then_no_engine_process_outlives_the_server(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed: bash setup.sh --engine vllm")
    with ServerProcess(tmp_path / "data", FLAGS, startup_s=900) as srv:
        exit_s = TIMEOUT_S + CLOSE_BUDGET_S + 10
        procs, long = sigterm_while_streaming(srv, TIMEOUT_S, exit_s, long_tokens=900, check=engine_processes)
        assert long.error is not None and getattr(long.error, "code", None) == "server_shutting_down", long.error
    assert_all_gone(procs)


def test_after_sigkill_the_engine_processes_notice_and_exit(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed: bash setup.sh --engine vllm")
    with ServerProcess(tmp_path / "data", FLAGS, startup_s=900) as srv:
        procs = sigkill_while_streaming(srv, long_tokens=900, check=engine_processes)
    assert_all_gone(procs)


def test_a_second_signal_during_the_drain_exits_at_once_with_the_engine_processes(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed: bash setup.sh --engine vllm")
    flags = [*FLAGS[:-1], "600"]  # a drain that would wait ten minutes for the stream
    with ServerProcess(tmp_path / "data", flags, startup_s=900) as srv:
        assert srv.proc is not None
        procs, _ = streaming(srv, 900, engine_processes)
        srv.proc.send_signal(signal.SIGTERM)
        refused_while_draining(srv.url)  # draining, the stream still running
        srv.proc.send_signal(signal.SIGTERM)
        assert exits(srv.proc, 30) == 128 + signal.SIGTERM
    assert_all_gone(procs)
