"""The hub: one named actor through which every engine replica follows the skill pool.

An ingress's pool changes a skill in its engine (`RemoteEngine.add_skill` / `remove_skill`); the remote engine
turns that into a command here (add a version, remove a skill), numbered in one sequence. Every engine replica
long-polls for the commands after the last one it applied, applies them to its engine, and its next poll says how
far it got: `barrier(seq)` waits until every live replica has, which is how a retire or a rollback returns only
after no replica can serve the old version any more. A replica that has not polled for `STALE_S` is gone (Ray
restarts it empty); a new one starts at the current number, since it holds nothing the past could change.

Each poll also carries the replica's engine stats and the requests it served per multiplexed key since its last
poll, so the ingress sees the deployment's totals and a test sees which replica served what.

A plain class, so its logic runs without Ray; `hub_handle` makes it a detached Ray actor (one per application).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

NAMESPACE = "skillpool"
POLL_S = 1.0  # the longest a replica's poll waits for a command: it says it is alive at least this often
STALE_S = 5.0  # a replica silent this long has died: no barrier waits for it
KEEP = 10_000  # commands kept; a replica further behind drops what it holds (it reloads from the store)


@dataclass(frozen=True)
class Command:
    """`add`: serve `name` at `version` (a replica holding another version swaps it); `remove`: stop serving it."""

    seq: int
    kind: str
    name: str
    version: int | None = None


@dataclass(frozen=True)
class PollReply:
    seq: int  # the replica has everything up to here once it applies `commands`
    commands: tuple[Command, ...]
    resync: bool = False  # it missed commands: drop every skill it holds, resolve each again on use


@dataclass
class ReplicaView:
    acked: int
    seen: float
    stats: dict[str, int] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)  # requests per multiplexed key, since it started
    versions: dict[str, int] = field(default_factory=dict)  # the skill versions its engine holds


class SkillHub:
    def __init__(self, keep: int = KEEP, stale_s: float = STALE_S) -> None:
        self.keep, self.stale_s = keep, stale_s
        self._log: deque[Command] = deque(maxlen=keep)
        self._seq = 0
        self._replicas: dict[str, ReplicaView] = {}
        self._changed: asyncio.Condition | None = None  # made on the actor's own event loop, at first use

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        async with self._cond():
            self._cond().notify_all()

    async def command(self, kind: str, name: str, version: int | None = None) -> int:
        """Append a command for every replica; its number (for `barrier`)."""
        if kind not in ("add", "remove"):
            raise ValueError(f"unknown command {kind!r}")
        self._seq += 1
        self._log.append(Command(self._seq, kind, name, version))
        await self._notify()
        return self._seq

    async def poll(self, replica: str, since: int, report: dict[str, Any], timeout: float = POLL_S) -> PollReply:
        """The commands after `since` (the last one `replica` applied), waiting up to `timeout` for one."""
        now = time.monotonic()
        view = self._replicas.get(replica)
        if view is None or since < 0 or since > self._seq:  # new, or it outlived an earlier hub: start from now
            self._replicas[replica] = ReplicaView(self._seq, now)
            self._merge(self._replicas[replica], report)
            await self._notify()
            return PollReply(self._seq, (), resync=since >= 0)
        view.acked, view.seen = since, now
        self._merge(view, report)
        await self._notify()  # a barrier may be waiting for this acknowledgement
        if since == self._seq:
            async with self._cond():
                try:
                    await asyncio.wait_for(self._cond().wait_for(lambda: self._seq > since), timeout)
                except asyncio.TimeoutError:
                    pass
        oldest = self._log[0].seq if self._log else self._seq + 1
        if since + 1 < oldest and since < self._seq:  # the commands it needs were trimmed
            return PollReply(self._seq, (), resync=True)
        return PollReply(self._seq, tuple(c for c in self._log if c.seq > since))

    @staticmethod
    def _merge(view: ReplicaView, report: dict[str, Any]) -> None:
        view.stats = dict(report.get("stats") or view.stats)
        for key, n in (report.get("served") or {}).items():
            view.served[key] = view.served.get(key, 0) + int(n)
        if report.get("versions") is not None:
            view.versions = dict(report["versions"])

    def _live(self) -> dict[str, ReplicaView]:
        cutoff = time.monotonic() - self.stale_s
        for name in [n for n, v in self._replicas.items() if v.seen < cutoff]:
            del self._replicas[name]  # its process is gone; a restarted replica polls under a new id
        return self._replicas

    async def barrier(self, seq: int, timeout: float) -> list[str]:
        """Wait until every live replica has applied command `seq`; the replicas that had not by `timeout`."""

        def behind() -> list[str]:
            return sorted(n for n, v in self._live().items() if v.acked < seq)

        async with self._cond():
            try:
                await asyncio.wait_for(self._cond().wait_for(lambda: not behind()), timeout)
            except asyncio.TimeoutError:
                pass
        return behind()

    async def replicas(self) -> dict[str, dict[str, Any]]:
        """Every live replica: its engine stats, requests per key, skill versions and seconds since it polled."""
        now = time.monotonic()
        return {
            name: {"stats": v.stats, "served": dict(v.served), "versions": dict(v.versions), "age_s": now - v.seen}
            for name, v in self._live().items()
        }

    async def forget(self, replica: str) -> None:
        """A replica shutting down: no barrier waits for it."""
        self._replicas.pop(replica, None)
        await self._notify()


def hub_handle(name: str) -> Any:
    """The hub actor named `name` (created detached at first use: it outlives the process that made it)."""
    import ray

    actor = ray.remote(SkillHub).options(  # type: ignore[attr-defined]
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0
    )
    return actor.remote()
