"""The placement benchmarks' skill vectors: unit vectors, near by rank and not far apart, and the server's
grouping of them, the same on every call."""

from __future__ import annotations

import numpy as np

from load_tests.placement.skill_vectors import directions as skill_directions
from load_tests.placement.skill_vectors import group_keys


def test_skill_directions_are_unit_vectors_near_by_rank() -> None:
    d = skill_directions(200)
    assert np.allclose(np.linalg.norm(d, axis=1), 1.0, atol=1e-5)
    cos = float((d[:-10] * d[10:]).sum(axis=1).mean()), float((d[:-60] * d[60:]).sum(axis=1).mean())
    assert cos[0] > 0.7 and cos[1] < 0.3


def test_group_keys_are_one_negative_id_per_group_and_built_once() -> None:
    keys = group_keys(200, 16)
    assert len(keys) == 200 and max(keys) < 0 and len(set(keys)) == 13  # ceil(200 / 16) groups
    assert group_keys(200, 16) is keys  # one grouping per pool, shared by every simulation run
