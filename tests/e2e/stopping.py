"""What the stop tests share: a server's process tree, a long stream through the openai client in a thread, and the
checks a stop must pass (a new request during the drain gets 503, the server exits in time, nothing it started
lives on)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import psutil

from skillpool.evaluation.process import ServerProcess
from skillpool.runtime.processes import alive, descendants
from tests.conftest import until

PROMPT = [{"role": "user", "content": "Tell me a long story about the sea."}]
GONE_S = 10  # no process of the server may be alive this long after it exited


def tree(pid: int) -> dict[int, psutil.Process]:
    """The process and every process below it, by pid."""
    procs = [psutil.Process(pid), *descendants(pid)]
    return {p.pid: p for p in procs}


def names(procs: dict[int, psutil.Process]) -> list[str]:
    out = []
    for p in procs.values():
        try:
            # the executable's name first: a long install path would push it out of the cut command line
            out.append(f"{p.name()} {' '.join(p.cmdline())[:80]}")
        except psutil.Error:
            out.append("?")
    return out


def survivors(procs: dict[int, psutil.Process]) -> list[str]:
    return [f"{p.pid} {p.name()}" for p in procs.values() if alive(p)]


def assert_all_gone(procs: dict[int, psutil.Process]) -> None:
    """Within GONE_S, every recorded process has exited (zombies count as exited)."""
    try:
        until(lambda: not survivors(procs), timeout=GONE_S)
    except AssertionError:
        raise AssertionError(f"alive {GONE_S} s after the server exited: {survivors(procs)}") from None


class Stream:
    """One streamed chat completion in a thread: when its first token came, and how it ended."""

    def __init__(self, url: str, model: str = "base", max_tokens: int = 64, ignore_eos: bool = False) -> None:
        self.url, self.model, self.max_tokens, self.ignore_eos = url, model, max_tokens, ignore_eos
        self.first, self.done = threading.Event(), threading.Event()
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.tokens = 0
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        from openai import OpenAI

        client = OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        try:
            extra = {"ignore_eos": True} if self.ignore_eos else None
            chunks = client.chat.completions.create(
                model=self.model,
                messages=PROMPT,  # type: ignore[arg-type]
                max_tokens=self.max_tokens,
                temperature=0,
                stream=True,
                extra_body=extra,
            )
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    self.tokens += 1
                    self.first.set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    self.finish_reason = chunk.choices[0].finish_reason
        except BaseException as e:  # what a stop did to it: an error event, or a cut connection
            self.error = e
        finally:
            self.first.set()
            self.done.set()

    def wait_first(self, timeout: float = 300) -> None:
        assert self.first.wait(timeout), "no token within the timeout"
        assert self.error is None, f"the stream failed before its first token: {self.error!r}"

    def ended(self, timeout: float) -> None:
        assert self.done.wait(timeout), "the stream did not end"


def refused_while_draining(url: str) -> None:
    """A new request, once the drain has begun: 503 server_shutting_down with Retry-After, through the openai
    client (which would retry it if allowed); readiness fails too."""
    from openai import APIStatusError, OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

    seen: list[str] = []

    def draining() -> bool:
        t0 = time.monotonic()
        try:
            code = httpx.get(url + "/readyz", timeout=10).status_code
        except httpx.HTTPError as e:
            code = type(e).__name__
        seen.append(f"{code} in {time.monotonic() - t0:.1f} s")
        return code == 503

    try:
        until(draining, timeout=10)
    except AssertionError:
        raise AssertionError(f"readiness never failed during the drain: {seen}") from None
    try:
        client.chat.completions.create(model="base", messages=PROMPT, max_tokens=2)  # type: ignore[arg-type]
    except APIStatusError as e:
        body: Any = e.body
        error = body.get("error", body)  # the envelope, or (as openai's client keeps it) its "error"
        assert e.status_code == 503 and error["code"] == "server_shutting_down", body
        assert e.response.headers["retry-after"].isdigit()
    else:
        raise AssertionError("a request during the drain was served")


def exits(proc: subprocess.Popen[bytes], timeout: float) -> int:
    """The server's exit status, once it exits (within `timeout`)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the server did not exit within {timeout:g} s of the signal") from None


Check = Callable[[dict[int, psutil.Process]], object]  # what the recorded tree must hold (an engine's processes)


def streaming(
    srv: ServerProcess, max_tokens: int, check: Check | None = None
) -> tuple[dict[int, psutil.Process], Stream]:
    """A long stream (ignore_eos) past its first token, and the server's process tree recorded then."""
    assert srv.proc is not None
    stream = Stream(srv.url, max_tokens=max_tokens, ignore_eos=True)
    stream.wait_first(600)
    procs = tree(srv.proc.pid)
    if check is not None:
        check(procs)
    return procs, stream


def sigterm_while_streaming(
    srv: ServerProcess, timeout_s: float, exit_s: float, long_tokens: int, check: Check | None = None
) -> tuple[dict[int, psutil.Process], Stream]:
    """SIGTERM with a long stream and a short one (24 tokens) in flight: a new request gets 503, the short stream
    finishes, the long one ends somehow, the server exits 0 within `exit_s`. The tree, and the long stream."""
    assert srv.proc is not None
    procs, long = streaming(srv, long_tokens)
    short = Stream(srv.url, max_tokens=24)
    short.wait_first(600)
    procs |= tree(srv.proc.pid)
    if check is not None:
        check(procs)
    srv.proc.send_signal(signal.SIGTERM)
    refused_while_draining(srv.url)
    short.ended(timeout_s + 30)
    assert short.error is None and short.finish_reason == "length"
    long.ended(timeout_s + 30)
    assert exits(srv.proc, exit_s) == 0, srv.log_tail()
    return procs, long


def sigkill_while_streaming(
    srv: ServerProcess, long_tokens: int, check: Check | None = None
) -> dict[int, psutil.Process]:
    """SIGKILL with a long stream in flight; the tree recorded before."""
    assert srv.proc is not None
    procs, _ = streaming(srv, long_tokens, check)
    srv.proc.send_signal(signal.SIGKILL)
    assert exits(srv.proc, 30) == -signal.SIGKILL
    return procs
