"""The hf engine's decode step against the model's own cost, in one run: base rows against the plain `transformers`
forward of the same model and dtype, k=3 mix rows against that forward plus PEFT's mixed-batch LoRA.

--batch rows decode together after a --context-token prompt each (random token ids; greedy, ignore_eos):
  - engine: the real engine loop (prefill, then decode); a step is the time between two decode steps of the full
    batch, so it holds everything the loop does per token (sampling, detokenizing, events, KV bookkeeping);
  - plain: `model(ids, position_ids, cache)` and an argmax, the cache a DynamicCache over the same context
    (what the engine's cache is; the engine writes in place where DynamicCache concatenates) and, for reference,
    a StaticCache;
  - mixes: every row its own k=3 mix (all different) of --skills random rank-8 skills on q,k,v,o; PEFT serves a
    mix as one concatenated adapter (`add_weighted_adapter(..., "cat")`, exact) per row, with `adapter_names`.
Rounds interleave the sides (each side's step time is its median), so both sides of a ratio share the machine;
each side runs torch on a thread of its own with no other OpenMP pool alive, as the engine's loop does in a server.
To see where an engine step goes: `py-spy record --native --threads` over this script (the engine's own thread).

    .venv/bin/python -m load_tests.serving.bench_engine_step [--dtypes float32,bfloat16] [--batch 16] [--context 256]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from skillpool.runtime.openmp import in_own_thread, set_openmp_defaults
from tests.synthetic import random_skills, save_peft

set_openmp_defaults()  # as `skillpool` runs: before torch loads
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16"}


class EngineSide:
    """The engine measured through its own loop: the gaps between its decode steps over the full batch. Each run
    starts an engine and closes it after, so its loop's OpenMP pool is the only one alive while a side runs."""

    def __init__(self, make: Any, batch: int, context: int, steps: int, warmup: int) -> None:
        self.make, self.batch, self.context, self.steps, self.warmup = make, batch, context, steps, warmup
        self._stamps: list[float] = []

    def _on_step(self, rows: int) -> None:
        if rows == self.batch:
            self._stamps.append(time.perf_counter())

    def run(self, mixes: list[Any], prompts: list[list[int]]) -> list[float]:
        self.engine = in_own_thread(self.make, "skillpool-bench-load")
        self.engine.on_step = self._on_step
        try:
            return self._run(mixes, prompts)
        finally:
            self.engine.close()

    def _run(self, mixes: list[Any], prompts: list[list[int]]) -> list[float]:
        from skillpool.server.engines.protocol import EngineRequest, SamplingParams

        self._stamps = []
        done = threading.Semaphore(0)
        need = self.warmup + self.steps + 1

        def sink(ev: Any) -> None:
            if ev.finish_reason is not None:
                if ev.finish_reason not in ("length", "abort"):
                    print(f"  a row ended with {ev.finish_reason}: {ev.error}", flush=True)
                done.release()

        params = SamplingParams(max_tokens=need + 2, temperature=0.0, ignore_eos=True)
        tag = f"{time.monotonic_ns()}"
        for i, (mix, prompt) in enumerate(zip(mixes, prompts)):
            self.engine.submit(EngineRequest(f"{tag}-{i}", prompt, params, mix), sink)
        for _ in mixes:
            done.acquire()
        stamps = self._stamps[-(need + 1) :]
        return [b - a for a, b in itertools.pairwise(stamps)][self.warmup :]


def plain_steps(model: Any, cache: Any, batch: int, context: int, steps: int, warmup: int, **kw: Any) -> list[float]:
    """Decode steps of the bare model over a filled cache: forward, argmax, next input."""
    import torch

    ids = torch.randint(100, 40000, (batch, 1))
    times = []
    with torch.inference_mode():
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            pos = torch.full((batch, 1), context + i, dtype=torch.long)
            out = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, **kw)
            ids = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
            times.append(time.perf_counter() - t0)
    return times[warmup:]


def filled_cache(model: Any, batch: int, context: int, room: int, static: bool) -> Any:
    """A cache holding `context` positions of random keys/values per row (decode time does not depend on them)."""
    import torch
    from transformers import DynamicCache, StaticCache

    cfg = model.config
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    p = next(model.parameters())
    shape = (batch, cfg.num_key_value_heads, context, head)
    if static:
        cache: Any = StaticCache(config=cfg, max_cache_len=context + room)
    else:
        cache = DynamicCache()
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(shape, dtype=p.dtype) * 0.5
        kw = {"cache_position": torch.arange(context)} if static else {}
        cache.update(k, torch.randn_like(k), layer, kw)
    return cache


def peft_model(path: Path, dtype: Any, skills: list[tuple[str, Any]], mixes: list[Any], tmp: Path) -> Any:
    """The base model under PEFT with every skill loaded and each mix one concatenated adapter (exact)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folders = save_peft(skills, tmp / "peft", "base")
    base = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    model = PeftModel.from_pretrained(base, str(folders[0]), adapter_name=skills[0][0])
    for (name, _), folder in zip(skills[1:], folders[1:]):
        model.load_adapter(str(folder), adapter_name=name)
    for i, mix in enumerate(mixes):
        names, weights = zip(*mix.ranked)
        model.add_weighted_adapter(list(names), list(weights), f"mix{i}", combination_type="cat")
    return model.eval()


def measure_dtype(args: Any, dtype: Any, path: Path, skills: list[Any], mixes: list[Any], tmp: Path) -> dict[str, Any]:
    """Every side at one dtype, in interleaved rounds: median step times and the ratios."""
    from transformers import AutoModelForCausalLM

    from skillpool.lora.mix import Mix
    from skillpool.server.engines.hf import HFEngine

    b, ctx, steps, warm = args.batch, args.context, args.steps, args.warmup
    room = warm + steps + 1

    def make() -> HFEngine:
        engine = HFEngine(path, device="cpu", dtype=dtype, max_num_seqs=b, max_batched_tokens=b * (ctx + 1))
        for name, adapter in skills:
            engine.add_skill(name, lambda a=adapter: a)
        return engine

    side = EngineSide(make, b, ctx, steps, warm)
    plain = in_own_thread(lambda: AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval(), "load")
    peft = in_own_thread(lambda: peft_model(path, dtype, skills, mixes, tmp), "load")
    prompt = [random.Random(1).randrange(100, 40000) for _ in range(ctx)]
    names = [f"mix{i}" for i in range(b)]

    def plain_run(model: Any, static: bool = False, **kw: Any) -> list[float]:
        def run() -> list[float]:  # a thread of its own, as the engine's loop is
            return plain_steps(model, filled_cache(plain, b, ctx, room, static), b, ctx, steps, warm, **kw)

        return in_own_thread(run, "skillpool-bench-plain")

    sides = {
        # the same prompt in every base row: its prefill is computed once (prefix cache); the mixes' differ
        "engine base": lambda: side.run([Mix.base()] * b, [prompt] * b),
        "plain forward": lambda: plain_run(plain),
        "engine k=3 mixes": lambda: side.run(mixes, [[*prompt[:-1], 100 + i] for i in range(b)]),
        "plain + PEFT k=3 mixes": lambda: plain_run(peft, adapter_names=names),
    }
    if args.static:
        sides["plain forward, static cache"] = lambda: plain_run(plain, static=True)
    times: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            t = sides[name]()
            times.setdefault(name, []).extend(t)
            print(f"  {name}: {statistics.median(t) * 1000:.1f} ms a step", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {
        "base": med["engine base"] / med["plain forward"],
        "k=3 mixes": med["engine k=3 mixes"] / med["plain + PEFT k=3 mixes"],
        "mixes vs base (engine)": med["engine k=3 mixes"] / med["engine base"],
    }
    print(f"{dtype}, batch {b}, context {ctx}, median step:")
    for k, v in med.items():
        print(f"  {k:34s} {v * 1000:7.1f} ms  ({b / v:.0f} tok/s)")
    print("  ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()) + " (targets: <= 1.2x)")
    return {
        "ms": {k: round(v * 1000, 1) for k, v in med.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
    }


def main() -> int:
    import torch

    from skillpool.lora.mix import Mix
    from skillpool.runtime.base_model import resolve_base_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=256, help="prompt tokens of every row")
    ap.add_argument("--steps", type=int, default=12, help="decode steps measured per round and side")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skills", type=int, default=10)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--static", action="store_true", help="also time the plain forward on a StaticCache")
    args = ap.parse_args()
    torch.manual_seed(0)
    path = resolve_base_model().path
    config = json.loads((path / "config.json").read_text())
    # no torch work on this thread: a pool of its own would throttle the measured threads' spinning (openmp.py)
    skills = in_own_thread(lambda: list(random_skills(config, args.skills, args.rank, alpha=2.0 * args.rank)), "load")
    combos = random.Random(0).sample(list(itertools.combinations(range(args.skills), 3)), args.batch)
    mixes = [Mix.of({skills[a][0]: 0.5, skills[b][0]: 0.3, skills[c][0]: 0.2}) for a, b, c in combos]
    tmp = Path(tempfile.mkdtemp(prefix="skillpool-step-"))
    report: dict[str, Any] = {"batch": args.batch, "context": args.context, "threads": torch.get_num_threads()}
    for dname in [DTYPES[d.strip()] for d in args.dtypes.split(",") if d.strip()]:
        print(f"\n{dname}: loading the engine, the plain model and PEFT ...", flush=True)
        report[dname] = measure_dtype(args, getattr(torch, dname), path, skills, mixes, tmp / dname)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
