"""The two Ray Serve deployments, and the application that binds them.

- `SkillpoolIngress` (M replicas): today's FastAPI app and routing (create_app over build_components), with a
  RemoteEngine in place of the in-process engine;
- `SkillpoolEngine` (N replicas): one real engine each (hf or vllm, as `--engine` says), its skills resolved from
  the store by (name, version) (replica.py); `@serve.multiplexed` keyed `name#vN` of a routed mix's heaviest skill
  holds up to `mux_models` keys per replica (Ray routes a key to the replicas holding it, else to those holding
  fewest) and `max_ongoing_requests` bounds what one replica takes before Ray tries another.

`app_builder` is what a KubeRay RayService names (deploy/kuberay/): the same flags as `skillpool serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shlex
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ray import serve

from skillpool.adapters_store.store import SkillStore, open_store
from skillpool.runtime.base_model import resolve_base_model, resolve_device
from skillpool.runtime.process import process_env, setup_process

from ..config import ServerConfig, add_serve_arguments
from ..engines import Engine, EngineEvent
from .replica import EngineReplica, Refusal, WireRequest
from .stop import notice_handle

log = logging.getLogger(__name__)

APP = "skillpool"
ENGINE, INGRESS = "SkillpoolEngine", "SkillpoolIngress"
MATCHING_TIMEOUT_S = "0.2"
REPLICA_ENV = {
    # how long a request waits for a replica holding its skill before any takes it: Ray's 1 s would add to chat's TTFT
    "RAY_SERVE_MULTIPLEXED_MODEL_ID_MATCHING_TIMEOUT_S": MATCHING_TIMEOUT_S,
    **process_env(),  # as every skillpool process runs (runtime/process.py): a Ray worker is not started by it
}


@dataclass(frozen=True)
class ClusterSpec:
    """What the deployments are built from: the server's settings and the cluster's own."""

    cfg: ServerConfig
    replicas: int
    ingress_replicas: int = 1
    threads: int | None = None  # torch threads per replica (--threads)
    keyed: bool = True  # False: every request unkeyed (the control the benchmarks compare affinity with)
    app_name: str = APP
    engine_factory: Callable[[ServerConfig], Engine] | None = None  # default: the engine --engine names
    max_ongoing: int | None = None  # requests one replica takes at once (default --max-batch-size)
    mux_models: int | None = None  # multiplexed keys one replica holds (default: the engine's resident skills)
    replica_cpus: float | None = None  # the CPUs Ray books per engine replica (default: its threads, or 1)

    @property
    def hub_name(self) -> str:
        return f"{self.app_name}-hub"

    @property
    def stop_name(self) -> str:
        return f"{self.app_name}-stop"

    @property
    def models_per_replica(self) -> int:
        if self.mux_models is not None:
            return self.mux_models
        if self.cfg.serving.engine == "vllm":
            return self.cfg.serving.max_cpu_loras or self.cfg.serving.max_loras
        return self.cfg.serving.max_loaded_skills or 64

    def engine_options(self) -> dict[str, Any]:
        cuda = resolve_device(self.cfg.serving.device).startswith("cuda") if self.engine_factory is None else False
        cpus = self.replica_cpus if self.replica_cpus is not None else self.threads or 1
        actor: dict[str, Any] = {"num_cpus": cpus, "runtime_env": {"env_vars": REPLICA_ENV}}
        if cuda:
            actor["num_gpus"] = self.cfg.cluster.replica_gpus or 1
        return {
            "name": ENGINE,
            "num_replicas": self.replicas,
            "max_ongoing_requests": self.max_ongoing or self.cfg.serving.max_batch_size,
            "max_queued_requests": self.cfg.http.max_waiting,  # beyond it Ray refuses: a 429, as one server's queue does
            "ray_actor_options": actor,
            "health_check_period_s": 5,
            # Serve's own stop of a replica (a RayService upgrade, a scale-down) waits this long for its requests
            "graceful_shutdown_timeout_s": self.cfg.http.shutdown_timeout_s,
        }

    def ingress_options(self) -> dict[str, Any]:
        actor = {"num_cpus": 0, "runtime_env": {"env_vars": REPLICA_ENV}}
        return {
            "name": INGRESS,
            "num_replicas": self.ingress_replicas,
            "ray_actor_options": actor,
            "graceful_shutdown_timeout_s": self.cfg.http.shutdown_timeout_s,
        }


def _process_setup(threads: int | None) -> None:
    for k, v in REPLICA_ENV.items():
        os.environ.setdefault(k, v)
    setup_process(threads, log_level=None)  # Ray Serve configures its replicas' logging


def _gpu_here() -> bool:
    import torch

    return torch.cuda.is_available()


def default_engine(cfg: ServerConfig) -> Engine:
    """The engine `--engine` names, as `skillpool serve` builds it (no trainer shares this replica's device)."""
    from ..bootstrap import make_engine

    return make_engine(cfg.replace(run_trainer=False), resolve_base_model(cfg.serving.model))


def replica_store(cfg: ServerConfig) -> SkillStore:
    """The store as every server opens it (bootstrap): the data dir's, or the object store `--adapter-store` names,
    read through this node's disk cache."""
    return open_store(cfg.storage.data_dir, cfg.storage.adapter_store, cfg.storage.adapter_cache_bytes)


class EngineDeployment:
    def __init__(self, spec: ClusterSpec) -> None:
        _process_setup(spec.threads)
        engine = (spec.engine_factory or default_engine)(spec.cfg)
        replica_id = serve.get_replica_context().replica_id.unique_id
        self.replica = EngineReplica(engine, replica_store(spec.cfg), spec.hub_name, replica_id)

        async def load(key: str) -> str:
            return await self.replica.hold(key)

        # wired at start, as Ray documents, since the number of keys a replica holds comes from the settings
        self._hold = serve.multiplexed(max_num_models_per_replica=spec.models_per_replica)(load)

    async def info(self) -> dict[str, Any]:
        return self.replica.info()

    async def generate(self, wire: WireRequest) -> AsyncIterator[EngineEvent | Refusal]:
        key = serve.get_multiplexed_model_id()
        if key:
            await self._hold(key)
        async for item in self.replica.generate(wire, key):
            yield item

    def check_health(self) -> None:
        """Ray Serve calls this every few seconds; a replica whose engine loop died is replaced."""
        if not self.replica.engine.healthy():
            raise RuntimeError(f"the {self.replica.engine.name} engine's loop has stopped")

    def __del__(self) -> None:
        replica = getattr(self, "replica", None)
        if replica is not None:
            replica.close()


@serve.ingress()
class IngressDeployment:
    async def __init__(self, spec: ClusterSpec, engine: Any) -> None:  # type: ignore[misc]  # Serve awaits it
        from ..app import create_app
        from ..auth import KeyFileWatch, KeyRing
        from ..bootstrap import build_components
        from .hub import hub_handle
        from .remote_engine import RemoteEngine

        _process_setup(spec.threads)
        rid = serve.get_replica_context().replica_id.unique_id
        cfg = spec.cfg.replace(
            replica_name=spec.cfg.observability.replica_name or f"ingress-{rid}"
        )  # its own metric series
        if not _gpu_here():  # Ray books it no GPU (the replicas hold them): MiniLM and a trainer run on the CPU
            cfg = cfg.replace(device="cpu")
        base = resolve_base_model(cfg.serving.model)
        remote = RemoteEngine(
            engine,
            base.path,
            hub_handle(spec.hub_name),
            keyed=spec.keyed,
            group_size=spec.cfg.cluster.affinity_group_size,
        )
        await remote.start()
        self.components = await asyncio.to_thread(build_components, cfg, base, remote)
        keys = KeyRing.from_config(cfg)
        self._keys_watch = KeyFileWatch(keys) if cfg.http.api_keys_file is not None else None  # no SIGHUP reaches here
        self._asgi = create_app(self.components, keys)
        self._stop_watch = asyncio.ensure_future(self._follow_stop(notice_handle(spec.stop_name), rid))

    async def _follow_stop(self, notice: Any, replica: str) -> None:
        """Drain as one server does once the deployer posts the stop (server/cluster/stop.py), then say so."""
        from ..stopping import wind_down

        try:
            while (left := await notice.wait_begun.remote()) is None:
                pass
        except Exception as e:  # the notice is gone (its application deleted, its node lost): Serve's stop remains
            log.warning("stop notice unreachable (%s); this replica stops as Ray Serve stops it", e)
            return
        await wind_down(self._asgi.state.drain, self.components, left)
        await notice.drained.remote(replica)

    def __serve_build_asgi_app__(self) -> Any:
        return self._asgi

    def __del__(self) -> None:
        stop_watch = getattr(self, "_stop_watch", None)
        if stop_watch is not None:
            stop_watch.cancel()
        watch = getattr(self, "_keys_watch", None)
        if watch is not None:
            watch.close()
        components = getattr(self, "components", None)
        if components is not None:
            components.close()


def engine_app(spec: ClusterSpec) -> Any:
    """The engine deployment alone (the benchmarks drive it through a RemoteEngine of their own)."""
    deployment: Any = serve.deployment(EngineDeployment)
    return deployment.options(**spec.engine_options()).bind(spec)


def build_app(spec: ClusterSpec) -> Any:
    """The ingress bound to the engine deployment: what `skillpool serve --replicas` runs."""
    deployment: Any = serve.deployment(IngressDeployment)
    return deployment.options(**spec.ingress_options()).bind(spec, engine_app(spec))


def parse_flags(flags: str) -> tuple[ClusterSpec, argparse.Namespace]:
    """`skillpool serve`'s flags (a string, as a RayService's args give them) as a cluster spec."""
    p = argparse.ArgumentParser(prog="skillpool serve")
    add_serve_arguments(p)
    args = p.parse_args(shlex.split(flags))
    cfg = ServerConfig.from_cli_args(args)
    if cfg.cluster.replicas is None:
        raise SystemExit("skillpool serve: the flags of a Ray Serve application must include --replicas N")
    return ClusterSpec(cfg, cfg.cluster.replicas, cfg.cluster.ingress_replicas, args.threads), args


def app_builder(args: dict[str, str]) -> Any:
    """A RayService's application: `import_path: skillpool.server.cluster.deployments:app_builder` with
    `args: {flags: "--replicas 4 --engine vllm --data-dir /data ..."}`."""
    spec, _ = parse_flags(args.get("flags", ""))
    return build_app(spec)
