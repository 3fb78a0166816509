"""The `--threads` flag of every process that runs torch (`serve`, `worker`), defined once."""

from __future__ import annotations

import argparse
import os

from .openmp import set_compute_threads


def add_threads_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--threads",
        type=int,
        default=int(os.environ["SKILLPOOL_THREADS"]) if os.environ.get("SKILLPOOL_THREADS") else None,
        help="CPU threads for torch (env SKILLPOOL_THREADS; default: every core). When a server and a worker share "
        "a machine, give each its own share (e.g. 1 and 1 on 2 cores): two full thread pools on the same cores "
        "slow serving by more than 10x",
    )


def set_threads(n: int | None) -> None:
    if n is None:
        return
    if n < 1:
        raise SystemExit("--threads must be at least 1")
    import torch

    set_compute_threads(n)
    torch.set_num_interop_threads(max(1, min(n, 2)))
