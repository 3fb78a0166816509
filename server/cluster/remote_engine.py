"""The engine contract at the ingress, over the engine deployment's Ray Serve handle.

The app, the routing stage and the skill pool talk to this as to any engine (server/engines/protocol.py), so the
serving code does not fork. What differs:
- `generate` sends the request to the engine deployment with Ray Serve's `multiplexed_model_id` set to the mix's
  heaviest skill and its version (`name#vN`), or with `group_size` above 1 to that skill's neighbourhood
  (groups.py), so it lands on the replica that already holds that skill (base requests are unkeyed: any replica),
  and streams the replica's events back across the process boundary;
- `add_skill` sends no weights: a skill from the store travels as (name, version) and each replica reads it from
  the store itself; a skill that is not in the store yet (a candidate the quality gate judges) is sent by value,
  once, through Ray's object store;
- `remove_skill`, and an `add_skill` that replaces a version, return only when every live replica has applied the
  change (the hub's barrier): after a retire or a rollback no replica serves the old version.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from skillpool.adapters_store.store import SkillRecord

from ..engines import ConstraintError, EngineBusy, EngineDead, EngineEvent, EngineRequest, Mix, RequestTooLarge
from ..engines.chat_template import ChatFront
from ..engines.protocol import AdapterLoader, Choices
from .groups import SkillGroups
from .hub import STALE_S
from .replica import Refusal, WireRequest

log = logging.getLogger(__name__)

BARRIER_S = 10.0  # the longest a retire waits for the replicas; a silent one checks the store itself meanwhile
VIEW_S = 1.0  # how long the replicas' stats (from the hub) are reused before they are read again
_ids = itertools.count()


def routing_key(mix: Mix, versions: dict[str, int], groups: SkillGroups | None = None) -> str | None:
    """The multiplexed model id of a mix: its heaviest skill and that skill's version, or that skill's group
    where `groups` places it (None for the base model)."""
    top = mix.top
    if top is None:
        return None
    version = versions.get(top)
    if version is None:
        return f"{top}#inline"
    group = groups.key(top) if groups is not None else None
    return group or f"{top}#v{version}"


class RemoteEngine(ChatFront):
    def __init__(
        self,
        handle: Any,
        model_path: Path | str,
        hub: Any,
        keyed: bool = True,
        barrier_s: float = BARRIER_S,
        group_size: int = 1,
    ) -> None:
        """`handle`: the engine deployment's; `hub`: the hub actor; `keyed`: False sends every request unkeyed
        (the control the benchmarks compare affinity with); `group_size` above 1: keys by neighbourhoods of about
        that many related skills (groups.py)."""
        from transformers import AutoTokenizer

        self.handle, self.hub, self.keyed, self.barrier_s = handle, hub, keyed, barrier_s
        self.groups = SkillGroups(group_size) if group_size > 1 else None
        # a bad constraint is refused here, before a replica sees it (each replica compiles it again)
        self._front(AutoTokenizer.from_pretrained(str(model_path)))
        self.name, self.max_context = "remote", 0
        self._versions: dict[str, int] = {}  # store skills: name -> the version routed to
        self._inline: dict[str, AdapterLoader] = {}  # skills sent by value: name -> its loader
        self._refs: dict[str, Any] = {}  # their adapters in Ray's object store, put at first use
        self._lock = threading.Lock()
        self._streams: dict[str, Any] = {}  # request id -> its response stream (to cancel)
        self._view: tuple[float, dict[str, dict[str, Any]]] = (0.0, {})

    def _started(self, info: dict[str, Any]) -> None:
        self.name, self.max_context = str(info["name"]), int(info["max_context"])

    async def start(self) -> None:
        """Learn the engine's name and context length from a replica (waits until one is up)."""
        self._started(await self.handle.info.remote())

    def start_blocking(self) -> None:
        """`start` from a thread without an event loop (a driver script)."""
        self._started(self.handle.info.remote().result())

    # --- the contract ---------------------------------------------------------------------------
    def _wire(self, request: EngineRequest) -> tuple[WireRequest | None, str | None]:
        versions, inline = {}, {}
        with self._lock:
            for name in request.mix.skills:
                if name in self._versions:
                    versions[name] = self._versions[name]
                elif name in self._inline:
                    if name not in self._refs:
                        import ray

                        self._refs[name] = ray.put(self._inline[name]())
                    inline[name] = self._refs[name]
                else:
                    return None, name
        return WireRequest(request, versions, inline), routing_key(request.mix, versions, self.groups)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        wire, key = await asyncio.to_thread(self._wire, request)
        if wire is None:
            yield EngineEvent(finish_reason="error", error=f"skill {key!r} is not served", not_found=True)
            return
        from ray.exceptions import RayError
        from ray.serve.exceptions import BackPressureError

        options: dict[str, Any] = {"stream": True}
        if key is not None and self.keyed:
            options["multiplexed_model_id"] = key
        stream = self.handle.options(**options).generate.remote(wire)
        self._streams[request.request_id] = stream
        finished, choices = False, Choices(request.params.n)
        try:
            async for item in stream:
                if isinstance(item, Refusal):
                    finished = True
                    raise item.exception()
                finished = choices.over(item)
                yield item
                if finished:
                    return
            finished = True
            yield EngineEvent(finish_reason="error", error="the engine replica ended the stream early")
        except BackPressureError as e:
            finished = True
            raise EngineBusy(0) from e
        except RayError as e:  # the replica died mid-request (only its own requests fail): a 500, not a hang
            finished = True
            log.warning("request %s failed on an engine replica: %s", request.request_id, e)
            yield EngineEvent(finish_reason="error", error=f"the engine replica serving it failed: {type(e).__name__}")
        finally:
            self._streams.pop(request.request_id, None)
            if not finished:  # closed early: the client went away
                stream.cancel()

    def submit(self, request: EngineRequest, sink: Callable[[EngineEvent], None]) -> None:
        """Run the request on a thread of its own; a refusal reaches `sink` as an error event (no exception here:
        the replica's answer comes after this returns)."""

        async def pump() -> None:
            try:
                async for ev in self.generate(request):
                    sink(ev)
            except (EngineBusy, EngineDead, RequestTooLarge, ConstraintError) as e:
                sink(EngineEvent(finish_reason="error", error=str(e)))

        threading.Thread(target=asyncio.run, args=(pump(),), name=f"skillpool-remote-{next(_ids)}", daemon=True).start()

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.cancel()

    def add_skill(self, name: str, load: AdapterLoader) -> None:
        """A stored skill version (the pool passes its record's loader) goes by reference; anything else by value."""
        rec = getattr(load, "__self__", None)
        with self._lock:
            if not isinstance(rec, SkillRecord):
                self._inline[name] = load
                self._refs.pop(name, None)
                return
            old = self._versions.get(name)
            self._versions[name] = rec.version
            self._inline.pop(name, None)
        if self.groups is not None:
            self.groups.add_record(rec)
        if old is None or old == rec.version:  # a replica may still hold an older version: it swaps, no wait
            self.hub.command.remote("add", name, rec.version)
            return
        seq = self._call("command", "add", name, rec.version)  # a rollback or a new version: wait for every replica
        if seq is not None:
            self._barrier(seq, f"{name} v{old}")

    def remove_skill(self, name: str) -> None:
        with self._lock:
            self._versions.pop(name, None)
            self._inline.pop(name, None)
            self._refs.pop(name, None)
        if self.groups is not None:
            self.groups.remove(name)
        seq = self._call("command", "remove", name)
        if seq is not None:
            self._barrier(seq, name)

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        try:
            return ray.get(getattr(self.hub, method).remote(*args), timeout=self.barrier_s)
        except Exception as e:  # replicas that miss it check the store once their poll is late
            log.error("skill hub unreachable for %s%s: %s", method, args, e)
            return None

    def _barrier(self, seq: int, what: str) -> None:
        late = self._call("barrier", seq, self.barrier_s)
        if late:
            log.error("engine replicas %s did not confirm dropping %s within %.0f s", late, what, self.barrier_s)

    def replicas(self) -> dict[str, dict[str, Any]]:
        """Every live engine replica's last report (hub.py), read at most once a second."""
        at, view = self._view
        if time.monotonic() - at > VIEW_S:
            got = self._call("replicas")
            if got is not None:
                view = got
            self._view = (time.monotonic(), view)
        return view

    def healthy(self) -> bool:
        return any(r["stats"].get("healthy", 0) and r["age_s"] < STALE_S for r in self.replicas().values())

    def last_step_age(self) -> float:
        """The slowest live replica's: a stuck replica shows here (and Ray restarts it on its failed health check)."""
        ages = [r["stats"].get("last_step_age_ms", 0) / 1000 for r in self.replicas().values()]
        return max(ages) if ages else float("inf")

    def replica_stats(self) -> dict[str, dict[str, int]]:
        """Each live engine replica's own stats, by replica id (the adapter metrics' `replica` label)."""
        return {name: dict(r["stats"]) for name, r in self.replicas().items()}

    def stats(self) -> dict[str, int]:
        """The replicas' stats added up."""
        total: dict[str, int] = {}
        for r in self.replicas().values():
            for k, v in r["stats"].items():
                if k not in ("healthy", "last_step_age_ms"):
                    total[k] = total.get(k, 0) + int(v)
        for k in ("running", "waiting", "resident_skills", "known_skills", "aborted", "adapter_loads"):
            total.setdefault(k, 0)
        return total

    def close(self) -> None:
        for stream in list(self._streams.values()):
            stream.cancel()
