"""Draining: how the HTTP side of a stopping server lets its requests finish (a plain ASGI middleware).

While the server serves, the gate only keeps the requests in flight. Once `Drain.stop` begins (the first SIGTERM
or SIGINT, server/stopping.py): `/readyz` answers 503 so that balancers stop sending; every new request gets
`503 server_shutting_down` with Retry-After and `Connection: close`; the requests in flight go on. Those still
running at the deadline are ended, never cut: a response not begun gets the same 503, an event stream a final
error event (as OpenAI reports an error mid-stream), any other response the end of its body. Their handlers
are cancelled, which aborts their engine requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import envelope

log = logging.getLogger(__name__)

PROBES = frozenset({"/healthz", "/readyz", "/metrics"})  # answered while draining: orchestrators read them
RETRY_AFTER_S = 5
CODE = "server_shutting_down"
REFUSED = "the server is shutting down and takes no new requests; retry in a moment"
CUT = "the server stopped before this response was finished; retry the request"
END_GRACE_S = 5.0  # after the deadline: how long the cut requests get to send their last message


@dataclass(eq=False)
class _Flight:
    """One request in flight: its handler's task, and how far its response got."""

    task: asyncio.Future[None]
    started: bool = False
    stream: bool = False  # an event stream: it ends with an error event
    ended: bool = False
    cut: bool = False


class Drain:
    """The requests in flight, and the drain a stop begins. Used on the server's event loop only."""

    def __init__(self) -> None:
        self.draining = False
        self._flights: set[_Flight] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._flights)

    def begin(self) -> None:
        """From now on: readiness fails and new requests are refused."""
        self.draining = True

    async def stop(self, timeout_s: float) -> int:
        """Drain: begin, wait up to `timeout_s` for the requests in flight, then end those left (see the module);
        how many had to be ended."""
        self.begin()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(timeout_s, 0.0))
            return 0
        except asyncio.TimeoutError:
            pass
        flights = list(self._flights)
        log.warning("stopping: %d request(s) still running after %.0f s: ending them", len(flights), timeout_s)
        for f in flights:
            f.cut = True
            f.task.cancel()
        try:  # each gate sends its request's last message as its handler unwinds
            await asyncio.wait_for(self._idle.wait(), timeout=END_GRACE_S)
        except asyncio.TimeoutError:
            log.warning("stopping: %d request(s) did not end", len(self._flights))
        return len(flights)

    def _enter(self, flight: _Flight) -> None:
        self._flights.add(flight)
        self._idle.clear()

    def _leave(self, flight: _Flight) -> None:
        self._flights.discard(flight)
        if not self._flights:
            self._idle.set()


class DrainGate:
    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app, self.drain = app, drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await _refuse(send)
            return

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                flight.started = True
                headers = dict(message.get("headers") or [])
                flight.stream = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                flight.ended = True
            await send(message)

        # its own task, so that the drain can cancel this request alone and the gate still answers
        flight = _Flight(asyncio.ensure_future(self.app(scope, receive, tracked)))
        self.drain._enter(flight)
        try:
            await flight.task
        except asyncio.CancelledError:
            if not flight.cut:  # the server itself cancelled this request (not the drain): pass it on
                raise
            await _end(flight, send)
        finally:
            self.drain._leave(flight)


async def _refuse(send: Send) -> None:
    await _send_json(send, 503, envelope(503, REFUSED, None, CODE))


async def _end(flight: _Flight, send: Send) -> None:
    """The last message of a request the drain ended, for what its response had sent so far."""
    try:
        if not flight.started:
            await _send_json(send, 503, envelope(503, CUT, None, CODE))
        elif not flight.ended:
            event = f"data: {json.dumps(envelope(503, CUT, None, CODE))}\n\n".encode() if flight.stream else b""
            await send({"type": "http.response.body", "body": event, "more_body": False})
    except Exception as e:  # the client is gone already: nothing to tell
        log.debug("could not end a drained request: %s", e)


async def _send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    raw = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(raw)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
        (b"connection", b"close"),  # a kept-alive client reconnects, through its balancer, to a server that serves
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})
