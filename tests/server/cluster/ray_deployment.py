"""Skillpool's engine deployment (server/cluster) on a real local Ray Serve with the stand-in tiered engine per
replica (tiered_engine.py), driven by the RemoteEngine an ingress uses: the placement tests' and bench_ray_placement's
harness."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Outcome:
    start: float
    end: float
    ok: bool
    tiers: list[str]  # the tier each skill was served from, heaviest first
    tokens: int


class Deployment:
    """The engine deployment on fresh replicas and the RemoteEngine that drives it."""

    def __init__(
        self, args: argparse.Namespace, data_dir: Path, replicas: int, keyed: bool, group_size: int = 1
    ) -> None:
        from skillpool.adapters_store.store import SkillStore
        from skillpool.server.cluster.deployments import ClusterSpec
        from skillpool.server.cluster.hub import hub_handle
        from skillpool.server.cluster.launch import deploy
        from skillpool.server.cluster.remote_engine import RemoteEngine
        from skillpool.server.config import ServerConfig

        from .tiered_engine import make_tiered

        factory = make_tiered(args.gpu_slots, args.host_slots, args.per_token_s, args.gpu_tier)
        cfg = ServerConfig.of(data_dir=data_dir, max_waiting=100_000)
        self.spec = ClusterSpec(
            cfg,
            replicas,
            engine_factory=factory,
            max_ongoing=args.max_ongoing,
            mux_models=args.mux_slots,
            replica_cpus=0,
        )  # the stand-in engine only sleeps: it books no CPU
        handle = deploy(self.spec, ingress=False)
        self.hub = hub_handle(self.spec.hub_name)
        self.engine = RemoteEngine(handle, args.tokenizer, self.hub, keyed=keyed, group_size=group_size)
        self.engine.start_blocking()
        for rec in SkillStore(data_dir).list_latest():
            self.engine.add_skill(rec.name, rec.adapter)

    def replica_stats(self) -> dict[str, dict[str, Any]]:
        import ray

        return dict(ray.get(self.hub.replicas.remote()))

    def kill_one(self) -> str:
        """Kill the engine replica that served most requests; its id."""
        import ray

        view = self.replica_stats()
        victim = max(view, key=lambda r: sum(view[r]["served"].values()))
        actor = next(
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::") and a["name"].endswith("#" + victim)
        )
        ray.kill(ray.get_actor(actor, namespace="serve"), no_restart=True)
        return victim

    def close(self) -> None:
        from skillpool.server.cluster.launch import undeploy

        undeploy(self.spec, local=False)


async def one(engine: Any, i: int, mix: dict[str, float], tokens: int, t0: float) -> Outcome:
    from skillpool.server.engines import EngineRequest, Mix, SamplingParams

    start = time.perf_counter() - t0
    request = EngineRequest(f"r{i}-{start:.3f}", [1], SamplingParams(max_tokens=tokens), Mix.of(mix))
    last = None
    try:
        async for ev in engine.generate(request):
            last = ev
    except Exception:  # a refusal: counted as failed, like an error event
        last = None
    ok = last is not None and last.finish_reason == "length"
    tiers = last.text.split(",") if ok and last is not None else []
    return Outcome(start, time.perf_counter() - t0, ok, tiers, tokens if ok else 0)
