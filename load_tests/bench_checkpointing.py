"""What gradient checkpointing costs and saves in a training step (TrainConfig.gradient_checkpointing).

On the real SmolLM2 and the device the trainer would use (CUDA when there is one): the same yelp batches
(the longest reviews, 512 tokens at the default max_seq_len; `--task` another task) trained by the isolated method's loop from the
same fresh LoRA, with checkpointing off and on. Each run is a process of its own, so that its peak memory is
its own (VmHWM on the CPU, max_memory_allocated on CUDA); the runs alternate, off then on, so machine noise
hits both alike. Prints, per run, the memory the model held before training, the peak while training and
seconds per optimizer step; then the medians and the on/off ratios, measured in one run:

    .venv/bin/python load_tests/bench_checkpointing.py [--rows 16] [--rounds 2] [--task long_sequence/yelp]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from load_tests.common import rows, status_kib  # noqa: E402

GIB = 1024**3


def child(on: bool, n_rows: int, group: str, task: str) -> dict[str, Any]:
    """One training run; its memory and time as a JSON-able dict."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from skillpool.adapters_store.base_model import resolve_base_model, resolve_device
    from skillpool.trainer.config import TrainConfig
    from skillpool.trainer.datasets import parse_jsonl
    from skillpool.trainer.loop import Method, Schedule, TrainLoop
    from skillpool.trainer.lora_train import add_lora, encode_example, pad_id

    cfg = TrainConfig(epochs=1.0)
    base, device = resolve_base_model(None), resolve_device()
    tok = AutoTokenizer.from_pretrained(str(base.path))
    body = "\n".join(json.dumps(r) for r in rows(group, task, "train", None)).encode()
    encoded = [encode_example(tok, ex, cfg.max_seq_len) for ex in parse_jsonl(body)]
    encoded = sorted(encoded, key=lambda e: -len(e[0]))[:n_rows]  # the batches that set a job's peak
    model = AutoModelForCausalLM.from_pretrained(str(base.path), dtype=torch.float32)
    peft = add_lora(model, cfg.rank, cfg.alpha, cfg.dropout, cfg.target_modules, cfg.seed).to(device)
    schedule = Schedule(1.0, cfg.batch_size, cfg.learning_rate, cfg.seed, checkpointing=on)
    loop = TrainLoop(Method(peft), encoded, pad_id(tok), schedule)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / GIB
    else:
        before = status_kib(os.getpid(), "VmRSS") * 1024 / GIB
    t0 = time.perf_counter()
    loop.run()
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / loop.total
    peak = (
        torch.cuda.max_memory_allocated() / GIB if device == "cuda" else status_kib(os.getpid(), "VmHWM") * 1024 / GIB
    )
    tokens = sum(len(e[0]) for e in encoded) / len(encoded)
    return {"device": device, "before": before, "peak": peak, "s_per_step": seconds, "tokens_per_row": tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=16, help="the task's longest training rows: rows / 8 steps per run")
    ap.add_argument("--task", default="long_sequence/yelp", help="GROUP/TASK under ../shared/datasets")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each kind, alternating")
    ap.add_argument("--child", choices=("on", "off"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child == "on", args.rows, *args.task.split("/", 1))))
        return 0
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for _ in range(args.rounds):
        for kind in runs:
            out = subprocess.run(
                [sys.executable, __file__, "--rows", str(args.rows), "--task", args.task, "--child", kind],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            r = json.loads(out.strip().splitlines()[-1])
            runs[kind].append(r)
            print(
                f"checkpointing {kind:<3}: before {r['before']:.2f} GiB, peak {r['peak']:.2f} GiB, "
                f"{r['s_per_step']:.2f} s per step",
                flush=True,
            )
    first = runs["off"][0]
    med = {
        k: {f: statistics.median(r[f] for r in v) for f in ("before", "peak", "s_per_step")} for k, v in runs.items()
    }
    print(
        f"device {first['device']}; the {args.rows} longest {args.task} rows ({first['tokens_per_row']:.0f} tokens each on "
        f"average) at batch 8; median of {args.rounds} runs each; memory: "
        + ("max_memory_allocated" if first["device"] == "cuda" else "the process's VmHWM")
    )
    for kind, m in med.items():
        print(
            f"{kind:<3}  peak {m['peak']:.2f} GiB (training adds {m['peak'] - m['before']:.2f}), {m['s_per_step']:.2f} s/step"
        )
    added = {k: m["peak"] - m["before"] for k, m in med.items()}
    print(f"peak on / off:            {med['on']['peak'] / med['off']['peak']:.3f}")
    print(f"memory training adds, on / off: {added['on'] / added['off']:.3f}")
    print(f"seconds per step, on / off:     {med['on']['s_per_step'] / med['off']['s_per_step']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
