"""`skillpool serve --replicas 2` on the local Ray it starts (the tiny LLaMA with a long context as the model, so
that a stream lasts), stopped with streams in flight.

SIGTERM after the first tokens: the ingress replica drains as one server does (a short stream finishes, a new
request gets 503 with Retry-After, a long one finishes or ends with the final error at the deadline), the
application is deleted, the local Ray stops, the process exits 0, and none of the processes it started (Ray's GCS,
raylet, Serve's controller and proxy, the replicas) is alive 10 s later. SIGKILL: Ray's own fate sharing ends its
GCS and raylet, the reaper (runtime/reaper.py) the rest."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from skillpool.evaluation.process import ServerProcess
from tests.conftest import until
from tests.e2e.stopping import assert_all_gone, names, sigkill_while_streaming, sigterm_while_streaming

pytestmark = pytest.mark.slow
pytest.importorskip("ray", reason="the cluster extra: pip install -e .[cluster]")

TIMEOUT_S = 15.0
UNDEPLOY_S = 60.0  # after the drain: deleting the application and stopping the local Ray


@contextmanager
def start(tmp_path: Path, model: Any) -> Iterator[ServerProcess]:
    """The server once its deployment is done: the ingress answers a little before, and a signal then (while the
    deployment is still being waited on) undeploys at once, without the drain under test."""
    flags = ["--replicas", "2", "--threads", "1", "--model", str(model.path), "--shutdown-timeout", f"{TIMEOUT_S:g}"]
    with ServerProcess(tmp_path / "data", flags, startup_s=600) as srv:
        until(lambda: "skillpool: serving on Ray Serve" in srv.log_tail(10**6), timeout=300)
        yield srv


def ray_processes(procs: dict[int, Any]) -> None:
    found = names(procs)
    assert any("raylet" in n for n in found) and any("gcs_server" in n for n in found), found


def test_sigterm_drains_the_ingress_then_stops_ray_and_everything_it_started(tmp_path: Path, tiny_long: Any) -> None:
    with start(tmp_path, tiny_long) as srv:
        procs, long = sigterm_while_streaming(srv, TIMEOUT_S, TIMEOUT_S + UNDEPLOY_S, 8000, check=ray_processes)
        # finished in time, or ended by the drain: never cut
        assert long.finish_reason == "length" or getattr(long.error, "code", None) == "server_shutting_down", long.error
    assert_all_gone(procs)


def test_after_sigkill_rays_fate_sharing_ends_what_the_server_started(tmp_path: Path, tiny_long: Any) -> None:
    with start(tmp_path, tiny_long) as srv:
        procs = sigkill_while_streaming(srv, long_tokens=8000, check=ray_processes)
    assert_all_gone(procs)
