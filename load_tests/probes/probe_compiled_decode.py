"""What a compiled decode step would buy one user on a CPU, before the engine is built around one: the packaged
model's decode forward compiled with `torch.compile` (Inductor's CPU backend, weights frozen) over a static KV
cache, against the eager forward over a DynamicCache holding the same context (the kind of cache the hf engine's
step runs on), in one run.

Each --batch size is compiled once (shapes fixed: one graph per batch-size bucket, as a server would keep) and
timed over --steps decode steps after --warmup; the sides take turns for --rounds rounds and each side's step time
is its median. Prints ms a step, the ratio, each bucket's compile time (what a server would pay at start), and the
weights' bytes over the step time: a decode step at small batches reads every weight once, so that is the memory
bandwidth the step reaches. One JSON line last.

    .venv/bin/python -m load_tests.probes.probe_compiled_decode [--batch 1,4] [--context 256] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from skillpool.runtime.openmp import in_own_thread, set_openmp_defaults

set_openmp_defaults()  # as `skillpool` runs: before torch loads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,4", help="batch sizes, each compiled once")
    ap.add_argument("--context", type=int, default=256, help="positions already in the cache")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    args = ap.parse_args()
    report: dict[str, Any] = in_own_thread(lambda: measure(args), "skillpool-probe-compile")  # a compute thread
    print(json.dumps(report))
    return 0


def measure(args: Any) -> dict[str, Any]:
    import torch
    import torch._inductor.config as inductor
    from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

    from skillpool.runtime.base_model import resolve_base_model

    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(str(resolve_base_model().path), dtype=dtype).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cfg, ctx, n = model.config, args.context, args.warmup + args.steps
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    inductor.freezing = True  # weights as constants, packed once for oneDNN (as the engine's pack_linears does)
    report: dict[str, Any] = {"dtype": args.dtype, "context": ctx, "weight_mib": round(weights / 2**20, 1)}
    for b in [int(x) for x in args.batch.split(",") if x.strip()]:
        # the static cache is left empty: its step attends over all its columns under a mask, whatever they hold
        static = StaticCache(config=cfg, max_cache_len=ctx + n + 1)
        dynamic = DynamicCache()
        for layer in range(cfg.num_hidden_layers):
            k = torch.randn(b, cfg.num_key_value_heads, ctx, head, dtype=dtype) * 0.5
            dynamic.update(k, torch.randn_like(k), layer)

        def eager_dynamic(ids: Any, pos: Any, at: Any, cache: Any = dynamic) -> Any:
            return model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).logits

        def on_static(ids: Any, pos: Any, at: Any, cache: Any = static) -> Any:
            return model(
                input_ids=ids, position_ids=pos, past_key_values=cache, cache_position=at, use_cache=True
            ).logits

        compiled = torch.compile(on_static, dynamic=False)
        t0 = time.perf_counter()
        with torch.inference_mode():
            compiled(torch.randint(100, 40000, (b, 1)), torch.full((b, 1), ctx), torch.tensor([ctx]))
        compile_s = time.perf_counter() - t0
        sides = {"compiled, static cache": compiled, "eager, dynamic cache": eager_dynamic}
        times: dict[str, list[float]] = {name: [] for name in sides}
        for r in range(args.rounds):
            for name in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                times[name] += steps(sides[name], b, ctx, args.warmup, n)
                if extra := dynamic.get_seq_length() - ctx:  # back to the context: each round decodes the same
                    dynamic.crop(-extra)
        ms = {name: statistics.median(t) * 1000 for name, t in times.items()}
        print(f"\nbatch {b} ({args.dtype}, {ctx}-token context), compiled in {compile_s:.0f} s:", flush=True)
        for name, v in ms.items():
            print(f"  {name:24s} {v:7.1f} ms a step  ({weights / v / 1e6:.1f} GB/s of weights)")
        ratio = ms["compiled, static cache"] / ms["eager, dynamic cache"]
        print(f"  compiled / eager: {ratio:.2f}x")
        report[f"batch_{b}"] = {
            "ms": {k: round(v, 1) for k, v in ms.items()},
            "compiled_over_eager": round(ratio, 3),
            "compile_s": round(compile_s, 1),
        }
    return report


def steps(fn: Any, b: int, ctx: int, warmup: int, n: int) -> list[float]:
    """Decode steps at positions ctx, ctx + 1, ...: forward, argmax, next input; the times after `warmup`."""
    import torch

    ids, times = torch.randint(100, 40000, (b, 1)), []
    with torch.inference_mode():
        for i in range(n):
            t0 = time.perf_counter()
            logits = fn(ids, torch.full((b, 1), ctx + i), torch.tensor([ctx + i]))
            ids = logits[:, -1, :].argmax(dim=-1, keepdim=True)
            times.append(time.perf_counter() - t0)
    return times[warmup:]


if __name__ == "__main__":
    raise SystemExit(main())
