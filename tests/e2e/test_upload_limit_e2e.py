"""A 400 MiB chunked upload over a real socket is cut off with 413 after about --max-upload-mb, early (no timed assertion:
the MiB sent before the answer are the measure), and the server's memory stays flat (it never buffers what it refuses)."""

from __future__ import annotations

import select
import socket
import time
from pathlib import Path

import pytest

from skillpool.evaluation.process import ServerProcess

pytestmark = pytest.mark.slow
LIMIT_MB = 8
CHUNK = 1 << 20


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_huge_chunked_upload_gets_413_early_and_memory_stays_flat(tiny_base, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    args = ["--model", str(tiny_base.path), "--max-upload-mb", str(LIMIT_MB)]
    with ServerProcess(tmp_path / "data", args) as srv:
        assert srv.proc is not None
        before = _rss_mb(srv.proc.pid)
        boundary = "skillpoolboundary"
        head = (
            f"--{boundary}\r\n"
            'Content-Disposition: form-data; name="name"\r\n\r\nbig\r\n'
            f"--{boundary}\r\n"
            'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
            "Content-Type: application/jsonl\r\n\r\n"
        ).encode()
        line = b'{"input": "' + b"x" * 1000 + b'", "output": "y"}\n'
        body_chunk = line * (CHUNK // len(line))
        sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        sock.sendall(
            (
                f"POST /tasks HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Content-Type: multipart/form-data; boundary={boundary}\r\nTransfer-Encoding: chunked\r\n\r\n"
            ).encode()
        )
        sent, t0, reply = 0, time.perf_counter(), b""
        try:
            for i in range(400):
                data = head + body_chunk if i == 0 else body_chunk
                sock.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                sent += len(data)
                if select.select([sock], [], [], 0)[0]:  # the server answered before the body ended
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass  # it closed the connection on us: its answer is waiting in the socket
        elapsed = time.perf_counter() - t0
        sock.settimeout(10)
        try:
            while b"\r\n\r\n" not in reply and (part := sock.recv(65536)):
                reply += part
        finally:
            sock.close()
        after = _rss_mb(srv.proc.pid)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
    assert sent < 4 * LIMIT_MB * CHUNK, f"sent {sent / CHUNK:.0f} MiB before the server answered"
    print(f"413 after {sent / CHUNK:.0f} MiB in {elapsed:.2f} s; server RSS {before:.0f} -> {after:.0f} MiB")
    assert after - before < 4 * LIMIT_MB + 50, (before, after)  # nothing like the 400 MiB offered
