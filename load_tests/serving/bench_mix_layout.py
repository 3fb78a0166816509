"""Decode-step time of the base model vs per-request k=3 mixes in both LoRABank layouts, on the real base model.

16 rows decode together, each with its own k=3 mix (all different) over a pool of --skills random rank-8 skills
on q,k,v,o (the serving benchmark's shape). Layouts: per row (each row's own 3 blocks gathered: 48 blocks) and
shared (the batch's union of skills gathered once: at most --skills blocks, every row scaled by its weights).
Rounds interleave base, per-row and shared, so the ratios come from one run on the same machine state.

    .venv/bin/python -m load_tests.serving.bench_mix_layout [--rows 16] [--skills 10] [--context 300] [--steps 16]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time

from tests.synthetic import random_skills


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    from skillpool.lora.bank import LoRABank
    from skillpool.runtime.base_model import resolve_base_model
    from skillpool.server.engines.kv import growing_cache

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--skills", type=int, default=10)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--context", type=int, default=300, help="prompt tokens already in each row's KV cache")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per round and layout")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument(
        "--churn", type=int, default=2, help="a row changes its mix every N steps, as joins and leaves do (0: never)"
    )
    args = ap.parse_args()
    torch.manual_seed(0)
    path = resolve_base_model().path
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    bank = LoRABank(model)
    config = json.loads((path / "config.json").read_text())
    names = []
    for name, adapter in random_skills(config, args.skills, args.rank, alpha=2.0 * args.rank):
        bank.add(name, adapter)
        names.append(name)
    rng = random.Random(0)
    combos = rng.sample(list(itertools.combinations(range(args.skills), 3)), args.rows)
    others = [c for c in itertools.combinations(range(args.skills), 3) if c not in combos]

    def mix(combo: tuple[int, ...]) -> list[tuple[str, float]]:
        return [(names[combo[0]], 0.5), (names[combo[1]], 0.3), (names[combo[2]], 0.2)]

    # Compositions in turn: every --churn steps one row (round robin) leaves and a row with a new mix takes its
    # place, as in a closed loop of 64-token answers over 16 rows (one join and one leave every ~4 steps).
    compositions = [[mix(c) for c in combos]]
    for i in range(args.steps):
        nxt = list(compositions[-1])
        nxt[i % args.rows] = mix(rng.choice(others))
        compositions.append(nxt)
    ids = torch.randint(0, 1000, (args.rows, args.context))

    def decode(layout: str) -> float:
        """Seconds per decode step over --steps steps after a prefill (not timed) of --context tokens."""
        prompt = DynamicCache()
        with torch.inference_mode():
            model(input_ids=ids, past_key_values=prompt, use_cache=True, logits_to_keep=1)
            # the engine's cache: steps write their column in place (a DynamicCache would copy it all each step)
            layers = [(layer.keys, layer.values) for layer in prompt.layers]  # type: ignore[union-attr]  # LLaMA's
            cache = growing_cache(layers, spare=args.steps)
            token = torch.zeros(args.rows, 1, dtype=torch.long)
            # the hint picks the layout: one position per row is decode (shared); a huge one forces per-row
            hint = {"base": 1, "shared": 1, "per row": 10**9}[layout]
            start = time.perf_counter()
            for i in range(args.steps):
                if layout != "base" and (i == 0 or (args.churn and i % args.churn == 0)):
                    bank.activate(compositions[i // args.churn if args.churn else 0], tokens=hint)
                out = model(input_ids=token, past_key_values=cache, use_cache=True)
                token = out.logits[:, -1:].argmax(-1)
            took = time.perf_counter() - start
            bank.deactivate()
        return took / args.steps

    layouts = ("base", "per row", "shared")
    decode("shared")  # warm-up
    times: dict[str, list[float]] = {name: [] for name in layouts}
    for r in range(args.rounds):
        for name in layouts if r % 2 == 0 else reversed(layouts):
            times[name].append(decode(name))
    print(
        f"{args.rows} rows, k=3 mixes over {args.skills} skills, rank {args.rank}, context {args.context}, "
        f"a new composition every {args.churn or 'no'} steps, {torch.get_num_threads()} threads"
    )
    base = statistics.median(times["base"])
    for name in layouts:
        t = statistics.median(times[name])
        print(f"  {name:8s}: {t * 1000:7.1f} ms/step (median of {args.rounds}), tokens/s {base / t:.2f}x of base")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
