"""Neighbourhoods of related skills: the placement key of a mix at the ingress with `--affinity-group-size W`.

A mix's skills all match the request the router mixed them for, so they lie near each other in the router's
embedding space. Keying requests by the heaviest skill's neighbourhood rather than by the skill sends a mix's
other skills to the replica that already holds its neighbours, so a replica's adapter tiers fill with one region
of the pool instead of copies of the whole tail: fewer store fetches at the same balance (load_tests/
bench_placement.py and bench_ray_placement.py; their figures are in docs/benchmarks.md and docs/scale-out.md).

The groups: of the n skills with a vector, the ceil(n / W) whose names hash lowest lead one each, and every skill
joins the leader nearest its mean input embedding (cosine). They depend on the pool alone, not on the order skills
arrived in, so every ingress computes the same keys; a new skill that does not lead moves no other skill, and one
that does takes only the skills nearer to it than to their leader.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading

import numpy as np

from skillpool.adapters_store.store import SkillRecord
from skillpool.router.types import CENTROID

log = logging.getLogger(__name__)
PREFIX = "group:"  # a group's multiplexed key: never a skill's own (`name#vN`), which the replicas preload


def _rank(name: str) -> bytes:
    """A hash of the name that is the same in every process (Python's `hash` is salted per process)."""
    return hashlib.blake2b(name.encode(), digest_size=8).digest()


def unit_vector(rows: np.ndarray) -> np.ndarray | None:
    """A skill's direction: the mean of its key rows, normalised; None when it has none (empty, zero, not finite)."""
    rows = np.asarray(rows, dtype=np.float64)
    if rows.ndim == 1:
        rows = rows[None, :]
    if rows.ndim != 2 or rows.size == 0 or not np.isfinite(rows).all():
        return None
    mean = rows.mean(axis=0)
    norm = float(np.linalg.norm(mean))
    return (mean / norm).astype(np.float32) if norm > 0 else None


class SkillGroups:
    """The group key of each skill, recomputed on the first lookup after the pool changed. Thread-safe."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"a group holds at least one skill, not {size}")
        self.size = size
        self._vectors: dict[str, np.ndarray] = {}
        self._keys: dict[str, str] | None = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._vectors)

    def add(self, name: str, rows: np.ndarray) -> bool:
        """Place (or move) a skill by its key rows; False when they give no direction (it keeps no group)."""
        vector = unit_vector(rows)
        with self._lock:
            if vector is None:
                found = self._vectors.pop(name, None) is not None
            else:
                self._vectors[name], found = vector, True
            if found:
                self._keys = None
        return vector is not None

    def add_record(self, rec: SkillRecord) -> bool:
        """Place a stored skill version by its router's centroid keys (its input embeddings); one without them
        keeps its own key."""
        try:
            rows = rec.router_tensors()[CENTROID].float().numpy()
        except Exception as e:  # a placement hint: never a reason to refuse the skill
            log.warning("skill %s v%d keeps its own placement key: %s", rec.name, rec.version, e)
            self.remove(rec.name)
            return False
        return self.add(rec.name, rows)

    def remove(self, name: str) -> None:
        with self._lock:
            if self._vectors.pop(name, None) is not None:
                self._keys = None

    def key(self, name: str) -> str | None:
        """`group:<leader>` for a placed skill, None for one without a vector."""
        with self._lock:
            return self._current().get(name)

    def groups(self) -> dict[str, list[str]]:
        """Each leader's members, sorted (for docs and tests)."""
        with self._lock:
            out: dict[str, list[str]] = {}
            for name, key in sorted(self._current().items()):
                out.setdefault(key[len(PREFIX) :], []).append(name)
            return out

    def _current(self) -> dict[str, str]:
        """Every placed skill's key, recomputed after a change (the caller holds the lock)."""
        if self._keys is None:
            self._keys = self._assign()
        return self._keys

    def _assign(self) -> dict[str, str]:
        if not self._vectors:
            return {}
        names = sorted(self._vectors)
        leaders = sorted(names, key=lambda n: (_rank(n), n))[: math.ceil(len(names) / self.size)]
        if len(leaders) == len(names):
            return {n: PREFIX + n for n in names}
        led = np.stack([self._vectors[n] for n in leaders])
        near = np.stack([self._vectors[n] for n in names]) @ led.T  # cosine: unit rows
        pick = near.argmax(axis=1)  # ties go to the lower hash, the same in every process
        return {n: PREFIX + leaders[int(i)] for n, i in zip(names, pick)}
