"""The stand-in engine of the Ray placement benchmark keeps bench_placement's tiers: over a trace, its GPU hits,
host hits and store fetches equal the simulation's lookups on one replica, a store fetch really calls the skill's
loader, and its answer names the tier of each skill, heaviest first."""

from __future__ import annotations

import asyncio

from load_tests import bench_placement as bp
from load_tests.tiered_engine import TieredEngine
from skillpool.server.engines import EngineRequest, Mix, SamplingParams


def test_its_tiers_count_as_the_simulations() -> None:
    trace = bp.make_trace(400, 120, seed=5)
    engine = TieredEngine(gpu_slots=4, host_slots=16, per_token_s=0.0)
    reads: list[str] = []
    for s in range(120):
        engine.add_skill(f"s{s}", lambda s=s: reads.append(f"s{s}"))
    sim = bp.Simulation(trace, 1, "random", seed=5)
    saved = bp.GPU_SLOTS, bp.HOST_SLOTS
    bp.GPU_SLOTS, bp.HOST_SLOTS = 4, 16
    try:
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


def test_an_unknown_skill_is_not_found() -> None:
    engine = TieredEngine(2, 4, 0.0)
    request = EngineRequest("r", [1], SamplingParams(max_tokens=1), Mix.of({"gone": 1.0}))
    (ev,) = asyncio.run(collect(engine, request))
    assert ev.not_found and ev.finish_reason == "error"
