"""The stand-in engine of the Ray placement benchmark keeps bench_placement's tiers: over a trace, its GPU hits,
host hits and store fetches equal the simulation's lookups on one replica, a store fetch really calls the skill's
loader, and its answer names the tier of each skill, heaviest first."""

from __future__ import annotations

import asyncio

import pytest

from load_tests.placement import bench_placement as bp
from skillpool.server.engines import EngineRequest, Mix, SamplingParams
from tests.server.cluster.tiered_engine import TieredEngine


@pytest.mark.parametrize("gpu_tier", bp.GPU_TIERS)
def test_its_tiers_count_as_the_simulations(gpu_tier: str) -> None:
    trace = bp.make_trace(400, 120, seed=5)
    engine = TieredEngine(gpu_slots=4, host_slots=16, per_token_s=0.0, gpu_tier=gpu_tier)
    reads: list[str] = []
    for s in range(120):
        engine.add_skill(f"s{s}", lambda s=s: reads.append(f"s{s}"))
    saved = bp.GPU_SLOTS, bp.HOST_SLOTS
    bp.GPU_SLOTS, bp.HOST_SLOTS = 4, 16
    try:
        sim = bp.Simulation(trace, 1, "random", seed=5, gpu_tier=gpu_tier)
        for i, mix in enumerate(trace.mixes):
            weights = {f"s{s}": w for s, w in zip(mix, (0.5, 0.3, 0.2))}
            request = EngineRequest(f"r{i}", [1], SamplingParams(max_tokens=1), Mix.of(weights))
            events = asyncio.run(collect(engine, request))
            tiers = events[-1].text.split(",")
            assert len(tiers) == len(mix)
            for s in mix:
                sim.lookup(sim.reps[0], s)
    finally:
        bp.GPU_SLOTS, bp.HOST_SLOTS = saved
    stats = engine.stats()
    res = sim.result
    assert (stats["adapter_hits"], stats["host_adapter_hits"], stats["store_fetches"]) == (
        res.gpu_hits,
        res.host_hits,
        res.fetches,
    )
    assert len(reads) == res.fetches and stats["adapter_loads"] == res.lookups - res.gpu_hits
    engine.close()


async def collect(engine: TieredEngine, request: EngineRequest) -> list:  # type: ignore[type-arg]
    return [ev async for ev in engine.generate(request)]


def test_the_tiers_differ_and_a_bad_tier_is_refused() -> None:
    """The same trace through both GPU tiers: the segmented one keeps the popular skills (more GPU hits)."""
    trace = bp.make_trace(3000, 400, seed=1)
    hits = {}
    for tier in bp.GPU_TIERS:
        engine = TieredEngine(8, 400, 0.0, tier)
        for s in range(400):
            engine.add_skill(f"s{s}", lambda: None)
        for i, mix in enumerate(trace.mixes):
            request = EngineRequest(
                f"r{i}", [1], SamplingParams(max_tokens=1), Mix.of({f"s{s}": 1 / len(mix) for s in mix})
            )
            asyncio.run(collect(engine, request))
        hits[tier] = engine.stats()["adapter_hits"]
    assert hits["slru"] > hits["lru"]
    with pytest.raises(ValueError):
        TieredEngine(8, 400, 0.0, "fifo")


def test_an_unknown_skill_is_not_found() -> None:
    engine = TieredEngine(2, 4, 0.0)
    request = EngineRequest("r", [1], SamplingParams(max_tokens=1), Mix.of({"gone": 1.0}))
    (ev,) = asyncio.run(collect(engine, request))
    assert ev.not_found and ev.finish_reason == "error"
