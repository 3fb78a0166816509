"""The stop notice: one named actor through which `skillpool serve --replicas` has its ingress replicas drain.

No signal reaches the ingress replicas (Ray workers, maybe on other machines), and Ray Serve's own stop removes the
route at once (new requests would get its 404, not our 503). So the process that deployed the application posts
the stop here (`begin`); every ingress replica long-polls `wait_begun`, drains as one server does
(server/stopping.py: readiness 503, new requests 503 with Retry-After, the requests in flight get the timeout),
and says `drained`; the deployer waits for them all (`wait_drained`), then deletes the application.

A plain class, so its logic runs without Ray; `notice_handle` makes it a detached Ray actor (one per application).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .hub import NAMESPACE

POLL_S = 1.0  # the longest one `wait_begun` waits: an ingress replica asks again after it


class StopNotice:
    def __init__(self) -> None:
        self._deadline: float | None = None  # monotonic: when the requests in flight must be done
        self._drained: set[str] = set()
        self._changed: asyncio.Condition | None = None  # made on the actor's own event loop, at first use

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def reset(self) -> None:
        """A new deployment under this name: no stop (a detached actor outlives a deployer that was killed)."""
        self._deadline = None
        self._drained.clear()

    async def begin(self, timeout_s: float) -> None:
        """Stop: the ingress replicas drain, their requests in flight given `timeout_s` from now."""
        if self._deadline is None:
            self._deadline = time.monotonic() + max(timeout_s, 0.0)
        async with self._cond():
            self._cond().notify_all()

    async def wait_begun(self, wait_s: float = POLL_S) -> float | None:
        """The seconds the drain has left once the stop has begun (waiting up to `wait_s` for it), else None."""
        async with self._cond():
            try:
                await asyncio.wait_for(self._cond().wait_for(lambda: self._deadline is not None), wait_s)
            except asyncio.TimeoutError:
                return None
        assert self._deadline is not None
        return max(self._deadline - time.monotonic(), 0.0)

    async def drained(self, replica: str) -> None:
        self._drained.add(replica)
        async with self._cond():
            self._cond().notify_all()

    async def wait_drained(self, count: int, wait_s: float) -> int:
        """How many ingress replicas have drained, once `count` have or after `wait_s`."""
        async with self._cond():
            try:
                await asyncio.wait_for(self._cond().wait_for(lambda: len(self._drained) >= count), wait_s)
            except asyncio.TimeoutError:
                pass
        return len(self._drained)


def notice_handle(name: str) -> Any:
    """The stop notice actor named `name` (created detached at first use, like the hub)."""
    import ray

    actor = ray.remote(StopNotice).options(  # type: ignore[attr-defined]
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0
    )
    return actor.remote()
