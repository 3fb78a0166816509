"""The key index: every skill's keys in the mode's search space, the FAISS indexes over them, and dtkr's
whitening with the whitened gate thresholds it implies.

An index is built whole from the registered skills (build_index) and swapped in under the router's lock,
so a route running concurrently keeps searching the one it started with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import faiss
import numpy as np
import torch

from .dtkr import split_groups
from .formats import FormatModel
from .keys import calibrate_threshold
from .needs import FieldModel, LabelIndex, LabelModel
from .types import CENTROID, DTKR, RouterSettings, _flat_groups, _rows, _SkillKeys, whitening


@dataclass(frozen=True)
class KeyIndex:
    index: faiss.Index  # gate (and, unwhitened, the mix): raw key rows
    owners: list[str]  # the skill of every row
    mix_index: faiss.Index | None  # whitened dtkr keys
    white: np.ndarray | None  # W (None: not whitened, or no skills)
    white_thr: dict[str, float]  # whitened gate thresholds, re-derived with W
    labels: LabelIndex | None
    known_fields: np.ndarray  # the typical input fields of all skills (router.needs)


def search_keys(tensors: dict[str, torch.Tensor], settings: RouterSettings) -> _SkillKeys:
    """The skill's keys as unit rows of the mode's search space (inner product = slot score)."""
    fmt, labels = FormatModel.from_tensors(tensors), LabelModel.from_tensors(tensors)
    fields = FieldModel.from_tensors(tensors)
    if settings.mode in ("centroid", "sapt"):
        return _SkillKeys(
            _rows(tensors[CENTROID].float()), float(tensors["threshold"][0]), fmt=fmt, labels=labels, fields=fields
        )
    g = settings.dtkr.groups
    if DTKR in tensors:
        sub, thr = tensors[DTKR].float(), float(tensors["threshold_dtkr"][0])
        if sub.shape[1] != g:
            raise ValueError(f"skill keys have {sub.shape[1]} groups, the router is set to {g}")
    else:  # a skill stored without DTKR keys: its centroids as sub-keys
        sub, thr = split_groups(tensors[CENTROID].float(), g), float(tensors["threshold"][0])
    cov = tensors.get("input_cov")  # kept in half precision: ~0.3 MB a skill
    count = int(tensors["input_count"][0]) if "input_count" in tensors else 0
    calib = _rows(tensors["calibration_inputs"].float()) if "calibration_inputs" in tensors else None
    return _SkillKeys(_flat_groups(sub), thr, _rows(sub.reshape(len(sub), -1)), cov, count, calib, fmt, labels, fields)


def white_rows(x: np.ndarray, w: np.ndarray, groups: int) -> np.ndarray:
    return _flat_groups(split_groups(torch.from_numpy(np.ascontiguousarray(x @ w, dtype=np.float32)), groups))


def query_vectors(emb: np.ndarray, settings: RouterSettings) -> np.ndarray:
    if settings.mode in ("centroid", "sapt"):
        return emb
    return _flat_groups(split_groups(torch.from_numpy(emb), settings.dtkr.groups))


def build_index(skills: Mapping[str, _SkillKeys], dim: int, settings: RouterSettings) -> KeyIndex:
    """New indexes from all skills' keys."""
    index = faiss.IndexFlatIP(dim)
    owners: list[str] = []
    for name, sk in skills.items():
        index.add(sk.vectors)
        owners.extend([name] * len(sk.vectors))
    mix_index, white, white_thr = None, None, {}
    if settings.mode == "dtkr" and settings.whiten and skills:
        d, n, m, total = dim, 0, 0, torch.zeros(dim, dim, dtype=torch.float64)
        for sk in skills.values():
            if sk.cov is not None:  # a running sum: no (skills, d, d) stack at 1,000 skills
                total += sk.cov.double()
                n, m = n + sk.count, m + 1
        lam = settings.whiten_shrinkage if settings.whiten_shrinkage is not None else d / (d + n)
        white = whitening((total / m).numpy(), lam) if m else np.eye(d, dtype=np.float32)
        mix_index = faiss.IndexFlatIP(dim)
        s, g = settings, settings.dtkr.groups
        for name, sk in skills.items():
            assert sk.raw is not None
            keys = white_rows(sk.raw, white, g)
            mix_index.add(keys)
            if sk.calib is not None and len(sk.calib) and sk.count >= s.white_gate_min_inputs:
                best = (white_rows(sk.calib, white, g) @ keys.T).max(axis=1)
                white_thr[name] = calibrate_threshold(best, s.white_threshold_percentile, s.white_threshold_margin)
    lab = {n: sk.labels for n, sk in skills.items() if sk.labels is not None}
    labels = LabelIndex(lab, settings.labels.min_foreign) if settings.labels.min_foreign else None
    typical = [sk.fields.typical for sk in skills.values() if sk.fields is not None]
    known_fields = np.unique(np.concatenate(typical)) if typical else np.zeros(0, np.int64)
    return KeyIndex(index, owners, mix_index, white, white_thr, labels, known_fields)
