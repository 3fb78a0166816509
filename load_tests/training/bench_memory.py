"""A server's memory after training jobs, with one setting off and on: the heap trim after each job
(trainer/heap.py, `--vary trim`, the default) or gradient checkpointing (`--vary checkpointing`, the upload's
`gradient_checkpointing` "off" against "on", or against "auto", the default, with `--checkpointing auto`).

Two `skillpool serve` processes, one after the other, on fresh data dirs: the first with the setting off
(SKILLPOOL_HEAP_TRIM=0), the second with it on. Each trains the same jobs in turn (imdb's long reviews by
default: their activations are the largest of the benchmark's tasks) and, after every job, reports the
server's resident memory (VmRSS) and its peak so far (VmHWM). Prints both and the on/off ratios:

    .venv/bin/python -m load_tests.training.bench_memory [--tasks imdb yelp] [--train-rows 30] [--epochs 1] [--vary trim]
        [--checkpointing on|auto]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from load_tests.common.datasets import rows
from load_tests.common.memory import status_kib
from skillpool.evaluation.tasks_client import TasksClient, UploadRefused

MIB = 1024


def run(vary: str, on: bool, tasks: list[str], n: int, epochs: int, checkpointing: str) -> list[dict[str, Any]]:
    from skillpool.evaluation.process import ServerProcess

    trim = on or vary != "trim"
    os.environ["SKILLPOOL_HEAP_TRIM"] = "1" if trim else "0"  # the child server inherits it
    config: dict[str, object] = {"epochs": epochs}
    if vary == "checkpointing":
        config["gradient_checkpointing"] = checkpointing if on else "off"
    root = Path(tempfile.mkdtemp(prefix=f"skillpool-memory-{vary}-{'on' if on else 'off'}-"))
    out = []
    with ServerProcess(root / "data") as srv:
        assert srv.proc is not None
        pid = srv.proc.pid
        out.append({"job": "(started)", "rss": status_kib(pid, "VmRSS") / MIB, "peak": status_kib(pid, "VmHWM") / MIB})
        for task in tasks:
            body = "\n".join(json.dumps(r) for r in rows("long_sequence", task, "train", n)).encode()
            try:
                job = TasksClient(srv.url).train(f"{task}-mem", body, progress=False, config=config, force=True)
            except UploadRefused as e:
                raise SystemExit(str(e)) from None
            time.sleep(2)  # the worker trims in run_job's finally, after it marked the job done
            rss, peak = status_kib(pid, "VmRSS") / MIB, status_kib(pid, "VmHWM") / MIB
            out.append({"job": f"{task} ({job['status']})", "rss": rss, "peak": peak})
            print(
                f"  {vary} {'on ' if on else 'off'} after {task}: RSS {rss:,.0f} MiB, peak {peak:,.0f} MiB", flush=True
            )
        httpx.get(srv.url + "/healthz", timeout=10).raise_for_status()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=["imdb", "yelp"])
    ap.add_argument("--train-rows", type=int, default=30)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--vary", choices=("trim", "checkpointing"), default="trim", help="the setting turned off, then on")
    ap.add_argument(
        "--checkpointing",
        choices=("on", "auto"),
        default="on",
        help="with --vary checkpointing: the value compared with 'off'",
    )
    args = ap.parse_args()
    off = run(args.vary, False, args.tasks, args.train_rows, args.epochs, args.checkpointing)
    on = run(args.vary, True, args.tasks, args.train_rows, args.epochs, args.checkpointing)
    print(f"\n{args.vary} off, then {args.checkpointing if args.vary == 'checkpointing' else 'on'}")
    print(f"{'after':<22} {'RSS off':>9} {'RSS on':>9} {'on/off':>7} {'peak off':>9} {'peak on':>9}")
    for a, b in zip(off, on):
        print(
            f"{a['job']:<22} {a['rss']:>9,.0f} {b['rss']:>9,.0f} {b['rss'] / a['rss']:>7.2f} "
            f"{a['peak']:>9,.0f} {b['peak']:>9,.0f}"
        )
    print("(MiB; RSS is what the server holds between jobs, peak the most it held so far)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
