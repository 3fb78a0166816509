"""The routing stage: requests that arrive together are embedded in one call; forced and base requests
skip the router; mixes are capped at what the engine keeps resident."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from skillpool.lora.mix import Mix
from skillpool.router import Decision, Router
from skillpool.server.engines import EngineBusy
from skillpool.server.metrics import Metrics
from skillpool.server.routing import RoutingStage, _cap
from tests.datasets import read_task


class CountingRouter(Router):
    calls: list[int]

    def route_traffic(self, texts):  # type: ignore[no-untyped-def]
        self.calls.append(len(texts))
        return super().route_traffic(texts)


def test_concurrent_requests_share_one_embedding_call(embedder) -> None:  # type: ignore[no-untyped-def]
    router = CountingRouter(embedder)
    router.calls = []
    metrics = Metrics()
    stage = RoutingStage(router, metrics, window_s=0.2, max_batch=32)

    async def main() -> list[Decision]:
        return await asyncio.gather(*[stage.decide(f"question {i}", "auto") for i in range(6)])

    try:
        decisions = asyncio.run(main())
    finally:
        stage.close()
    assert router.calls == [6]
    assert [d.reason for d in decisions] == ["no_skills"] * 6
    wait = metrics.registry.get_sample_value
    assert wait("skillpool_routing_wait_seconds_count") == 6  # one per request, not per call
    assert (wait("skillpool_routing_wait_seconds_sum") or 0) >= 6 * 0.2 * 0.9  # each waited out the window


def test_forced_and_base_need_no_router(embedder) -> None:  # type: ignore[no-untyped-def]
    router = CountingRouter(embedder)
    router.calls = []
    metrics = Metrics()
    stage = RoutingStage(router, metrics, window_s=0.01, max_batch=8)
    try:
        forced = asyncio.run(stage.decide("x", "agnews"))
        base = asyncio.run(stage.decide("x", "base"))
        mix = asyncio.run(stage.decide("x", Mix.of({"a": 0.75, "b": 0.25})))
    finally:
        stage.close()
    assert router.calls == [] and metrics.registry.get_sample_value("skillpool_routing_wait_seconds_count") == 0
    assert (forced.route, forced.reason) == ([("agnews", 1.0)], "forced")
    assert (base.route, base.reason) == ([], "base")
    assert (mix.route, mix.reason) == ([("a", 0.75), ("b", 0.25)], "forced")


def test_cap_keeps_the_heaviest_skills_renormalized() -> None:
    d = Decision(route=[("a", 0.5), ("b", 0.3), ("c", 0.2)], reason="matched", score=0.7)
    assert _cap(d, None) is d and _cap(d, 3) is d
    capped = _cap(d, 2)
    assert [s for s, _ in capped.route] == ["a", "b"] and abs(sum(w for _, w in capped.route) - 1) < 1e-9
    assert capped.route[0][1] == 0.5 / 0.8 and (capped.reason, capped.score) == ("matched", 0.7)


class GatedRouter(Router):
    """Routes only once the test opens the gate: requests pile up in front of the stage meanwhile."""

    gate: threading.Event
    entered: threading.Event

    def route_traffic(self, texts):  # type: ignore[no-untyped-def]
        self.entered.set()
        self.gate.wait(30)
        return super().route_traffic(texts)


def test_a_full_routing_queue_is_busy_and_the_waiting_requests_still_get_routed(embedder) -> None:  # type: ignore[no-untyped-def]
    router = GatedRouter(embedder)
    router.gate, router.entered = threading.Event(), threading.Event()
    stage = RoutingStage(router, Metrics(), window_s=0.0, max_batch=1, max_waiting=2)

    async def main() -> list[Decision]:
        first = asyncio.ensure_future(stage.decide("q0", "auto"))
        while not router.entered.is_set():  # q0 is being routed; the next two wait in the queue
            await asyncio.sleep(0.01)
        waiting = [asyncio.ensure_future(stage.decide(f"q{i}", "auto")) for i in (1, 2)]
        await asyncio.sleep(0)  # one turn of the loop: each runs up to its await, queued
        with pytest.raises(EngineBusy):
            await stage.decide("q3", "auto")
        assert (await stage.decide("q4", "base")).reason == "base"  # no routing needed: never busy
        router.gate.set()
        return await asyncio.gather(first, *waiting)

    try:
        decisions = asyncio.run(main())
    finally:
        stage.close()
    assert [d.reason for d in decisions] == ["no_skills"] * 3


class LoggingRouter(Router):
    """Records each call's texts and how many requests of the batch had their decision when it started."""

    calls: list[list[str]]
    settled_at_call: list[int]
    futures: list[asyncio.Future[Decision]]

    def route_traffic(self, texts):  # type: ignore[no-untyped-def]
        if len(self.calls) == len(self.futures) - 1:  # the last call: give the event loop time to settle the others
            deadline = time.monotonic() + 10
            while not any(f.done() for f in self.futures) and time.monotonic() < deadline:
                time.sleep(0.01)
        self.settled_at_call.append(sum(f.done() for f in self.futures))
        self.calls.append(list(texts))
        return super().route_traffic(texts)


def test_a_chunked_batch_routes_shortest_first_and_sends_each_decision_on_at_once(embedder) -> None:  # type: ignore[no-untyped-def]
    router = LoggingRouter(embedder)
    router.calls, router.settled_at_call, router.futures = [], [], []
    stage = RoutingStage(router, Metrics(), window_s=0.3, max_batch=32, chunk=1)
    texts = ["a much longer question about the weather tomorrow", "hi", "a medium question", "why?"]

    async def main() -> list[Decision]:
        tasks = [asyncio.ensure_future(stage.decide(t, "auto")) for t in texts]
        router.futures = tasks  # type: ignore[assignment]
        return await asyncio.gather(*tasks)

    try:
        decisions = asyncio.run(main())
    finally:
        stage.close()
    assert router.calls == [["hi"], ["why?"], ["a medium question"], [texts[0]]]
    assert [d.reason for d in decisions] == ["no_skills"] * 4
    # the shortest requests were answered while the longest still waited to be embedded (had the stage held
    # every decision until the batch ended, none would be done however long the last call waited)
    assert router.settled_at_call[-1] >= 1


def test_a_routing_batch_size_below_one_is_refused(embedder) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="at least 1"):
        RoutingStage(Router(embedder), Metrics(), window_s=0.01, max_batch=8, chunk=0)
    with pytest.raises(ValueError, match="at least 1"):
        RoutingStage(Router(embedder), Metrics(), window_s=0.01, max_batch=8, workers=0)


def test_a_cpu_server_embeds_one_request_per_call_unless_told_otherwise(tiny_base, embedder, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from skillpool.server.bootstrap import build_components
    from skillpool.server.config import ServerConfig

    for folder, size, want in (("default", None, 1), ("set", 8, 8)):
        cfg = ServerConfig.of(data_dir=tmp_path / folder, device="cpu", routing_batch_size=size)
        c = build_components(cfg, base=tiny_base, embedder=embedder)
        try:
            assert c.routing.chunk == want
        finally:
            c.close()


def test_a_burst_is_routed_by_every_worker_and_their_cpu_time_is_counted(embedder) -> None:  # type: ignore[no-untyped-def]
    texts = [e["route_text"] for e in read_task("long_sequence", "agnews", "train", 40)]
    router = ThreadLoggingRouter(embedder)
    router.add_skill("agnews", router.prepare_keys(texts))
    router.threads, router.both = set(), threading.Event()
    metrics = Metrics()
    stage = RoutingStage(router, metrics, window_s=0.3, max_batch=32, chunk=1, workers=2)

    async def main() -> list[Decision]:
        return await asyncio.gather(*[stage.decide(t, "auto") for t in texts[:12]])

    try:
        decisions = asyncio.run(main())
    finally:
        stage.close()
    assert [d.route[0][0] for d in decisions] == ["agnews"] * 12  # each request got its own decision
    assert router.threads == {"skillpool-router-0", "skillpool-router-1"}
    # the routing threads' CPU time is counted (the router's share of the cores, in bench_serving and Grafana)
    assert (metrics.registry.get_sample_value("skillpool_router_cpu_seconds_total") or 0) > 0


class ThreadLoggingRouter(Router):
    """Each call waits until both workers have called: one worker cannot drain the burst alone."""

    threads: set[str]
    both: threading.Event

    def route_traffic(self, texts):  # type: ignore[no-untyped-def]
        self.threads.add(threading.current_thread().name)
        if len(self.threads) == 2:
            self.both.set()
        self.both.wait(30)
        return super().route_traffic(texts)
