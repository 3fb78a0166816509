"""What gradient checkpointing costs and saves in a training step (TrainConfig.gradient_checkpointing).

On the real SmolLM2 and the device the trainer would use (CUDA when there is one): the same yelp batches (the
longest reviews, 512 tokens at the default max_seq_len; `--task` another task, `--sample` a random sample of its
rows, a job's mix of lengths) trained by the isolated method's loop from the same fresh LoRA, with checkpointing
off and on (`--kinds`: any of off, on and auto, the first the base of the ratios). Each run is a process of its
own, so that its peak memory is its own (VmHWM on the CPU, max_memory_allocated on CUDA); the kinds alternate, so
machine noise hits them alike. Prints, per run, the memory the model held before training, the peak while
training and seconds per optimizer step; then the medians and the ratios to the first kind, measured in one run:

    .venv/bin/python -m load_tests.training.bench_checkpointing [--rows 16] [--batch-size 8] [--rounds 2]
        [--task long_sequence/yelp] [--sample] [--kinds off,on,auto]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

from load_tests.common.datasets import rows
from load_tests.common.memory import status_kib

GIB = 1024**3


def child(kind: str, n_rows: int, batch_size: int, sample: bool, group: str, task: str) -> dict[str, Any]:
    """One training run; its memory and time as a JSON-able dict."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from skillpool.runtime.base_model import resolve_base_model, resolve_device
    from skillpool.trainer.config import CHECKPOINTING, TrainConfig
    from skillpool.trainer.datasets import parse_jsonl
    from skillpool.trainer.loop import Method, Schedule, TrainLoop
    from skillpool.trainer.lora_train import add_lora, encode_example, pad_id

    cfg = TrainConfig(epochs=1.0)
    base, device = resolve_base_model(None), resolve_device()
    tok = AutoTokenizer.from_pretrained(str(base.path))
    body = "\n".join(json.dumps(r) for r in rows(group, task, "train", None)).encode()
    encoded = [encode_example(tok, ex, cfg.max_seq_len) for ex in parse_jsonl(body)]
    if sample:  # a job's mix of lengths
        encoded = random.Random(0).sample(encoded, n_rows)
    else:  # the batches that set a job's peak
        encoded = sorted(encoded, key=lambda e: -len(e[0]))[:n_rows]
    model = AutoModelForCausalLM.from_pretrained(str(base.path), dtype=torch.float32)
    peft = add_lora(model, cfg.rank, cfg.alpha, cfg.dropout, cfg.target_modules, cfg.seed).to(device)
    schedule = Schedule(1.0, batch_size, cfg.learning_rate, cfg.seed, checkpointing=CHECKPOINTING[kind])
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
    ap.add_argument("--rows", type=int, default=16, help="the task's longest training rows: rows / batch steps per run")
    ap.add_argument("--batch-size", type=int, default=8, help="rows per step (TrainConfig.batch_size)")
    ap.add_argument("--sample", action="store_true", help="a random sample of rows instead of the longest")
    ap.add_argument("--kinds", default="off,on", help="gradient_checkpointing values to compare, the first as the base")
    ap.add_argument("--task", default="long_sequence/yelp", help="GROUP/TASK under SKILLPOOL_DATASETS")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each kind, alternating")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rows, args.batch_size, args.sample, *args.task.split("/", 1))))
        return 0
    kinds = args.kinds.split(",")
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            argv = ["--rows", str(args.rows), "--batch-size", str(args.batch_size), "--task", args.task]
            argv += ["--sample"] if args.sample else []
            out = subprocess.run(
                [sys.executable, "-m", "load_tests.training.bench_checkpointing", *argv, "--child", kind],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            r = json.loads(out.strip().splitlines()[-1])
            runs[kind].append(r)
            print(
                f"checkpointing {kind:<4}: before {r['before']:.2f} GiB, peak {r['peak']:.2f} GiB, "
                f"{r['s_per_step']:.2f} s per step",
                flush=True,
            )
    first = runs[kinds[0]][0]
    med = {
        k: {f: statistics.median(r[f] for r in v) for f in ("before", "peak", "s_per_step")} for k, v in runs.items()
    }
    print(
        f"device {first['device']}; {args.rows} {'random' if args.sample else 'of the longest'} {args.task} rows ({first['tokens_per_row']:.0f} tokens each on "
        f"average) at batch {args.batch_size}; median of {args.rounds} runs each; memory: "
        + ("max_memory_allocated" if first["device"] == "cuda" else "the process's VmHWM")
    )
    for kind, m in med.items():
        print(
            f"{kind:<4}  peak {m['peak']:.2f} GiB (training adds {m['peak'] - m['before']:.2f}), {m['s_per_step']:.2f} s/step"
        )
    base = med[kinds[0]]
    for kind in kinds[1:]:
        m = med[kind]
        print(f"{kind} / {kinds[0]}: peak {m['peak'] / base['peak']:.3f}, ", end="")
        print(f"memory training adds {(m['peak'] - m['before']) / (base['peak'] - base['before']):.3f}, ", end="")
        print(f"seconds per step {m['s_per_step'] / base['s_per_step']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
