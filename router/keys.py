"""Per-skill router keys: k-means centroids of the skill's input embeddings, plus a fallback threshold."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import faiss
import numpy as np


def _normalize(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def centroid_keys(embeddings: np.ndarray, n_keys: int, seed: int = 0) -> np.ndarray:
    """Up to `n_keys` unit-norm k-means centroids (spherical: cosine geometry) of unit-norm embeddings."""
    x = np.ascontiguousarray(embeddings, dtype=np.float32)
    k = max(1, min(n_keys, len(x)))
    if k == len(x):
        return _normalize(x.copy())
    km = faiss.Kmeans(x.shape[1], k, niter=25, seed=seed, spherical=True, verbose=False, min_points_per_centroid=1)
    km.train(x)
    assert km.centroids is not None  # set by train()
    return _normalize(km.centroids.astype(np.float32))


def fold_ids(n: int, folds: int) -> np.ndarray | None:
    """The fold of each of n inputs (None: too few inputs or folds to hold any out)."""
    return np.arange(n) % folds if folds >= 2 and n >= 2 * folds else None


def held_out_best(
    embeddings: np.ndarray,
    fit: Callable[[np.ndarray], Any],
    score: Callable[[np.ndarray, Any], np.ndarray],
    folds: int,
    fitted: list[Any] | None = None,
) -> np.ndarray:
    """Each input's best key score, with the keys fitted on the other folds (input i is in fold_ids' fold).

    In-sample scores are optimistic (the keys were fitted to those very points): thresholds from them sit
    too high and send some of a skill's own new requests to the base model; held-out scores do not.
    fitted: if given, receives the keys fitted without each fold, in fold order (nothing when not held out).
    """
    x = np.ascontiguousarray(embeddings, dtype=np.float32)
    fold = fold_ids(len(x), folds)
    if fold is None:
        return score(x, fit(x))
    best = np.empty(len(x), dtype=np.float32)
    for f in range(folds):
        keys = fit(x[fold != f])
        best[fold == f] = score(x[fold == f], keys)
        if fitted is not None:
            fitted.append(keys)
    return best


def calibrate_threshold(best: np.ndarray, percentile: float, margin: float) -> float:
    """A low percentile of the skill's own inputs' best key score, minus a margin for unseen phrasing."""
    return float(np.percentile(best, percentile) - margin)
