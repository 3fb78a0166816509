"""How `skillpool serve` stops: drain, then close everything it started, then sweep its processes.

uvicorn alone closes its listening socket at the first signal, gives the requests in flight
`--timeout-graceful-shutdown`, and then re-raises the signal: a SIGTERM then ends the process before any cleanup
of ours, leaving vLLM's engine processes behind. Here the first SIGTERM or SIGINT instead:

1. drains (server/drain.py: readiness 503 at once, new requests 503 with Retry-After, the requests in flight get
   `--shutdown-timeout`, those left then end with a final error) while the trainer stops (a job of this process
   ends `failed`, `server_stopped`; a Redis job goes back to the queue);
2. lets uvicorn close its connections, then closes the components (routing, job queue, event bus, the engine:
   vLLM's shutdown ends its engine core and workers), within CLOSE_BUDGET_S;
3. stops any process still below this one (SIGTERM, then SIGKILL) and exits 0.

A second signal at any point exits at once, taking the processes below with it (runtime/processes.py). A server
killed with SIGKILL cannot do any of this: the processes it started end by themselves (vLLM's through
`die_with_parent`, a local Ray's through Ray's own fate sharing and the reaper, runtime/reaper.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import uvicorn

from skillpool.runtime.processes import STOP_SIGNALS, exit_now, on_stop_signals, stop_descendants

from .drain import Drain

if TYPE_CHECKING:
    from .components import Components

log = logging.getLogger(__name__)

CLOSE_BUDGET_S = 8.0  # after the drain: closing the components and the sweep; then the process exits regardless
SWEEP_GRACE_S = 3.0  # a process still below the server after the close: SIGTERM, then SIGKILL after this long
CONNECTIONS_GRACE_S = 3.0  # uvicorn's wait for connections after the drain (only idle ones are left)


async def wind_down(drain: Drain, components: Components, timeout_s: float) -> None:
    """Drain the HTTP requests and stop the trainer together, each within `timeout_s`."""
    training = asyncio.ensure_future(asyncio.to_thread(components.jobs.close, timeout_s))
    ended = await drain.stop(timeout_s)
    await training
    log.info("stopping: drained%s", f" ({ended} request(s) ended at the deadline)" if ended else "")


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with the first stop signal draining (wind_down) before it closes anything."""

    def __init__(self, config: uvicorn.Config, drain: Drain, components: Components, timeout_s: float) -> None:
        super().__init__(config)
        self.drain, self.components, self.timeout_s = drain, components, timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._winding: asyncio.Future[None] | None = None
        self._stopping = False

    async def startup(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Ours instead of uvicorn's, which re-raises the signal at the end (killing the process before the
        components close); the handlers in force before come back afterwards."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        on_stop_signals(lambda sig: self.handle_exit(sig, None))
        try:
            yield
        finally:
            for sig, handler in before.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """The first stop signal (a second one never gets here: see capture_signals); later calls do nothing."""
        if self._stopping:
            return
        self._stopping = True
        name = signal.Signals(sig).name
        print(
            f"skillpool: {name}: stopping; {self.drain.in_flight} request(s) in flight get up to "
            f"{self.timeout_s:g} s (another signal stops at once)",
            file=sys.stderr,
            flush=True,
        )
        if self._loop is None or not self.started:  # still starting: nothing in flight yet
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._start_winding)

    def _start_winding(self) -> None:
        async def run() -> None:
            try:
                await wind_down(self.drain, self.components, self.timeout_s)
            finally:
                self.should_exit = True

        self._winding = asyncio.ensure_future(run())


def serve(app: Any, components: Components, host: str, port: int, log_level: str, timeout_s: float) -> int:
    """Run the app until a stop signal, then stop as the module says; the exit status."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=int(CONNECTIONS_GRACE_S),
        access_log=False,  # the access log is ours (request_ids.py): each line ends with the request's x-request-id
    )
    server = DrainingServer(config, app.state.drain, components, timeout_s)
    try:
        server.run()
    finally:
        close(components)
    return 0


def close(components: Components) -> None:
    """Close the components and stop what is left below this process, all within CLOSE_BUDGET_S."""
    watchdog = threading.Timer(CLOSE_BUDGET_S, _overdue)
    watchdog.daemon = True
    watchdog.start()
    try:
        components.close()
        left = stop_descendants(SWEEP_GRACE_S)
        if left:
            log.warning("stopping: %d process(es) had to be killed", len(left))
    finally:
        watchdog.cancel()


def _overdue() -> None:
    print(f"skillpool: closing took over {CLOSE_BUDGET_S:g} s: stopping now", file=sys.stderr, flush=True)
    exit_now(signal.SIGTERM)
