"""A skill's router tensors from its training inputs: keys, thresholds, covariance, format and label models."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
import torch

from .dtkr import slot_scores, train_dtkr_keys
from .formats import fit_format
from .keys import calibrate_threshold, centroid_keys, fold_ids, held_out_best
from .needs import fit_fields, fit_labels
from .types import CENTROID, DTKR, RouterSettings


def skill_tensors(
    emb: np.ndarray,
    texts: Sequence[str] | None,
    inputs: Sequence[str] | None,
    answers: Sequence[str] | None,
    s: RouterSettings,
    check_stop: Callable[[], None] | None = None,
) -> dict[str, torch.Tensor]:
    """emb: the embeddings keys are fitted on (prompts, plus inputs without instruction when augmented);
    texts/inputs/answers: the prompts, inputs and answers the format and label models are fitted on.
    check_stop: called before each fit (every fold, every dtkr epoch); it raises to stop."""
    check = check_stop or _go_on

    def fit_c(x: np.ndarray) -> np.ndarray:
        check()
        return centroid_keys(x, s.n_keys)

    def fit_d(x: np.ndarray) -> torch.Tensor:
        return train_dtkr_keys(x, s.n_keys, s.dtkr, check)

    cent, dtkr = fit_c(emb), fit_d(emb)
    best_c = held_out_best(emb, fit_c, lambda x, k: (x @ k.T).max(axis=1), s.calibration_folds)
    fold_keys: list[torch.Tensor] = []  # dtkr keys fitted without each fold: the whitened gate's held-out scores
    best_d = held_out_best(
        emb, fit_d, lambda x, k: slot_scores(x, k, s.dtkr.groups).max(axis=1), s.calibration_folds, fold_keys
    )
    thr_c = calibrate_threshold(best_c, s.threshold_percentile, s.threshold_margin)
    thr_d = calibrate_threshold(best_d, s.threshold_percentile, s.threshold_margin)
    cov = np.cov(emb.T) if len(emb) > 1 else np.zeros((emb.shape[1], emb.shape[1]))
    calib = np.random.default_rng(0).permutation(len(emb))[: s.calibration_inputs]
    fold = fold_ids(len(emb), s.calibration_folds)
    held: dict[str, torch.Tensor] = {}
    if fold is not None and len(fold_keys) == s.calibration_folds:
        held = {
            "dtkr_fold_keys": torch.stack(fold_keys).half(),  # (folds, K, G, d/G)
            "calibration_folds": torch.from_numpy(fold[calib]),  # the fold each calibration input was held out of
        }
    check()
    fmt: dict[str, torch.Tensor] = {}
    if inputs is not None and s.format.source == "inputs":  # the fields a paraphrase keeps
        fmt = fit_format(inputs, replace(s.format, min_df=s.format.input_min_df)).tensors()
    elif texts is not None:
        fmt = fit_format(texts, s.format).tensors()
    check()
    if answers is not None and (lab := fit_labels(answers, inputs if inputs is not None else texts or [], s.labels)):
        fmt |= lab.tensors()
    if inputs is not None and s.format.source == "inputs":
        fmt |= fit_fields(inputs).tensors()
    return (
        fmt
        | held
        | {
            CENTROID: torch.from_numpy(cent),
            DTKR: dtkr,
            "input_cov": torch.from_numpy(cov.astype(np.float32)).half(),  # for the pooled whitening
            "input_count": torch.tensor([len(emb)]),
            "calibration_inputs": torch.from_numpy(emb[calib]).half(),
            "threshold": torch.tensor([thr_c], dtype=torch.float32),  # centroid mode
            "threshold_dtkr": torch.tensor([thr_d], dtype=torch.float32),
        }
    )


def _go_on() -> None:
    pass
