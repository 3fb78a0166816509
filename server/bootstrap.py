"""Wiring: build the store, engine, router, routing stage, skill pool, skill-event bus and trainer queue from a
config."""

from __future__ import annotations

import logging
import time
from typing import Any

from transformers import AutoConfig

from skillpool.adapters_store.store import open_store
from skillpool.router.build import make_embedder, make_router
from skillpool.router.embedder import Embedder
from skillpool.runtime.base_model import BaseModel, resolve_base_model, resolve_device
from skillpool.runtime.dtype import dtype_name, resolve_dtype
from skillpool.trainer.config import IMPORTED, TrainConfig
from skillpool.trainer.service import Job, SkillTrainer, announcer, make_event_bus, make_job_queue, make_runner

from .components import Components
from .config import ServerConfig
from .engines import Engine
from .judge import EngineJudge
from .memory import MemoryPlanError, ModelShape, plan_vllm, trainer_need
from .metrics import Metrics
from .routing import RoutingStage
from .skills import SkillPool

log = logging.getLogger(__name__)


def serving_busy(engine: Engine) -> bool:
    stats = engine.stats()
    return stats["running"] + stats["waiting"] > 0


def make_engine(cfg: ServerConfig, base: BaseModel, metrics: Metrics | None = None) -> Engine:
    """The engine `cfg.serving.engine` names, for this base model."""
    # what both engines take from the same settings; `--dtype auto` means the same for both (runtime/dtype.py)
    device = resolve_device(cfg.serving.device)
    batching: dict[str, Any] = {
        "device": cfg.serving.device,
        "dtype": resolve_dtype(cfg.serving.dtype, device),
        "max_num_seqs": cfg.serving.max_batch_size,
        "max_batched_tokens": cfg.serving.max_batched_tokens,
        "max_waiting": cfg.http.max_waiting,
    }
    if cfg.serving.engine == "hf":
        from .engines.hf import HFEngine

        try:
            return HFEngine(
                base.path,
                **batching,
                max_loaded_skills=cfg.serving.max_loaded_skills,
                prefix_cache_tokens=cfg.serving.prefix_cache_tokens,
                on_step=metrics.batch_size.observe if metrics is not None else None,
                kv_cache_memory_bytes=cfg.serving.kv_cache_memory_bytes,
                kv_reserve_bytes=_trainer_reserve(cfg, base),
                nice=cfg.serving.engine_nice,
            )
        except MemoryPlanError as e:  # the KV budget and the trainer cannot share this GPU
            raise SystemExit(f"skillpool serve: {e}") from None
    if cfg.serving.engine == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise SystemExit(f"--engine vllm needs vLLM: run `bash setup.sh --engine vllm` ({e})") from e
        from .engines.vllm import VLLMEngine

        return VLLMEngine(
            base.path,
            cfg.storage.data_dir / "cache",
            base_model_id=base.model_id,
            **{**batching, "dtype": dtype_name(batching["dtype"])},
            max_model_len=cfg.serving.max_model_len,
            max_loras=cfg.serving.max_loras,
            max_cpu_loras=cfg.serving.max_cpu_loras,
            max_lora_rank=cfg.serving.max_lora_rank,
            gpu_memory_utilization=vllm_utilization(cfg, base),
            kv_cache_memory_bytes=cfg.serving.kv_cache_memory_bytes,
            load_format=cfg.serving.vllm_load_format,
        )
    raise ValueError(f"unknown engine {cfg.serving.engine!r}")


def _cuda(cfg: ServerConfig) -> bool:
    return resolve_device(cfg.serving.device).startswith("cuda")


def _trainer_reserve(cfg: ServerConfig, base: BaseModel) -> int:
    """GPU bytes the hf engine's KV budget leaves for the in-process trainer (its estimate at the defaults)."""
    if not (cfg.training.run_trainer and _cuda(cfg)):
        return 0
    return trainer_need(ModelShape.from_config(AutoConfig.from_pretrained(str(base.path))), TrainConfig()).total


def vllm_utilization(cfg: ServerConfig, base: BaseModel) -> float | None:
    """vLLM's gpu_memory_utilization on CUDA, leaving the in-process trainer its estimate (server/memory.py);
    None on CPU, where vLLM ignores it. A GPU that cannot hold both stops the start with the numbers."""
    if not _cuda(cfg) or cfg.serving.kv_cache_memory_bytes is not None:  # vLLM sizes by bytes then, not by share
        return cfg.serving.gpu_memory_utilization
    import torch

    free, total = torch.cuda.mem_get_info()
    config = AutoConfig.from_pretrained(str(base.path))
    max_len = cfg.serving.max_model_len or int(getattr(config, "max_position_embeddings", 2048))
    train = TrainConfig() if cfg.training.run_trainer else None
    try:
        plan = plan_vllm(
            total, free, ModelShape.from_config(config), 2, max_len, train, cfg.serving.gpu_memory_utilization
        )
    except MemoryPlanError as e:
        raise SystemExit(f"skillpool serve: {e}") from None
    if plan.trainer is not None:
        log.info("vLLM takes %.4f of the GPU; the trainer's estimate is %d bytes", plan.utilization, plan.trainer.total)
    return plan.utilization


def build_components(
    cfg: ServerConfig,
    base: BaseModel | None = None,
    engine: Engine | None = None,
    embedder: Embedder | None = None,
    trainer: SkillTrainer | None = None,
) -> Components:
    """Everything a server needs; tests pass a tiny engine/base, production passes nothing."""
    bus = make_event_bus(
        cfg.training.redis_url, cfg.training.redis_prefix
    )  # first: an unreachable Redis stops the start at once
    try:  # then the adapter store: one that cannot be reached stops the start before the model loads
        store = open_store(cfg.storage.data_dir, cfg.storage.adapter_store, cfg.storage.adapter_cache_bytes)
    except BaseException:
        bus.close()
        raise
    base = base or resolve_base_model(cfg.serving.model)
    metrics = Metrics(cfg.observability.replica_name)
    metrics.watch_store(store)
    engine = engine or make_engine(cfg, base, metrics)
    metrics.watch_engine(engine)
    embedder = embedder or make_embedder(cfg.routing.embedder, cfg.serving.device)
    router = make_router(cfg.routing.router, base, embedder, cfg.serving.device)
    pool = SkillPool(store, engine, router, base, metrics)
    pool.load_all()
    bus.subscribe(pool.on_event)
    # the gate generates with this engine: a skill is judged by the engine that will serve it
    trainer = trainer or SkillTrainer(
        store, router, base, device=cfg.serving.device, judge=EngineJudge(engine), dtype=cfg.serving.dtype
    )
    runner = make_runner(trainer, metrics.training, lambda: serving_busy(engine)) if cfg.training.run_trainer else None
    stored = announcer(bus, pool.register)  # served here at once, then by every server that reads the bus

    def ended(job: Job) -> None:
        metrics.training.job_ended(job)
        if job.method == IMPORTED:  # cancelled before it ran, too: its staged adapter goes with it
            store.unstage(job.id)

    jobs = make_job_queue(
        cfg.training.redis_url, cfg.storage.data_dir / "jobs", runner, stored, ended, cfg.training.redis_prefix
    )
    metrics.training.watch(jobs, "redis" if cfg.training.redis_url else "local")
    on_cpu = resolve_device(cfg.serving.device) == "cpu"
    chunk = cfg.routing.routing_batch_size or (1 if on_cpu else cfg.serving.max_batch_size)
    workers = cfg.routing.router_threads if on_cpu else 1  # a GPU MiniLM batches instead
    routing = RoutingStage(
        router,
        metrics,
        cfg.routing.batch_window_s,
        cfg.serving.max_batch_size,
        cfg.serving.max_loaded_skills,
        cfg.http.max_waiting,
        chunk,
        workers,
    )
    log.info(
        "routing: MiniLM through %s, %d request(s) per call, %d thread(s)",
        type(router.embedder).__name__,
        chunk,
        workers,
    )
    components = Components(cfg, base, store, engine, router, pool, jobs, bus, routing, metrics, time.time())
    _ = components.files  # open the file store now: it sweeps the partial uploads of a server that was killed
    return components
