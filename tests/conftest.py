"""Shared fixtures: a tiny randomly-initialized LLaMA with the real SmolLM2 tokenizer, the real MiniLM, and the
benchmark datasets the SKILLPOOL_DATASETS setting names. End-to-end tests are marked `slow` and run with --slow
(or CI=true)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from skillpool.runtime.process import set_process_env

set_process_env()  # as every skillpool process runs, before torch loads
# every engine, trainer and server the tests start computes in float32 unless a test asks for bf16: `auto` would
# pick bf16 on some CPUs and not on others (runtime/dtype.py)
os.environ.setdefault("SKILLPOOL_DTYPE", "float32")


def _triton_interpreter_without_gpu() -> None:
    """Triton kernels run under Triton's interpreter where there is no GPU. Triton builds its own library
    functions when it is first imported (peft imports it), so this must precede every test module's imports."""
    import importlib.util

    import torch

    if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_triton_interpreter_without_gpu()

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--slow", action="store_true", help="also run the slow end-to-end tests (CI=true does too)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        no_vllm = pytest.mark.skip(
            reason="vLLM is not installed: `bash setup.sh --engine vllm`, then pytest -m vllm --slow"
        )
        for item in items:
            if item.get_closest_marker("vllm") is not None:
                item.add_marker(no_vllm)
    if config.getoption("--slow") or os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        return
    skip = pytest.mark.skip(reason="slow end-to-end test: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm() -> object:
    """The real packaged SmolLM2 (converted once into the cache)."""
    from skillpool.runtime.base_model import resolve_base_model

    return resolve_base_model()


def make_tiny_base(smollm, folder, max_positions: int = 512):  # type: ignore[no-untyped-def]
    """A 2-layer random LLaMA (real SmolLM2 tokenizer and chat template) saved as a local checkpoint."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from skillpool.runtime.base_model import BaseModel, fingerprint_dir

    tok = AutoTokenizer.from_pretrained(str(smollm.path))
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return BaseModel(path=folder, model_id="tiny-llama", fingerprint=fingerprint_dir(folder))


@pytest.fixture(scope="session")
def tiny_base(smollm, tmp_path_factory):  # type: ignore[no-untyped-def]
    return make_tiny_base(smollm, tmp_path_factory.mktemp("tiny-llama"))


# a chat body whose answer runs for seconds on `tiny_long` (6,000 tokens, whatever the model says)
LONG_ANSWER = {
    "model": "base",
    "messages": [{"role": "user", "content": "Tell me a long story"}],
    "max_tokens": 6000,
    "ignore_eos": True,
    "temperature": 0,
}


@pytest.fixture(scope="session")
def tiny_long(smollm, tmp_path_factory):  # type: ignore[no-untyped-def]
    """The tiny LLaMA with an 8,192-token context: a long answer takes seconds even on an idle machine (at >= 1 ms a
    decode step), so a test can act while it streams."""
    return make_tiny_base(smollm, tmp_path_factory.mktemp("tiny-long"), max_positions=8192)


@pytest.fixture(scope="session")
def embedder():  # type: ignore[no-untyped-def]
    from skillpool.router.embedder import SentenceEmbedder

    return SentenceEmbedder()


def wait_job(client, job_id: str, timeout: float = 300) -> dict:  # type: ignore[no-untyped-def]
    """Poll GET /tasks/{id} through a TestClient until the job reaches a terminal state."""
    import time

    deadline = time.time() + timeout
    job: dict = {}
    while time.time() < deadline:
        job = client.get(f"/tasks/{job_id}").json()
        if job["status"] in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} did not finish: {job}")


def until(check: Callable[[], bool], timeout: float = 30) -> None:
    """Wait until `check()` holds; fail after `timeout` seconds."""
    import time

    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, f"condition not met within {timeout} s"
        time.sleep(0.1)


def start_redis(folder: Path, port: int | None = None) -> tuple[Any, str]:
    """A private redis-server (no persistence) on `port` or a free one: its process and URL, once it answers."""
    import shutil
    import subprocess
    import time

    import redis

    from skillpool.evaluation.process import free_port

    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    port = port or free_port()
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.time() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.RedisError:
            if time.time() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory):  # type: ignore[no-untyped-def]
    """A private redis-server on a free port for this test session (skips when redis-server is absent)."""
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def strict(obj: Any) -> Any:
    """Validate what the openai client parsed (it builds objects without validation) against its own type."""
    return type(obj).model_validate(obj.to_dict(mode="json", exclude_unset=True))


def wait_fine_tuning(client, job_id: str, timeout: float, poll_s: float) -> Any:  # type: ignore[no-untyped-def]
    """Poll a fine-tuning job through the openai client until it ends; its last state, strictly validated."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = strict(client.fine_tuning.jobs.retrieve(job_id))
        if job.status in ("succeeded", "failed", "cancelled"):
            return job
        time.sleep(poll_s)
    raise AssertionError(f"job {job_id} did not finish")


@contextmanager
def served(app: Any) -> Iterator[str]:
    """`app` behind a real uvicorn server on a free port of 127.0.0.1, in a thread of this process; its URL."""
    import threading

    import httpx
    import uvicorn

    from skillpool.evaluation.process import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    root = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            httpx.get(root + "/healthz", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    try:
        yield root
    finally:
        server.should_exit = True
        thread.join(10)
