"""Server settings (CLI flags map 1:1 onto these fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from skillpool.router import RouterSettings
from skillpool.trainer.keys import DEFAULT_PREFIX


@dataclass(frozen=True)
class ServerConfig:
    data_dir: Path = Path("./data")
    model: Path | None = None  # None: the packaged SmolLM2-135M-Instruct
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None  # a `chat` key named "api-key" (server.auth); no key at all: single-tenant
    admin_key: str | None = None  # an `admin` key named "admin"; alone, it leaves only chat and models open
    api_keys_file: Path | None = None  # `NAME ROLE KEY` lines (chat, train, admin), re-read on SIGHUP
    device: str | None = None  # None: cuda if available, else cpu
    engine: str = "hf"  # which engine serves (server.engines.ENGINES)
    batch_window_s: float = 0.01  # routing: how long the first request waits for company to embed with
    max_batch_size: int = 32  # rows decoding at once in the engine (vLLM's max_num_seqs)
    max_batched_tokens: int = 512  # tokens one engine step may process: decode rows + prefill (chunked beyond)
    max_waiting: int = 256  # requests waiting for the engine beyond this get 429 with Retry-After
    max_loaded_skills: int | None = None  # adapters resident in the engine (LRU); None: every skill
    prefix_cache_tokens: int = 4096  # prompt KV kept for reuse by prompts that start alike (0: off)
    max_loras: int = 4  # vllm: LoRA adapters (mixes) in one batch
    max_cpu_loras: int | None = None  # vllm: adapters cached in host memory (None: vLLM's default, max_loras)
    max_lora_rank: int = 64  # vllm: the largest mix rank Σ r_i; bigger mixes drop their smallest weights
    max_model_len: int | None = None  # vllm: context length (None: the model's own)
    default_max_tokens: int = 512
    max_upload_bytes: int = 50 * 1024 * 1024
    max_request_bytes: int = 8 * 1024 * 1024  # any other body (chat): 413 beyond, counted as it streams
    max_upload_examples: int = 100_000
    min_upload_examples: int = 10
    max_pending_jobs: int = 16  # uploads beyond this get 429
    redis_url: str | None = None  # job queue + skill events in Redis (trainer workers on other machines)
    redis_prefix: str = DEFAULT_PREFIX
    run_trainer: bool = True  # False: this server only enqueues; `skillpool worker` processes train
    router: RouterSettings = field(default_factory=RouterSettings)
