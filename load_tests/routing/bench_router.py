"""Router cost per request with 10 vs 1,000 registered skills (synthetic keys), measured in one run.

Synthetic skills get random unit keys, an input covariance (dtkr's whitening is rebuilt over all of
them), the format model of one of the request tasks (fitted on its real train inputs, so the format
gate checks real grams for every candidate skill) and, for sapt, a key for the query projector, so
retrieval does real work at full size; the embedder is the real MiniLM and sapt pools the real SmolLM2
token embeddings. The index build after the last add is timed separately (first route). Prints p50/p99
per request (one request per call, as a lone chat request is routed) and per batch of 32, the same for
routing alone on precomputed features (MiniLM is most of a request's cost on a CPU and hides how the
rest grows with the pool), and the 1,000 / 10 ratios.

    .venv/bin/python -m load_tests.routing.bench_router [--mode dtkr|sapt|centroid] [--requests 200] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from load_tests.common.datasets import rows, user_text
from skillpool.router import MODES, Router, RouterSettings, TokenPooler
from skillpool.router.dtkr import split_groups
from skillpool.router.embedder import SentenceEmbedder
from skillpool.router.formats import fit_format
from skillpool.router.sapt import SAPTState

TASKS = ("agnews", "sst-2", "mnli", "boolqa")


def synthetic_router(
    embedder: SentenceEmbedder,
    n_skills: int,
    mode: str,
    pooler: TokenPooler | None,
    seed: int = 0,
    format_texts: list[list[str]] | None = None,
) -> Router:
    """format_texts: one list of inputs per format model (default: TASKS' train inputs from the datasets)."""
    settings = RouterSettings(mode=mode)
    router = Router(embedder, settings, pooler)
    if format_texts is None:
        format_texts = [[user_text(r) for r in rows("long_sequence", t, "train", 100)] for t in TASKS]
    formats = [fit_format(texts, settings.format).tensors() for texts in format_texts]
    rng = np.random.default_rng(seed)
    sapt = SAPTState(pooler.dim, settings.sapt) if pooler else None
    for i in range(n_skills):
        keys = rng.normal(size=(settings.n_keys, embedder.dim)).astype(np.float32)
        keys /= np.linalg.norm(keys, axis=1, keepdims=True)
        t = torch.from_numpy(keys)
        a = rng.normal(size=(embedder.dim, 16)).astype(np.float32) / 16
        calib = rng.normal(size=(64, embedder.dim)).astype(np.float32)
        tensors = {
            "centroid_keys": t,
            "dtkr_keys": split_groups(t, settings.dtkr.groups),
            "threshold": torch.tensor([0.0]),
            "threshold_dtkr": torch.tensor([0.0]),
            "input_cov": torch.from_numpy(a @ a.T + 1e-3 * np.eye(embedder.dim, dtype=np.float32)).half(),
            "input_count": torch.tensor([300]),
            # random inputs, not the keys: thresholds low enough that requests pass the similarity gate and
            # take the full path (format checks of the candidate skills, then the mix)
            "calibration_inputs": torch.from_numpy(calib / np.linalg.norm(calib, axis=1, keepdims=True)).half(),
            **formats[i % len(formats)],
        }
        if sapt is not None and pooler is not None:
            tensors["sapt_key"] = torch.from_numpy(rng.normal(size=(pooler.dim,)).astype(np.float32))
            tensors["sapt_blocks"] = torch.tensor([i + 1])
            tensors.update({k: v for k, v in sapt.projector_tensors().items()})
        router.add_skill(f"s{i}", tensors)
    return router


def timings(router: Router, texts: list[str], batch: int) -> tuple[float, float]:
    out = []
    for i in range(0, len(texts) - batch + 1, batch):
        t0 = time.perf_counter()
        router.route(texts[i : i + batch])
        out.append((time.perf_counter() - t0) / batch)
    return _p50_p99(out)


def route_only(router: Router, texts: list[str]) -> tuple[float, float]:
    """Retrieval, gates and mix on precomputed features (MiniLM excluded): the part that grows with the pool."""
    feats = [router.features([t]) for t in texts]
    out = []
    for f in feats:
        t0 = time.perf_counter()
        router.route_features(f)
        out.append(time.perf_counter() - t0)
    return _p50_p99(out)


def _p50_p99(out: list[float]) -> tuple[float, float]:
    out = sorted(out)
    return out[len(out) // 2], out[min(len(out) - 1, int(0.99 * len(out)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=MODES, default=RouterSettings().mode)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--device", default=None, help="where MiniLM runs: cpu or cuda (default: cuda when available)")
    args = ap.parse_args()
    texts = [user_text(r) for t in TASKS for r in rows("long_sequence", t, "test", args.requests // 4 + 32)]
    embedder = SentenceEmbedder(device=args.device)
    embedder.embed(texts[:8])  # warm-up
    pooler = None
    if args.mode == "sapt":
        from skillpool.runtime.base_model import resolve_base_model

        pooler = TokenPooler.from_checkpoint(resolve_base_model().path, pool=RouterSettings().sapt.pool)
    res: dict[int, dict[str, Any]] = {}
    for n in (10, 1000):
        t0 = time.perf_counter()
        router = synthetic_router(embedder, n, args.mode, pooler)
        router.route(texts[:4])  # the first route builds the indexes (and the whitening) once
        build = time.perf_counter() - t0
        reasons = Counter(d.reason for d in router.route(texts[: args.requests]))
        print(f"{n} skills: decisions {dict(reasons)}")
        res[n] = {
            "single": timings(router, texts[: args.requests], 1),
            "batch32": timings(router, texts, 32),
            "build_s": build,
            "route_only": route_only(router, texts[: args.requests]),
        }
    # the same 1,000-skill router without the format gate: what the gate's checks of up to 32 candidate skills cost
    router.settings = replace(router.settings, format=replace(router.settings.format, enabled=False))
    off: dict[str, Any] = {
        "single": timings(router, texts[: args.requests], 1),
        "batch32": timings(router, texts, 32),
        "build_s": 0.0,
        "route_only": route_only(router, texts[: args.requests]),
    }
    where = f"{torch.get_num_threads()} CPU threads" if embedder.device == "cpu" else embedder.device
    print(f"router mode {args.mode}, {args.requests} single requests, MiniLM on {where}")
    print(
        f"{'skills':>7s} {'p50 ms/req':>11s} {'p99 ms/req':>11s} {'batch32 p50 ms/req':>19s} {'add+build s':>14s} {'route-only p50 / p99 ms':>24s}"
    )
    for n, r in res.items():
        print(
            f"{n:7d} {1000 * r['single'][0]:11.2f} {1000 * r['single'][1]:11.2f} {1000 * r['batch32'][0]:19.2f} {r['build_s']:14.2f} "
            f"{1000 * r['route_only'][0]:14.2f} / {1000 * r['route_only'][1]:.2f}"
        )
    print(
        f"1000, format gate off: {1000 * off['single'][0]:.2f} / {1000 * off['single'][1]:.2f} / {1000 * off['batch32'][0]:.2f} ms, "
        f"route-only {1000 * off['route_only'][0]:.2f} / {1000 * off['route_only'][1]:.2f} ms"
    )
    print(
        f"\n1000 / 10 skills, p50 single: {res[1000]['single'][0] / res[10]['single'][0]:.2f}x; "
        f"p99 single: {res[1000]['single'][1] / res[10]['single'][1]:.2f}x; batch32 p50: {res[1000]['batch32'][0] / res[10]['batch32'][0]:.2f}x"
    )
    print(f"route-only (no MiniLM) 1000 / 10 skills, p50: {res[1000]['route_only'][0] / res[10]['route_only'][0]:.2f}x")
    print(
        f"format gate on / off at 1000 skills, p50 single: {res[1000]['single'][0] / off['single'][0]:.2f}x; "
        f"batch32 p50: {res[1000]['batch32'][0] / off['batch32'][0]:.2f}x; route-only p50: {res[1000]['route_only'][0] / off['route_only'][0]:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
