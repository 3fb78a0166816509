"""End to end: `skillpool serve --api-keys-file` re-reads its keys on SIGHUP; a bad file keeps the keys in use
and says why in the log; refused requests show in /metrics. A tiny LLaMA keeps the start short."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from skillpool.evaluation.process import ServerProcess

pytestmark = pytest.mark.slow


def status(url: str, key: str | None, path: str = "/v1/models") -> int:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.get(url + path, headers=headers, timeout=30).status_code


def reload(srv: ServerProcess, keys: Path, text: str, marker: str) -> None:
    """Write the keys file, send SIGHUP and wait for the server to log `marker` once more."""
    before = srv.log_path.read_text(errors="replace").count(marker)
    keys.write_text(text)
    assert srv.proc is not None
    os.kill(srv.proc.pid, signal.SIGHUP)
    deadline = time.time() + 30
    while srv.log_path.read_text(errors="replace").count(marker) == before:
        assert time.time() < deadline, f"no {marker!r} in the log:\n{srv.log_tail()}"
        time.sleep(0.2)


def test_sighup_reloads_the_keys_file(tiny_base, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys"
    keys.write_text("root admin k-root-0001\n")
    with ServerProcess(tmp_path / "data", ["--model", str(tiny_base.path), "--api-keys-file", str(keys)]) as srv:
        assert "auth: keys: 1 admin; chat and models open to anyone" in srv.log_tail(100_000)
        assert status(srv.url, None) == 200 and status(srv.url, None, "/v1/files") == 401
        assert status(srv.url, "k-alice-0002") == 401

        reload(srv, keys, "root admin k-root-0001\nalice chat k-alice-0002\n", "auth: keys reloaded")
        assert status(srv.url, "k-alice-0002") == 200 and status(srv.url, "k-alice-0002", "/v1/files") == 200
        assert status(srv.url, None) == 401  # a chat key exists now: no key, no chat

        reload(srv, keys, "root admin k-root-0001\nalice chat\n", "auth: keys not reloaded")
        assert "line 2: expected NAME ROLE KEY" in srv.log_tail(100_000)
        assert status(srv.url, "k-alice-0002") == 200  # the old keys still serve

        assert httpx.get(srv.url + "/metrics", timeout=30).status_code == 401  # with keys: a key of its own
        root = {"authorization": "Bearer k-root-0001"}
        metrics = httpx.get(srv.url + "/metrics", headers=root, timeout=30).text
        assert 'skillpool_requests_total{endpoint="/v1/models",status="401"}' in metrics
        assert srv.exited() is None
