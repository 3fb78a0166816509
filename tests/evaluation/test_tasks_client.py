"""`TasksClient.follow` (behind `skillpool upload`, `eval continual`, the benchmarks and the end-to-end tests) against a real HTTP server that plays back
scripted answers: a stalled poll, a 5xx and a refused connection are retried within the patience; a 4xx, a
server silent past the patience or one that exited ends with a `FollowError` that names the job."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from skillpool.evaluation.process import ServerProcess, free_port
from skillpool.evaluation.tasks_client import FollowError, TasksClient
from skillpool.evaluation.upload import run as run_upload

JOB = "job-1"
Reply = tuple[float, int, dict[str, Any]]  # (seconds to stall first, status, JSON body)


def job(status: str, step: int = 1) -> dict[str, Any]:
    return {"id": JOB, "status": status, "method": "isolated", "progress": {"step": step, "total": 4, "loss": 1.0}}


class Scripted:
    """A real HTTP server whose GETs answer the scripted replies in turn (the last one repeats)."""

    def __init__(self, replies: list[Reply]) -> None:
        self.replies, self.gets, self.posts = replies, 0, 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on a stalled reply

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                stall, status, body = outer.replies[min(outer.gets, len(outer.replies) - 1)]
                outer.gets += 1
                time.sleep(stall)
                self._send(status, body)

            def do_POST(self) -> None:  # noqa: N802
                outer.posts += 1
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._send(202, job("queued"))

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> Scripted:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fast() -> Iterator[dict[str, float]]:
    yield {"poll_s": 0.05}


def follow(url: str, job_id: str, label: str, **kw: Any) -> dict[str, Any]:
    """The client's follow with a 0.5 s poll timeout, quietly."""
    return TasksClient(url, timeout_s=0.5).follow(job_id, label, progress=False, **kw)


def test_a_stalled_poll_and_a_5xx_are_retried_until_the_job_ends(fast: dict[str, float]) -> None:
    replies: list[Reply] = [
        (0, 200, job("running", 1)),
        (2.0, 200, job("running", 2)),  # answers after the client's 0.5 s timeout
        (0, 503, {"error": {"message": "overloaded"}}),
        (0, 200, job("running", 3)),
        (0, 200, job("succeeded", 4)),
    ]
    with Scripted(replies) as srv:
        done = follow(srv.url, JOB, "t", patience_s=30, **fast)
    assert done["status"] == "succeeded" and done["progress"]["step"] == 4
    assert srv.gets == 5


def test_a_refused_status_ends_at_once_with_the_servers_message(fast: dict[str, float]) -> None:
    with Scripted([(0, 404, {"error": {"message": "no task with id 'job-1'"}})]) as srv:
        with pytest.raises(FollowError, match=r"refused \(404\).*no task with id"):
            follow(srv.url, JOB, "t", patience_s=30, **fast)
    assert srv.gets == 1


def test_a_server_silent_past_the_patience_ends_with_an_error_naming_the_job(fast: dict[str, float]) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: every poll is refused
    t0 = time.monotonic()
    with pytest.raises(FollowError, match=f"no status for job {JOB}"):
        follow(url, JOB, "t", patience_s=0.5, **fast)
    assert time.monotonic() - t0 >= 0.5  # it kept retrying for the whole patience before giving up


def test_a_server_that_exited_ends_the_wait_at_once_with_why(tmp_path: Path, fast: dict[str, float]) -> None:
    srv = ServerProcess(tmp_path / "data")
    srv.log_path.write_text("training yelp ...\n")
    assert srv.exited() is None  # never started: nothing to report
    srv.proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    srv.proc.wait()
    why = srv.exited()
    assert why is not None and f"exited with {-signal.SIGKILL}" in why and "OOM" in why and "training yelp" in why
    url = f"http://127.0.0.1:{free_port()}"
    # the patience would wait 60 s and then say "no status"; the exit ends the first failed poll with its reason
    with pytest.raises(FollowError, match=f"job {JOB}: the server exited"):
        follow(url, JOB, "t", patience_s=60, gone=srv.exited, **fast)


def test_upload_exits_1_with_the_error_when_the_job_cannot_be_followed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = tmp_path / "t.jsonl"
    rows.write_text('{"instruction": "Say hi.", "output": "hi"}\n')
    args = argparse.Namespace(
        file=rows,
        name="t",
        url="",
        method=None,
        config="{}",
        force=False,
        new_version=False,
        api_key=None,
        no_wait=False,
    )
    with Scripted([(0, 404, {"error": {"message": "gone"}})]) as srv:
        args.url = srv.url
        assert run_upload(args) == 1
    assert srv.posts == 1 and "refused (404)" in capsys.readouterr().err
