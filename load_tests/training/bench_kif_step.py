"""What a kif training step costs over a plain LoRA step, and what skipping the identity fusion saves.

On the real SmolLM2 and the device the trainer would use (CUDA when there is one): the same yelp batches
trained three ways from the same fresh LoRA, each round in turn so machine noise hits them alike:
- plain: the isolated method's loop (`Method`), the task steps only;
- kif: Recurrent-KIF at the default share 1.0, the task steps plus one memory (amazon) step per cycle, with the
  fusion skipped because at that share it is the identity;
- kif, fused: the same run doing the importance EMAs, snapshots and masked fusion anyway (as the loop did
  before it skipped them).
Prints seconds per optimizer step (memory steps counted) for each and the ratios, measured in one run:

    .venv/bin/python -m load_tests.training.bench_kif_step [--rows 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from load_tests.common.datasets import rows


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from skillpool.runtime.base_model import resolve_base_model, resolve_device
    from skillpool.trainer.config import TrainConfig
    from skillpool.trainer.datasets import parse_jsonl
    from skillpool.trainer.loop import Method, TrainLoop
    from skillpool.trainer.lora_train import add_lora, encode_example, pad_id, schedule_of
    from skillpool.trainer.methods.kif import KIF, KIFSettings

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64, help="yelp training rows: rows / batch size task steps")
    ap.add_argument("--memory", type=int, default=24, help="amazon rows in the memory buffer")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    cfg = TrainConfig(epochs=1.0)
    base = resolve_base_model(None)
    device = resolve_device()
    tok = AutoTokenizer.from_pretrained(str(base.path))

    def encoded(task: str, n: int) -> list[Any]:
        body = "\n".join(json.dumps(r) for r in rows("long_sequence", task, "train", n)).encode()
        return [encode_example(tok, ex, cfg.max_seq_len) for ex in parse_jsonl(body)]

    new, memory = encoded("yelp", args.rows), encoded("amazon", args.memory)
    model = AutoModelForCausalLM.from_pretrained(str(base.path), dtype=torch.float32)
    peft = add_lora(model, cfg.rank, cfg.alpha, cfg.dropout, cfg.target_modules, cfg.seed).to(device)
    fresh = {n: p.detach().clone() for n, p in peft.named_parameters() if p.requires_grad}
    tensors = len(fresh)

    def method(kind: str) -> Method:
        if kind == "plain":
            return Method(peft)
        settings = KIFSettings(inner_steps=cfg.kif_inner_steps)
        return KIF(peft, memory, settings, cfg.seed, fuse=True if kind == "kif, fused" else None)

    def run(kind: str) -> float:
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if p.requires_grad:
                    p.copy_(fresh[n])
        loop = TrainLoop(method(kind), new, pad_id(tok), schedule_of(cfg))
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loop.run()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / loop.total

    kinds = ("plain", "kif", "kif, fused")
    run("plain")  # warm-up: allocator, kernels, first-touch
    per_step: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            per_step[kind].append(run(kind))
    s = {k: statistics.median(v) for k, v in per_step.items()}
    print(
        f"device {device}; {args.rows} yelp rows at batch {cfg.batch_size}, max_seq_len {cfg.max_seq_len}; "
        f"{tensors} trainable tensors; median of {args.rounds} rounds"
    )
    for kind in kinds:
        print(f"{kind:<12} {s[kind] * 1000:8.1f} ms per optimizer step")
    print(f"kif / plain:        {s['kif'] / s['plain']:.3f}")
    print(f"kif fused / plain:  {s['kif, fused'] / s['plain']:.3f}")
    print(f"kif fused / kif:    {s['kif, fused'] / s['kif']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
