"""Per-skill router keys: k-means centroids of the skill's input embeddings, plus a fallback threshold."""
from __future__ import annotations

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
    return _normalize(km.centroids.astype(np.float32))


def calibrate_threshold(embeddings: np.ndarray, keys: np.ndarray, percentile: float, margin: float) -> float:
    """A low percentile of the skill's own inputs' best key score, minus a margin for unseen phrasing."""
    best = (embeddings @ keys.T).max(axis=1)
    return float(np.percentile(best, percentile) - margin)
