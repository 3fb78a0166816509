"""DTKR's aggregation over groups: the mean (what the router computes, exactly, with one FAISS index)
against the median, a trimmed mean (the worst group dropped) and the min, which would need a per-group
search. All tasks are learned into one router; every test input goes to its nearest slot by each
aggregation, in the router's whitened space, with no gate. Prints top-1 per aggregation.

    .venv/bin/python -m load_tests.routing.routing_aggregation --tasks "$SKILLPOOL_DATASETS"/long_sequence/* \
        [--text with-instruction|input-only] [--train-limit 300] [--cache DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

from skillpool.evaluation.tasks import load_task
from skillpool.router import Router, RouterSettings
from skillpool.router.dtkr import split_groups
from skillpool.router.embedder import CachedEmbedder, Embedder, SentenceEmbedder

AGGREGATIONS = {
    "mean": lambda c: c.mean(-1),
    "median": lambda c: np.median(c, -1),
    "trimmed": lambda c: np.sort(c, -1)[..., 1:].mean(-1),
    "min": lambda c: c.min(-1),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=Path, nargs="+", required=True)
    ap.add_argument("--text", choices=("with-instruction", "input-only"), default="with-instruction")
    ap.add_argument("--train-limit", type=int, default=300)
    ap.add_argument("--cache", type=Path, default=None, help="sentence-embedding cache, as eval routing --cache")
    args = ap.parse_args()
    tasks = [load_task(f, args.text, args.train_limit, None) for f in args.tasks]
    embedder: Embedder = SentenceEmbedder()
    if args.cache:
        embedder = CachedEmbedder(embedder, args.cache)
    router = Router(embedder, RouterSettings(mode="dtkr"))
    keys = []
    for t in tasks:
        tensors = router.prepare_keys(t.train)
        router.add_skill(t.name, tensors)
        keys.append(tensors["dtkr_keys"].float().reshape(len(tensors["dtkr_keys"]), -1).numpy())  # (K, D) raw sub-keys
    w = router.whitening_matrix()
    assert w is not None
    groups = router.settings.dtkr.groups
    white = lambda x: split_groups(torch.from_numpy(np.ascontiguousarray(x @ w, dtype=np.float32)), groups).numpy()  # noqa: E731
    k = np.stack([white(x) for x in keys])  # (skills, K, G, d/G)
    right = {a: 0 for a in AGGREGATIONS}
    total = 0
    for i, t in enumerate(tasks):
        chunk_cos = np.einsum("ngd,skgd->nskg", white(embedder.embed(t.test)), k)
        for a, agg in AGGREGATIONS.items():
            right[a] += int((agg(chunk_cos).max(-1).argmax(-1) == i).sum())
        total += len(t.test)
    print(f"{len(tasks)} tasks, {args.text}, {total} test inputs, nearest slot, no gate")
    for a, r in right.items():
        print(f"  {a:8s} top-1 {r / total:.4f}  ({r / total / (right['mean'] / total):.3f}x of mean)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
