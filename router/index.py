"""The key index: every skill's keys in the mode's search space, the FAISS indexes over them, and dtkr's
whitening with the whitened gate thresholds it implies.

An index is built whole from the registered skills (build_index) and swapped in under the router's lock,
so a route running concurrently keeps searching the one it started with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np
import torch

from .dtkr import split_groups
from .keys import calibrate_threshold
from .modes import RouterMode
from .needs import LabelIndex
from .types import _flat_groups, _SkillKeys, whitening


@dataclass(frozen=True)
class KeyIndex:
    index: faiss.Index  # gate (and, unwhitened, the mix): raw key rows
    owners: list[str]  # the skill of every row
    mix_index: faiss.Index | None  # whitened dtkr keys
    white: np.ndarray | None  # W (None: not whitened, or no skills)
    white_thr: dict[str, float]  # whitened gate thresholds, re-derived with W
    labels: LabelIndex | None
    known_fields: np.ndarray  # the typical input fields of all skills (router.needs)


_gpu: list[Any] = []  # faiss.StandardGpuResources, created once on first use (it holds scratch memory)


def on_device(index: faiss.Index) -> faiss.Index:
    """The index on the GPU when faiss was built with GPU support and sees one (faiss-gpu on a CUDA machine,
    what `setup.sh --engine vllm` installs there); otherwise the CPU index itself. Flat inner-product search
    gives the same results either way."""
    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() < 1:
        return index
    if not _gpu:
        _gpu.append(faiss.StandardGpuResources())
    return faiss.index_cpu_to_gpu(_gpu[0], 0, index)


def white_rows(x: np.ndarray, w: np.ndarray, groups: int) -> np.ndarray:
    return _flat_groups(split_groups(torch.from_numpy(np.ascontiguousarray(x @ w, dtype=np.float32)), groups))


def held_out_white_best(
    calib: np.ndarray, folds: np.ndarray, fold_raw: np.ndarray, white: np.ndarray, groups: int
) -> np.ndarray:
    """Each calibration input's best whitened score against the keys fitted without its fold: what a new
    request of the skill scores, where in-sample scores (keys fitted to those very inputs) run higher."""
    n_folds, k, d = fold_raw.shape
    keys = white_rows(fold_raw.reshape(n_folds * k, d), white, groups)  # all folds' keys in one pass
    scores = (white_rows(calib, white, groups) @ keys.T).reshape(len(calib), n_folds, k)
    return scores[np.arange(len(calib)), folds].max(axis=1)


def build_index(skills: Mapping[str, _SkillKeys], dim: int, mode: RouterMode) -> KeyIndex:
    """New indexes from all skills' keys (in the mode's search space)."""
    settings = mode.settings
    index = faiss.IndexFlatIP(dim)
    owners: list[str] = []
    for name, sk in skills.items():
        index.add(sk.vectors)
        owners.extend([name] * len(sk.vectors))
    mix_index, white, white_thr = None, None, {}
    if mode.whitened and skills:
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
            if sk.calib is None or not len(sk.calib) or sk.count < s.white_gate_min_inputs:
                continue  # W's covariance was partly fitted on these inputs: too few, and they score too high
            if sk.fold_raw is not None and sk.calib_folds is not None:
                best = held_out_white_best(sk.calib, sk.calib_folds, sk.fold_raw, white, g)
                white_thr[name] = calibrate_threshold(best, s.white_threshold_percentile, s.white_threshold_margin)
            else:  # stored without fold keys: in-sample scores, a wider margin
                best = (white_rows(sk.calib, white, g) @ keys.T).max(axis=1)
                white_thr[name] = calibrate_threshold(best, s.white_threshold_percentile, s.white_insample_margin)
    lab = {n: sk.labels for n, sk in skills.items() if sk.labels is not None}
    labels = LabelIndex(lab, settings.labels.min_foreign) if settings.labels.min_foreign else None
    typical = [sk.fields.typical for sk in skills.values() if sk.fields is not None]
    known_fields = np.unique(np.concatenate(typical)) if typical else np.zeros(0, np.int64)
    placed = on_device(mix_index) if mix_index is not None else None
    return KeyIndex(on_device(index), owners, placed, white, white_thr, labels, known_fields)
