"""A server's parts behind the real app on uvicorn, in a thread, on a free port: real HTTP for the clients under test."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn

from skillpool.evaluation.process import free_port
from skillpool.server.app import create_app


@contextmanager
def live(components: Any, startup_s: float = 60) -> Iterator[str]:
    """The app serving `components` until the block ends; yields its root URL once /healthz answers."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(components), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    root = f"http://127.0.0.1:{port}"
    deadline = time.time() + startup_s
    while time.time() < deadline:
        try:
            httpx.get(root + "/healthz", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    try:
        yield root
    finally:
        server.should_exit = True
        thread.join(10)
