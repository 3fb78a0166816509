"""Fallback demand clusters: what requests that no skill serves have in common.

Every request that falls back to the base model is demand no skill covers yet. Their sentence
embeddings (already computed for routing) are grouped online by leader clustering: a request joins the
nearest cluster when its cosine to the cluster's centroid is at least `similarity`, else it starts a new
one. Counts decay with a half-life, so the clusters describe recent traffic; when `max_clusters` are
live, the one with the least recent weight is dropped to make room. Memory is bounded by
max_clusters × (one d-dim centroid + `examples` prompts of at most `example_chars` characters), whatever
the traffic. An operator reads it as "300 requests in the last hour look like one task no skill covers".
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class DemandSettings:
    enabled: bool = True
    max_clusters: int = 64
    # MiniLM cosine to a centroid at or above which a request joins that cluster: between a task's prompts' cosine
    # to their own centroid and to another task's
    similarity: float = 0.45
    examples: int = 3  # the most recent prompts kept per cluster
    example_chars: int = 300
    half_life_s: float = 3600.0  # counts halve every hour without new requests

    def __post_init__(self) -> None:
        if self.max_clusters < 1 or self.examples < 0 or self.example_chars < 1:
            raise ValueError("demand: max_clusters >= 1, examples >= 0, example_chars >= 1")
        if not -1 <= self.similarity <= 1 or self.half_life_s <= 0:
            raise ValueError("demand: similarity in [-1, 1], half_life_s > 0")


@dataclass
class _Cluster:
    centroid: np.ndarray  # unit vector: the normalized running sum of its members
    total: np.ndarray  # running sum of members (unnormalized), for the centroid
    weight: float  # decayed count at `updated`
    count: int  # every request it ever took
    updated: float
    examples: list[str] = field(default_factory=list)


class FallbackClusters:
    """Thread-safe online clusters of fallback requests' embeddings (see the module doc)."""

    def __init__(self, settings: DemandSettings | None = None, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings or DemandSettings()
        self._clock = clock
        self._clusters: list[_Cluster] = []
        self._lock = threading.Lock()
        self.observed = 0  # fallback requests seen in total

    def _decayed(self, c: _Cluster, now: float) -> float:
        return c.weight * math.pow(0.5, max(0.0, now - c.updated) / self.settings.half_life_s)

    def add(self, emb: np.ndarray, texts: Sequence[str]) -> None:
        """Record fallback requests: their unit embeddings (n, d) and prompts."""
        if not self.settings.enabled or not len(texts):
            return
        emb = np.asarray(emb, dtype=np.float32)
        if emb.ndim != 2 or len(emb) != len(texts):
            raise ValueError(f"expected one embedding row per text, got {emb.shape} for {len(texts)} texts")
        s = self.settings
        with self._lock:
            now = self._clock()
            for vec, text in zip(emb, texts):
                self.observed += 1
                best, sim = -1, -2.0
                if self._clusters:
                    sims = np.stack([c.centroid for c in self._clusters]) @ vec
                    best, sim = int(sims.argmax()), float(sims.max())
                if best >= 0 and sim >= s.similarity:
                    c = self._clusters[best]
                    c.weight, c.updated = self._decayed(c, now) + 1.0, now
                    c.total += vec
                    c.centroid = c.total / max(float(np.linalg.norm(c.total)), 1e-12)
                    c.count += 1
                    self._merge_into(best, now)
                else:
                    if len(self._clusters) >= s.max_clusters:  # make room: drop the least recent weight
                        self._clusters.pop(int(np.argmin([self._decayed(x, now) for x in self._clusters])))
                    c = _Cluster(vec.copy(), vec.copy(), 1.0, 1, now)
                    self._clusters.append(c)
                if s.examples:
                    c.examples = [*c.examples, text[: s.example_chars]][-s.examples :]

    def _merge_into(self, i: int, now: float) -> None:
        """A centroid that moved within `similarity` of another cluster's absorbs it (early leaders of one
        task, before its centroid settled, end up as one cluster)."""
        c = self._clusters[i]
        sims = np.array([x.centroid @ c.centroid if j != i else -2.0 for j, x in enumerate(self._clusters)])
        j = int(sims.argmax()) if len(sims) else -1
        if j < 0 or sims[j] < self.settings.similarity:
            return
        o = self._clusters[j]
        c.weight, c.updated = self._decayed(c, now) + self._decayed(o, now), now
        c.total += o.total
        c.centroid = c.total / max(float(np.linalg.norm(c.total)), 1e-12)
        c.count += o.count
        c.examples = [*o.examples, *c.examples][-self.settings.examples :] if self.settings.examples else []
        self._clusters.pop(j)

    def __len__(self) -> int:
        return len(self._clusters)

    def snapshot(
        self,
        nearest: Callable[[np.ndarray], list[list[tuple[str, float]]]] | None = None,
        min_weight: float = 0.0,
    ) -> list[dict[str, Any]]:
        """The live clusters, heaviest first: recent (decayed) size, total count, example prompts, and the
        skills nearest to each centroid (`nearest`: centroids (m, d) → [(skill, weight)] each)."""
        with self._lock:
            now = self._clock()
            rows = [(self._decayed(c, now), c) for c in self._clusters]
            rows = sorted((r for r in rows if r[0] >= min_weight), key=lambda r: -r[0])
            cents = np.stack([c.centroid for _, c in rows]) if rows else np.zeros((0, 0), np.float32)
            out = [
                {
                    "size": round(w, 3),
                    "count": c.count,
                    "last_seen": c.updated,
                    "examples": list(c.examples),
                }
                for w, c in rows
            ]
        if nearest is not None and len(out):
            for row, near in zip(out, nearest(cents)):
                row["nearest_skills"] = [{"skill": s, "weight": round(float(w), 4)} for s, w in near]
        return out
