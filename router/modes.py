"""The router modes as classes behind one interface, chosen once from RouterSettings.mode (mode_for).

A mode decides how a skill's stored tensors become search keys, how a query maps into that key space,
whether that space is whitened, and whether routing learns a SAPT query projector over the base model's
token embeddings. The index, the gates and the mix ask the mode instead of comparing its name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import numpy as np
import torch

from .dtkr import split_groups
from .formats import FormatModel
from .needs import FieldModel, LabelModel
from .types import CENTROID, DTKR, MODES, RouterSettings, _flat_groups, _rows, _SkillKeys


class RouterMode(ABC):
    name: ClassVar[str]
    # sapt: a TokenPooler feeds a learned query projector whose attention is the mix (router.sapt)
    learns_projector: ClassVar[bool] = False

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings

    @property
    def whitened(self) -> bool:
        """Whether queries and keys are scored in the whitened space (router.index builds W)."""
        return False

    @abstractmethod
    def search_keys(self, tensors: dict[str, torch.Tensor]) -> _SkillKeys:
        """The skill's keys as unit rows of the mode's search space (inner product = slot score)."""

    @abstractmethod
    def query_vectors(self, emb: np.ndarray) -> np.ndarray:
        """Request embeddings as rows of the same space."""


def _labels_fields(tensors: dict[str, torch.Tensor]) -> tuple[FormatModel | None, LabelModel | None, FieldModel | None]:
    return FormatModel.from_tensors(tensors), LabelModel.from_tensors(tensors), FieldModel.from_tensors(tensors)


class CentroidMode(RouterMode):
    """Nearest k-means centroid of the skill's input embeddings (the baseline)."""

    name = "centroid"

    def search_keys(self, tensors: dict[str, torch.Tensor]) -> _SkillKeys:
        fmt, labels, fields = _labels_fields(tensors)
        return _SkillKeys(
            _rows(tensors[CENTROID].float()), float(tensors["threshold"][0]), fmt=fmt, labels=labels, fields=fields
        )

    def query_vectors(self, emb: np.ndarray) -> np.ndarray:
        return emb


class SAPTMode(CentroidMode):
    """The centroid keys are the open-set gate (SAPT's softmax has no "none of these"); the mix is the
    attention of the query projector learned over the base model's token embeddings."""

    name = "sapt"
    learns_projector = True


class DTKRMode(RouterMode):
    """Grouped sub-keys trained per skill; slot score = mean over groups of chunk cosines, whitened."""

    name = "dtkr"

    @property
    def whitened(self) -> bool:
        return self.settings.whiten

    def search_keys(self, tensors: dict[str, torch.Tensor]) -> _SkillKeys:
        fmt, labels, fields = _labels_fields(tensors)
        g = self.settings.dtkr.groups
        if DTKR in tensors:
            sub, thr = tensors[DTKR].float(), float(tensors["threshold_dtkr"][0])
            if sub.shape[1] != g:
                raise ValueError(f"skill keys have {sub.shape[1]} groups, the router is set to {g}")
        else:  # a skill stored without DTKR keys: its centroids as sub-keys
            sub, thr = split_groups(tensors[CENTROID].float(), g), float(tensors["threshold"][0])
        cov = tensors.get("input_cov")  # kept in half precision: ~0.3 MB a skill
        count = int(tensors["input_count"][0]) if "input_count" in tensors else 0
        calib = _rows(tensors["calibration_inputs"].float()) if "calibration_inputs" in tensors else None
        folds, fold_raw = tensors.get("calibration_folds"), tensors.get("dtkr_fold_keys")
        if folds is not None and fold_raw is not None and calib is not None:  # held-out whitened calibration
            if fold_raw.shape[2] != g or len(folds) != len(calib):
                raise ValueError("skill fold keys do not match its calibration inputs or the router's groups")
            fold_ids = folds.numpy().astype(np.int64)
            fold_rows = np.ascontiguousarray(fold_raw.float().reshape(*fold_raw.shape[:2], -1).numpy())
        else:
            fold_ids, fold_rows = None, None
        return _SkillKeys(
            _flat_groups(sub),
            thr,
            _rows(sub.reshape(len(sub), -1)),
            cov,
            count,
            calib,
            fmt,
            labels,
            fields,
            fold_ids,
            fold_rows,
        )

    def query_vectors(self, emb: np.ndarray) -> np.ndarray:
        return _flat_groups(split_groups(torch.from_numpy(emb), self.settings.dtkr.groups))


MODE_CLASSES: dict[str, type[RouterMode]] = {m.name: m for m in (DTKRMode, SAPTMode, CentroidMode)}
assert tuple(MODE_CLASSES) == MODES, "every name in MODES needs its class here"


def mode_class(name: str) -> type[RouterMode]:
    """The class of a mode name, for what must be decided before a Router exists (e.g. load a TokenPooler)."""
    return MODE_CLASSES[name]


def mode_for(settings: RouterSettings) -> RouterMode:
    return MODE_CLASSES[settings.mode](settings)
