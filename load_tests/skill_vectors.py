"""Skill vectors for the placement benchmarks: where rank neighbours are near, as the router's mixed skills are near
in its embedding space, and the groups the server's --affinity-group-size makes of them."""

from __future__ import annotations

from functools import cache

import numpy as np


def directions(skills: int, dim: int = 32, seed: int = 0) -> np.ndarray:
    """Unit vectors on a smooth curve (rank i at angles w_j * i, dim / 2 frequencies): neighbours by rank are near,
    as skills that the router mixes are near in its embedding space."""
    rng = np.random.default_rng(seed)
    freq = 2 * np.pi * (0.2 + 0.8 * rng.random(dim // 2)) / 100
    angle = np.arange(skills, dtype=np.float64)[:, None] * freq[None, :]
    return (np.concatenate([np.cos(angle), np.sin(angle)], axis=1) / np.sqrt(dim // 2)).astype(np.float32)


@cache  # one grouping per pool, shared by every replica count and policy run
def group_keys(skills: int, size: int) -> tuple[int, ...]:
    """Each rank's group as the server computes it from `directions`, as a negative id (never a skill's own)."""
    from skillpool.server.cluster.groups import SkillGroups

    groups, vectors = SkillGroups(size), directions(skills)
    for rank in range(skills):
        groups.add(str(rank), vectors[rank : rank + 1])
    ids: dict[str | None, int] = {}
    return tuple(-1 - ids.setdefault(groups.key(str(rank)), len(ids)) for rank in range(skills))
