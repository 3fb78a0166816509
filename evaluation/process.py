"""Run `skillpool serve` as a child process (benchmarks, end-to-end tests, evaluation drivers)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`with ServerProcess(data_dir) as srv:` starts a server on a free port and waits for /healthz."""

    def __init__(
        self,
        data_dir: Path,
        extra_args: list[str] | None = None,
        log_path: Path | None = None,
        startup_s: float = 300,
        python: str = sys.executable,  # another environment's interpreter: an install under test
    ) -> None:
        self.data_dir, self.extra_args, self.startup_s = Path(data_dir), list(extra_args or []), startup_s
        self.python = python
        self.log_path = log_path or self.data_dir.parent / f"{self.data_dir.name}-server.log"
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    health_path = "/healthz"

    def command(self) -> list[str]:
        """The server's command line (a subclass starts another server the same way: vLLM's own)."""
        return [
            self.python,
            "-m",
            "skillpool.cli.main",
            "serve",
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            *self.extra_args,
        ]

    def start(self) -> ServerProcess:
        self.port = free_port()
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
            cwd=Path(__file__).resolve().parent.parent,
        )
        log.close()
        deadline = time.time() + self.startup_s
        while time.time() < deadline:
            if (why := self.exited()) is not None:
                raise RuntimeError(why)
            try:
                if httpx.get(self.url + self.health_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server did not answer {self.health_path} within {self.startup_s:.0f}s:\n{self.log_tail()}")

    def exited(self) -> str | None:
        """Why the server is gone (exit code and log tail), or None while it runs: a poller that cannot reach it
        then stops at once instead of waiting out its patience."""
        if self.proc is None or self.proc.poll() is None:
            return None
        code = self.proc.returncode
        why = " (SIGKILL: the kernel's OOM killer, or a kill -9)" if code == -signal.SIGKILL else ""
        return f"the server exited with {code}{why}; its log ends:\n{self.log_tail()}"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()
