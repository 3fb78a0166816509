"""Batching scheduler: requests that arrive together are routed in one call and generated in one batch.

The event loop hands requests to one engine thread. That thread waits up to `window_s` after the
first request for more (up to `max_batch`), routes the `auto` ones with a single embedding call,
and runs the batch; text flows back to each request's asyncio queue as it is generated.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from skillpool.router import Decision, Router

from .engine_hf import GenEvent, GenRequest, HFEngine
from .metrics import Metrics

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """One chat request on its way through the scheduler."""

    prompt_ids: list[int]
    route_text: str
    target: str  # "auto" | "base" | a skill name (forced)
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: Sequence[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    arrived: float = field(default_factory=time.monotonic)

    def send(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class QueueFull(Exception):
    pass


class Scheduler:
    def __init__(
        self, engine: HFEngine, router: Router, metrics: Metrics, window_s: float, max_batch: int, max_waiting: int
    ) -> None:
        self.engine, self.router, self.metrics = engine, router, metrics
        self.window_s, self.max_batch, self.max_waiting = window_s, max_batch, max_waiting
        self._q: queue.Queue[Pending | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="skillpool-engine", daemon=True)
        self._thread.start()

    def submit(self, p: Pending) -> None:
        if self._q.qsize() >= self.max_waiting:
            raise QueueFull()
        self._q.put(p)
        self.metrics.queue_depth.set(self._q.qsize())

    def close(self) -> None:
        self._q.put(None)

    def _collect(self, first: Pending) -> list[Pending]:
        batch = [first]
        deadline = time.monotonic() + self.window_s
        while len(batch) < self.max_batch:
            timeout = deadline - time.monotonic()
            try:
                item = self._q.get(timeout=max(0.0, timeout)) if timeout > 0 else self._q.get_nowait()
            except queue.Empty:
                break
            if item is None:
                self._q.put(None)
                break
            batch.append(item)
        return [p for p in batch if not p.cancelled.is_set()]

    def _route(self, batch: list[Pending]) -> list[Decision]:
        auto = [i for i, p in enumerate(batch) if p.target == "auto"]
        t0 = time.perf_counter()
        # route_traffic: fallbacks also feed the demand clusters (router.demand)
        routed = self.router.route_traffic([batch[i].route_text for i in auto]) if auto else []
        if auto:
            self.metrics.router_seconds.observe(time.perf_counter() - t0)
        decisions: list[Decision] = []
        by_index = dict(zip(auto, routed))
        for i, p in enumerate(batch):
            if i in by_index:
                d = by_index[i]
            elif p.target == "base":
                d = Decision(route=[], reason="base")
            else:
                d = Decision(route=[(p.target, 1.0)], reason="forced", score=1.0)
            decisions.append(d)
            top = d.route[0][0] if d.route else "base"
            self.metrics.route_decisions.labels(top, d.reason).inc()
            for s, w in d.route:
                self.metrics.route_weight.labels(s).inc(w)
            if p.target == "auto":
                self.metrics.router_score.observe(d.score)
                if not d.route:
                    self.metrics.fallbacks.labels(d.reason).inc()
        return decisions

    def _run(self) -> None:
        while (first := self._q.get()) is not None:
            batch = self._collect(first)
            self.metrics.queue_depth.set(self._q.qsize())
            if not batch:
                continue
            try:
                decisions = self._route(batch)
                reqs = []
                for p, d in zip(batch, decisions):
                    p.send(("route", d))
                    reqs.append(
                        GenRequest(
                            prompt_ids=p.prompt_ids,
                            mix=d.route,
                            max_tokens=p.max_tokens,
                            temperature=p.temperature,
                            top_p=p.top_p,
                            seed=p.seed,
                            stop=p.stop,
                            cancelled=p.cancelled,
                            on_event=lambda ev, p=p: p.send(("event", ev)),
                        )
                    )
                self.metrics.batch_size.observe(len(reqs))
                self.metrics.running.set(len(reqs))
                self.engine.generate(reqs)
            except Exception as e:  # fail this batch's requests, keep serving
                log.exception("batch failed")
                for p in batch:
                    p.send(("error", e))
            finally:
                self.metrics.running.set(0)
        log.info("engine thread stopped")


__all__ = ["GenEvent", "Pending", "QueueFull", "Scheduler"]
