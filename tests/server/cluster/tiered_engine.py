"""A stand-in engine for placement benchmarks: it sleeps per output token instead of computing, and keeps the two
adapter tiers load_tests/placement/bench_placement.py models (GPU slots, evicted as --gpu-tier says, and LRU host slots), so a run through real Ray
Serve counts what a replica would load. Every skill of a request's mix is looked up: in the GPU tier a hit; else in
the host tier (it moves to the GPU tier: a load); else read from the skill store (a real read of its adapter files:
a store fetch, then a load). Its answer's text names the tier each lookup was served from, heaviest skill first
(`gpu,host,store`), so a client can follow hit ratios request by request.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from skillpool.server.engines.protocol import (
    AdapterLoader,
    ConstraintError,
    EngineEvent,
    EngineRequest,
    SamplingParams,
    StreamsEvents,
)
from skillpool.server.engines.slru import SegmentedLRU


class TieredEngine(StreamsEvents):
    name = "tiered-sleep"
    max_context = 1 << 20

    def __init__(self, gpu_slots: int, host_slots: int, per_token_s: float, gpu_tier: str = "slru") -> None:
        """`gpu_tier`: "slru", the engines' eviction order (server/engines/slru.py), or "lru"."""
        if gpu_tier not in ("slru", "lru"):
            raise ValueError(f"gpu_tier is slru or lru, not {gpu_tier!r}")
        self.gpu_slots, self.host_slots, self.per_token_s = gpu_slots, host_slots, per_token_s
        self._gpu: SegmentedLRU[str] = SegmentedLRU(gpu_slots if gpu_tier == "slru" else None)
        self._host: OrderedDict[str, Any] = OrderedDict()  # skill -> its adapter, read from the store
        self._loaders: dict[str, AdapterLoader] = {}
        self._timers: dict[str, threading.Timer] = {}
        self._lock = threading.Lock()
        self.gpu_hits = self.host_hits = self.fetches = 0
        self._beat = time.monotonic()

    takes_tools = False

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[int]:
        return [len(m.get("content") or "") for m in messages]

    def prepare(self, params: SamplingParams) -> None:
        if params.constraint is not None:
            raise ConstraintError("this stand-in engine generates no text to constrain")

    def _lookup(self, skill: str) -> str:
        """The tier that served `skill`, moving it up as bench_placement.Simulation.lookup does."""
        if skill in self._gpu:
            self._gpu.touch(skill)
            if skill in self._host:
                self._host.move_to_end(skill)
            self.gpu_hits += 1
            return "gpu"
        if skill in self._host:
            self._host.move_to_end(skill)
            self.host_hits += 1
            tier = "host"
        else:
            self._host[skill] = self._loaders[skill]()  # a real read from the skill store
            self.fetches += 1
            if len(self._host) > self.host_slots:
                self._host.popitem(last=False)
            tier = "store"
        self._gpu.touch(skill)
        if len(self._gpu) > self.gpu_slots and (victim := self._gpu.first()) is not None:
            self._gpu.discard(victim)
        return tier

    def submit(self, request: EngineRequest, sink: Callable[[EngineEvent], None]) -> None:
        with self._lock:
            try:
                tiers = [self._lookup(skill) for skill, _ in request.mix.ranked]
            except KeyError as e:
                sink(EngineEvent(finish_reason="error", error=f"skill {e} is not served", not_found=True))
                return
        tokens = request.params.max_tokens

        def done() -> None:
            with self._lock:
                self._timers.pop(request.request_id, None)
            sink(EngineEvent(text=",".join(tiers), tokens=tokens, finish_reason="length"))

        timer = threading.Timer(tokens * self.per_token_s, done)
        timer.daemon = True
        with self._lock:
            self._timers[request.request_id] = timer
        timer.start()

    def abort(self, request_id: str) -> None:
        with self._lock:
            timer = self._timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()

    def add_skill(self, name: str, load: AdapterLoader) -> None:
        with self._lock:
            self._loaders[name] = load
            self._gpu.discard(name)  # a new version: the old one's copies are stale
            self._host.pop(name, None)

    def remove_skill(self, name: str) -> None:
        with self._lock:
            self._loaders.pop(name, None)
            self._gpu.discard(name)
            self._host.pop(name, None)

    def healthy(self) -> bool:
        return True

    def last_step_age(self) -> float:
        return 0.0

    def stats(self) -> dict[str, int]:
        with self._lock:
            lookups = self.gpu_hits + self.host_hits + self.fetches
            return {
                "running": len(self._timers),
                "waiting": 0,
                "resident_skills": len(self._gpu),
                "known_skills": len(self._loaders),
                "aborted": 0,
                "adapter_hits": self.gpu_hits,
                "adapter_loads": lookups - self.gpu_hits,
                "host_adapter_hits": self.host_hits,
                "store_fetches": self.fetches,
            }

    def close(self) -> None:
        with self._lock:
            timers, self._timers = list(self._timers.values()), {}
        for t in timers:
            t.cancel()


def make_tiered(
    gpu_slots: int, host_slots: int, per_token_s: float, gpu_tier: str = "slru"
) -> Callable[[Any], TieredEngine]:
    """The engine factory a ClusterSpec takes (called in each replica with the server's settings)."""

    def factory(_cfg: Any) -> TieredEngine:
        return TieredEngine(gpu_slots, host_slots, per_token_s, gpu_tier)

    return factory
