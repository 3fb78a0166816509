"""One engine replica: a real engine (hf or vllm) that resolves skills from the shared store and follows the pool.

A request arrives with its mix and, for each skill, the version the ingress routed to (`WireRequest`). The
replica serves a skill at a version only while the store serves that version: a version it does not hold yet is
read from the store (a new version is a new key, so requests for it may reach a replica before the hub's command
does), and one the store no longer serves (retired, rolled back) is the engine's not-found, which the ingress
answers with 404. Commands from the hub (hub.py) swap or drop what the engine holds as soon as the pool changes,
so a replica holding a skill only as a mix's secondary swaps it too; a replica that has not heard from the hub for
`VERIFY_AFTER_S` checks every requested skill against the store instead of trusting what it holds.

Events cross the process boundary in batches: whatever the engine produced while the previous batch was in flight
goes as one event, so a slow consumer costs fewer messages rather than more latency.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from skillpool.adapters_store.store import SkillStore
from skillpool.lora.adapter import LoRAAdapter

from ..engines import ConstraintError, Engine, EngineBusy, EngineDead, EngineEvent, EngineRequest, RequestTooLarge
from ..engines.protocol import AdapterLoader, Choices
from .hub import POLL_S, Command, PollReply, hub_handle

log = logging.getLogger(__name__)

VERIFY_AFTER_S = 2 * POLL_S  # longer than this without a poll: the hub's commands may be late, ask the store


@dataclass(frozen=True)
class WireRequest:
    """What the ingress sends: the request, the store version of each skill of its mix, and skills sent by value
    (a candidate the quality gate judges, not in the store yet: name -> a Ray object reference to its adapter)."""

    request: EngineRequest
    versions: dict[str, int] = field(default_factory=dict)
    inline: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Refusal:
    """The engine refused the request at submit: the ingress raises the matching exception (429, 503, 400)."""

    kind: str  # busy | dead | too_large | constraint
    message: str
    waiting: int = 0
    retry_after_s: int = 1

    def exception(self) -> Exception:
        if self.kind == "busy":
            return EngineBusy(self.waiting, self.retry_after_s)
        if self.kind == "dead":
            return EngineDead(self.message)
        if self.kind == "constraint":
            return ConstraintError(self.message)
        return RequestTooLarge(self.message)


def merge(a: EngineEvent, b: EngineEvent) -> EngineEvent:
    """Two consecutive events of one choice as one: the text and logprobs of both, the later count and ending."""
    prompt = a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs
    return replace(b, text=a.text + b.text, logprobs=a.logprobs + b.logprobs, prompt_logprobs=prompt)


def parse_key(key: str) -> tuple[str, int] | None:
    """(skill, version) of a multiplexed key `name#vN`; None for anything else (a candidate's key)."""
    name, sep, version = key.rpartition("#v")
    return (name, int(version)) if sep and name and version.isdigit() else None


class ReplicaSkills:
    """Which version of each skill this replica's engine holds: `int` for a store version, `str` (an object
    reference's id) for a skill sent by value."""

    def __init__(self, engine: Engine, store: SkillStore) -> None:
        self.engine, self.store = engine, store
        self._held: dict[str, int | str] = {}
        self._lock = threading.Lock()
        self._dirty = True  # the versions changed since the last report

    def versions(self) -> dict[str, int] | None:
        """The versions held (0: sent by value), when they changed since the last call (the hub keeps the last)."""
        with self._lock:
            if not self._dirty:
                return None
            self._dirty = False
            return {n: v if isinstance(v, int) else 0 for n, v in self._held.items()}

    def _drop(self, name: str) -> None:
        if self._held.pop(name, None) is not None:
            self.engine.remove_skill(name)
            self._dirty = True

    def apply(self, cmd: Command) -> None:
        """A hub command: swap a held skill to the commanded version, or drop it (an unheld one loads on use)."""
        with self._lock:
            have = self._held.get(name := cmd.name)
            if cmd.kind == "remove":
                self._drop(name)
            elif have is not None and have != cmd.version and cmd.version is not None:
                rec = self.store.get(name, cmd.version)
                if rec is None:  # not in the store (yet, on another node's view): the next request resolves it
                    self._drop(name)
                else:
                    self.engine.add_skill(name, rec.adapter)
                    self._held[name] = cmd.version
                    self._dirty = True

    def drop_all(self) -> None:
        with self._lock:
            for name in list(self._held):
                self._drop(name)

    def resolve(self, versions: dict[str, int], inline: dict[str, Any], verify: bool) -> list[str]:
        """Make the engine serve each skill at its version; the names it must not serve (the store says so)."""
        missing = []
        for name, version in versions.items():
            with self._lock:
                if self._held.get(name) == version and not verify:
                    continue
            rec = self.store.serving(name)  # outside the lock: a store read may be slow
            with self._lock:
                if rec is None or rec.version != version:
                    missing.append(name)
                    if rec is None or self._held.get(name) != rec.version:
                        self._drop(name)  # what it holds is no longer served either
                elif self._held.get(name) != version:
                    self.engine.add_skill(name, rec.adapter)
                    self._held[name] = version
                    self._dirty = True
        for name, ref in inline.items():
            with self._lock:
                if self._held.get(name) != ref.hex():
                    self.engine.add_skill(name, _loader(ref))
                    self._held[name] = ref.hex()
                    self._dirty = True
        return missing


def _loader(ref: Any) -> AdapterLoader:
    """Reads an adapter sent by value from Ray's object store, when the engine first needs it."""

    def load() -> LoRAAdapter:
        import ray

        adapter: LoRAAdapter = ray.get(ref)
        return adapter

    return load


def store_stats(store: SkillStore) -> dict[str, int]:
    """The store's adapter reads as engine stats: `<tier>_adapter_hits` and `<tier>_adapter_loads` for the node's
    disk cache (a remote store only) and the store itself."""
    hits, loads = store.tiers.snapshot()
    tiers = ("disk", "store") if store.remote else ("store",)
    out = {f"{t}_adapter_hits": int(hits.get(t, 0)) for t in tiers}
    out.update({f"{t}_adapter_loads": int(loads.get(t, 0)) for t in tiers if t != "store"})
    return out


class EngineReplica:
    """The engine deployment's logic (deployments.py wraps it for Ray Serve)."""

    def __init__(self, engine: Engine, store: SkillStore, hub_name: str, replica_id: str) -> None:
        self.engine, self.replica_id, self.hub_name, self.store = engine, replica_id, hub_name, store
        self.skills = ReplicaSkills(engine, store)
        self.hub = hub_handle(hub_name)
        self._served: dict[str, int] = {}  # requests per multiplexed key since the last report
        self._served_lock = threading.Lock()
        self._last_poll = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="skillpool-hub-follow", daemon=True)
        self._thread.start()

    def info(self) -> dict[str, Any]:
        return {"name": self.engine.name, "max_context": self.engine.max_context, "replica": self.replica_id}

    async def hold(self, key: str) -> str:
        """Ray Serve's multiplexed loader for `key` (`name#vN`): this replica now holds that skill version."""
        parsed = parse_key(key)
        if parsed is not None:
            await asyncio.to_thread(self.skills.resolve, {parsed[0]: parsed[1]}, {}, False)
        return key

    async def generate(self, wire: WireRequest, key: str = "") -> AsyncIterator[EngineEvent | Refusal]:
        if key:
            with self._served_lock:
                self._served[key] = self._served.get(key, 0) + 1
        verify = time.monotonic() - self._last_poll > VERIFY_AFTER_S
        missing = await asyncio.to_thread(self.skills.resolve, wire.versions, wire.inline, verify)
        if missing:
            error = (
                f"skill {missing[0]!r} is not served at the version this request was routed to (retired or replaced)"
            )
            yield EngineEvent(finish_reason="error", error=error, not_found=True)
            return
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[EngineEvent] = asyncio.Queue()
        request = wire.request

        def sink(ev: EngineEvent) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        try:
            await asyncio.to_thread(self.engine.prepare, request.params)  # its constraint compiled off the loop
            self.engine.submit(request, sink)
        except EngineBusy as e:
            yield Refusal("busy", str(e), e.waiting, e.retry_after_s)
            return
        except EngineDead:
            yield Refusal("dead", self.engine.name)
            return
        except RequestTooLarge as e:
            yield Refusal("too_large", str(e))
            return
        except ConstraintError as e:
            yield Refusal("constraint", str(e))
            return
        finished, choices = False, Choices(request.params.n)
        try:
            while not finished:
                ev = await events.get()
                while ev.finish_reason is None and not events.empty():  # what piled up: fewer, larger messages
                    after = events.get_nowait()
                    if after.index == ev.index:
                        ev = merge(ev, after)
                    else:  # another choice's: this one goes as it is
                        yield ev
                        ev = after
                finished = choices.over(ev)
                yield ev
        finally:
            if not finished or choices.cut:  # the ingress cancelled the stream, or a choice failed: free the slot
                self.engine.abort(request.request_id)

    def _report(self) -> dict[str, Any]:
        with self._served_lock:
            served, self._served = self._served, {}
        stats = dict(self.engine.stats())
        stats["last_step_age_ms"] = int(self.engine.last_step_age() * 1000)
        stats["healthy"] = int(self.engine.healthy())
        stats.update(store_stats(self.store))  # its reads from the store: the ingress exports them per replica
        return {"stats": stats, "served": served, "versions": self.skills.versions()}

    def _follow(self) -> None:
        """Long-poll the hub and apply its commands; each poll acknowledges the ones applied before it."""
        import ray

        since = -1
        while not self._stop.is_set():
            report = self._report()
            try:
                reply: PollReply = ray.get(
                    self.hub.poll.remote(self.replica_id, since, report, POLL_S), timeout=POLL_S + 30
                )
            except Exception as e:  # the hub restarted, or Ray is shutting down: try again shortly
                log.warning("skill hub poll failed (%s); retrying", e)
                self._requeue(report)
                self._stop.wait(1.0)
                try:
                    self.hub = hub_handle(self.hub_name)
                except Exception:
                    pass
                continue
            self._last_poll = time.monotonic()
            if reply.resync:
                self.skills.drop_all()
            for cmd in reply.commands:
                try:
                    self.skills.apply(cmd)
                except Exception:  # one bad command must not stop the replica following the others
                    log.exception("could not apply %s", cmd)
            since = reply.seq

    def _requeue(self, report: dict[str, Any]) -> None:
        with self._served_lock:
            for key, n in report["served"].items():
                self._served[key] = self._served.get(key, 0) + n

    def close(self) -> None:
        import ray

        self._stop.set()
        try:
            ray.get(self.hub.forget.remote(self.replica_id), timeout=5)
        except Exception:
            pass
        self.engine.close()
