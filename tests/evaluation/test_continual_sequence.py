"""The server side of `eval continual`: the flags of the server it starts, and a request sent again after a reset."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import pytest

from skillpool.evaluation import continual_sequence
from skillpool.evaluation.continual_sequence import server_argv
from skillpool.evaluation.continual_task import Task


def test_server_args_reach_the_server_after_the_runs_own_flags(tmp_path: Path) -> None:
    args = argparse.Namespace(model=tmp_path, server_argv=["--max-batch-size", "64", "--router-top-k", "1"])
    assert server_argv(args, "dtkr") == [
        "--router-mode",
        "dtkr",
        "--model",
        str(tmp_path),
        "--max-batch-size",
        "64",
        "--router-top-k",
        "1",
    ]
    assert server_argv(argparse.Namespace(model=None), "sapt") == ["--router-mode", "sapt"]


class FlakyChat:
    """A real HTTP endpoint for chat completions that resets the connection of its first `resets` requests (as a
    server closing an idle keep-alive connection while the client reuses it does) and answers "a" after that;
    `delay` seconds before each answer."""

    def __init__(self, resets: int, delay: float = 0.0) -> None:
        import socket
        import struct
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.calls = 0
        lock = threading.Lock()
        flaky = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    flaky.calls += 1
                    reset = flaky.calls <= resets
                if reset:  # SO_LINGER 0: close() sends a RST, so the client reads "connection reset by peer"
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.connection.close()
                    self.close_connection = True
                    return
                time.sleep(delay)
                message = {"role": "assistant", "content": "a"}
                reply = {"id": "c", "object": "chat.completion", "created": 0, "model": body["model"]}
                reply["choices"] = [{"index": 0, "message": message, "finish_reason": "stop"}]
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("x-skillpool-route", "t=1.000")
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def client(self, timeout: float = 30) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.url, api_key="unused", max_retries=0, timeout=timeout)  # as eval continual's


def test_ask_sends_again_a_request_whose_connection_was_reset() -> None:
    from openai import APIConnectionError, APITimeoutError

    task = Task("t", b"", [], [{"messages": [{"role": "user", "content": "q"}], "answer": "a"}] * 3, "exact_match")
    # two resets: the run's first try fails whether or not the client's transport sends a reset request twice
    flaky = FlakyChat(resets=2)
    try:
        assert continual_sequence._ask(flaky.client(), "auto", task, 1) == (["a"] * 3, ["t=1.000"] * 3)
    finally:
        flaky.server.shutdown()
    dead = FlakyChat(resets=10**6)  # every request reset: after CONNECTION_TRIES the error ends the run
    try:
        with pytest.raises(APIConnectionError):
            continual_sequence._ask(dead.client(), "auto", task, 1)
        assert dead.calls >= continual_sequence.CONNECTION_TRIES
    finally:
        dead.server.shutdown()
    slow = FlakyChat(resets=0, delay=1.0)  # a timeout is the server being slow, not gone: not sent again
    try:
        with pytest.raises(APITimeoutError):
            continual_sequence._ask(slow.client(timeout=0.2), "auto", task, 1)
        assert slow.calls < continual_sequence.CONNECTION_TRIES  # not ours to send again (the transport may, once)
    finally:
        slow.server.shutdown()
