"""Routing as its own stage in front of the engine.

A thread collects the `auto` requests that arrive within `window_s` of each other (up to `max_batch`)
and queues them shortest first, `chunk` per embedding call, for `workers` threads that route them and send
each call's decisions on as it ends (on a CPU a chunk of 1, since batching saves nothing there and a request
would wait for the whole batch; two workers, so a burst of arrivals is routed on both cores while the engine
waits for it). The event loop awaits each request's decision and only then submits the request to the engine
with its mix attached. Decode steps never wait for MiniLM, and routing never waits for decoding. Forced and base
requests need no router and are decided at once.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import TypeAlias

from skillpool.lora.mix import Mix
from skillpool.router import Decision, Router
from skillpool.runtime.openmp import as_helper_thread

from .engines import EngineBusy
from .metrics import Metrics

log = logging.getLogger(__name__)


Target: TypeAlias = str | Mix  # "auto" | "base" | a skill name | an explicit mix


@dataclass
class _Item:
    text: str
    future: asyncio.Future[Decision]
    loop: asyncio.AbstractEventLoop


class RoutingStage:
    def __init__(
        self,
        router: Router,
        metrics: Metrics,
        window_s: float,
        max_batch: int,
        max_skills: int | None = None,
        max_waiting: int | None = None,
        chunk: int | None = None,
        workers: int = 1,
    ) -> None:
        self.router, self.metrics, self.window_s, self.max_batch = router, metrics, window_s, max_batch
        # requests embedded per router call (default: the whole batch); each call's requests go on as it ends
        self.chunk = max_batch if chunk is None else chunk
        if self.chunk < 1:
            raise ValueError(f"routing batch size must be at least 1, not {self.chunk}")
        self.max_skills = max_skills  # an engine that keeps k skills resident serves mixes of at most k
        self.max_waiting = max_waiting  # requests waiting to be routed beyond this: EngineBusy (429)
        if workers < 1:
            raise ValueError(f"routing threads must be at least 1, not {workers}")
        self._q: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        # chunks ready to route, by (window, length, order): shortest first within a window, windows in turn
        self._work: queue.PriorityQueue[tuple[int, int, int, list[_Item] | None]] = queue.PriorityQueue()
        self._waiting, self._count_lock = 0, threading.Lock()  # requests queued and not yet taken by a worker
        self._thread = threading.Thread(target=self._run, name="skillpool-router", daemon=True)
        self._workers = [
            threading.Thread(target=self._work_loop, name=f"skillpool-router-{i}", daemon=True) for i in range(workers)
        ]
        for t in (self._thread, *self._workers):
            t.start()

    async def decide(self, text: str, target: Target) -> Decision:
        """`target`: "auto" routes; "base" is the base model; a skill name or a mix is forced. Raises
        EngineBusy when `max_waiting` requests already wait to be routed."""
        if isinstance(target, Mix):
            d = Decision(route=list(target.ranked), reason="forced", score=1.0)
        elif target == "base":
            d = Decision(route=[], reason="base")
        elif target != "auto":
            d = Decision(route=[(target, 1.0)], reason="forced", score=1.0)
        else:
            if not self.alive():  # a request queued to a dead stage would wait forever
                raise RuntimeError("the routing stage has stopped")
            with self._count_lock:
                if self.max_waiting is not None and self._waiting >= self.max_waiting:
                    raise EngineBusy(self._waiting)
                self._waiting += 1
            loop = asyncio.get_running_loop()
            item = _Item(text, loop.create_future(), loop)
            t0 = time.perf_counter()
            self._q.put(item)
            d = _cap(await item.future, self.max_skills)
            self.metrics.routing_wait.observe(time.perf_counter() - t0)  # what this request's TTFT paid for its route
        self._count(d, auto=target == "auto")
        return d

    def alive(self) -> bool:
        return self._thread.is_alive() and all(t.is_alive() for t in self._workers)

    def close(self) -> None:
        self._q.put(None)

    def _count(self, d: Decision, auto: bool) -> None:
        m = self.metrics
        m.route_decisions.labels(d.route[0][0] if d.route else "base", d.reason).inc()
        for s, w in d.route:
            m.route_weight.labels(s).inc(w)
        if auto:
            m.router_score.observe(d.score)
            if not d.route:
                m.fallbacks.labels(d.reason).inc()

    def _collect(self, first: _Item) -> list[_Item]:
        batch = [first]
        deadline = time.monotonic() + self.window_s
        while len(batch) < self.max_batch:
            try:
                item = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                self._q.put(None)
                break
            batch.append(item)
        return batch  # a client that left while waiting is skipped when its chunk is routed

    def _run(self) -> None:
        """Collects windows into chunks for the workers; the stop sentinel goes to each worker after them."""
        window = order = 0
        while (first := self._q.get()) is not None:
            # shortest first: with the cost linear in length (a CPU), that minimizes the window's mean wait
            batch = sorted(self._collect(first), key=lambda it: len(it.text))
            for start in range(0, len(batch), self.chunk):
                chunk = batch[start : start + self.chunk]
                self._work.put((window, len(chunk[0].text), order, chunk))
                order += 1
            window += 1
        for _ in self._workers:
            self._work.put((sys.maxsize, 0, (order := order + 1), None))

    def _work_loop(self) -> None:
        as_helper_thread()  # MiniLM on one core: a pool of its own would stop the engine's threads spinning
        while (chunk := self._work.get()[3]) is not None:
            with self._count_lock:
                self._waiting -= len(chunk)
            self._route(chunk)

    def _route(self, batch: list[_Item]) -> None:
        batch = [it for it in batch if not it.future.done()]  # its client left while earlier chunks routed
        if not batch:
            return
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            # route_traffic: requests that fall back also feed the demand clusters (router.demand)
            decisions = self.router.route_traffic([it.text for it in batch])
            if len(decisions) != len(batch):
                raise RuntimeError(f"the router gave {len(decisions)} decisions for {len(batch)} requests")
        except Exception as e:  # fail this batch's requests, keep routing
            log.exception("routing failed")
            for it in batch:
                _call(it, None, e)
            return
        self.metrics.router_seconds.observe(time.perf_counter() - t0)
        self.metrics.router_cpu.inc(time.thread_time() - c0)
        for it, d in zip(batch, decisions):
            _call(it, d, None)


def _cap(d: Decision, k: int | None) -> Decision:
    """At most k skills: the heaviest, renormalized (the response's route shows what was served)."""
    if k is None or len(d.route) <= k:
        return d
    top = d.route[:k]  # routes are sorted heaviest first
    total = sum(w for _, w in top)
    return Decision(route=[(s, w / total) for s, w in top], reason=d.reason, score=d.score)


def _call(it: _Item, d: Decision | None, e: BaseException | None) -> None:
    try:
        it.loop.call_soon_threadsafe(_settle, it.future, d, e)
    except RuntimeError:  # that request's event loop is closed: nobody waits for it, routing goes on
        log.debug("a routed request's event loop is gone")


def _settle(fut: asyncio.Future[Decision], d: Decision | None, e: BaseException | None) -> None:
    if fut.done():
        return
    if e is not None:
        fut.set_exception(e)
    else:
        assert d is not None
        fut.set_result(d)
