"""`skillpool serve --replicas 2` on the local Ray it starts (the tiny LLaMA with a long context as the model, so
that a stream lasts), stopped with streams in flight.

SIGTERM after the first tokens: the ingress replica drains as one server does (a short stream finishes, a new
request gets 503 with Retry-After, a long one finishes or ends with the final error at the deadline), the
application is deleted, the local Ray stops, the process exits 0, and none of the processes it started (Ray's GCS,
raylet, Serve's controller and proxy, the replicas) is alive 10 s later. SIGKILL: Ray's own fate sharing ends them."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from skillpool.evaluation.process import ServerProcess
from tests.conftest import make_tiny_base
from tests.e2e.stopping import Stream, assert_all_gone, exits, names, refused_while_draining, tree

pytestmark = pytest.mark.slow
pytest.importorskip("ray", reason="the cluster extra: pip install -e .[cluster]")

TIMEOUT_S = 15.0
UNDEPLOY_S = 60.0  # after the drain: deleting the application and stopping the local Ray


@pytest.fixture(scope="module")
def tiny_long(smollm: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_tiny_base(smollm, tmp_path_factory.mktemp("tiny-long"), max_positions=8192)


def start(tmp_path: Path, model: Any) -> ServerProcess:
    flags = ["--replicas", "2", "--threads", "1", "--model", str(model.path), "--shutdown-timeout", f"{TIMEOUT_S:g}"]
    return ServerProcess(tmp_path / "data", flags, startup_s=600)


def ray_processes(procs: dict[int, Any]) -> None:
    found = names(procs)
    assert any("raylet" in n for n in found) and any("gcs_server" in n for n in found), found


def test_sigterm_drains_the_ingress_then_stops_ray_and_everything_it_started(tmp_path: Path, tiny_long: Any) -> None:
    with start(tmp_path, tiny_long) as srv:
        assert srv.proc is not None
        long = Stream(srv.url, max_tokens=8000, ignore_eos=True)
        long.wait_first()
        short = Stream(srv.url, max_tokens=24)
        short.wait_first()
        procs = tree(srv.proc.pid)
        ray_processes(procs)
        srv.proc.send_signal(signal.SIGTERM)

        refused_while_draining(srv.url)
        short.ended(TIMEOUT_S + 30)
        assert short.error is None and short.finish_reason == "length"
        long.ended(TIMEOUT_S + 30)  # finished in time, or ended by the drain: never cut
        assert long.finish_reason == "length" or getattr(long.error, "code", None) == "server_shutting_down", long.error
        assert exits(srv.proc, TIMEOUT_S + UNDEPLOY_S) == 0, srv.log_tail()
    assert_all_gone(procs)


def test_after_sigkill_rays_fate_sharing_ends_what_the_server_started(tmp_path: Path, tiny_long: Any) -> None:
    with start(tmp_path, tiny_long) as srv:
        assert srv.proc is not None
        stream = Stream(srv.url, max_tokens=8000, ignore_eos=True)
        stream.wait_first()
        procs = tree(srv.proc.pid)
        ray_processes(procs)
        srv.proc.send_signal(signal.SIGKILL)
        assert exits(srv.proc, 30) == -signal.SIGKILL
    assert_all_gone(procs)
