"""The router's settings, its decisions, what a batch is routed on, and the key-space helpers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from skillpool.lora.mix import Mix, format_pairs

from .demand import DemandSettings
from .dtkr import DTKRSettings
from .formats import FormatModel, FormatSettings
from .needs import FieldModel, LabelModel, LabelSettings
from .sapt import SAPTSettings

MODES = ("dtkr", "sapt", "centroid")
CENTROID, DTKR = "centroid_keys", "dtkr_keys"


@dataclass(frozen=True)
class RouterSettings:
    mode: str = "dtkr"
    n_keys: int = 8  # K: key slots per skill
    top_k: int = 8  # slots retrieved per request (over all skills)
    temperature: float = 0.02  # softmax temperature over slot scores: low, as whitened cosines are small
    min_weight: float = 0.05  # skills below this share are dropped and the rest renormalized
    # ... and so are skills below this fraction of the top skill's share (0: off, the JARe mix as is): against a
    # similar skill's small share diluting a clearly right one; off until a sequence shows it helps
    mix_keep_ratio: float = 0.0
    threshold_percentile: float = 2.0  # of the skill's own inputs' best score ...
    threshold_margin: float = 0.05  # ... minus this margin
    calibration_folds: int = 5  # those scores come from keys fitted on the other folds (not in-sample)
    # dtkr: input embeddings kept per skill (with the fold each was held out of, and the keys fitted without
    # each fold) to re-derive its whitened threshold from held-out scores whenever W changes. 300, not 64: the
    # 1st percentile of 64 scores is their minimum, too noisy for a per-skill threshold
    calibration_inputs: int = 300
    white_threshold_percentile: float = 1.0  # of those inputs' best held-out whitened score ...
    white_threshold_margin: float = 0.07  # ... minus this margin (its sweep: docs/design/decisions.md)
    # skills stored without fold keys (before held-out calibration): their calibration inputs' in-sample
    # scores (the keys saw them), hence a wider margin
    white_insample_margin: float = 0.15
    # fewer inputs: the raw held-out gate. W is estimated from the skills' own inputs, so with few of them the
    # calibration sample scores higher than new requests even against held-out keys
    white_gate_min_inputs: int = 256
    whiten: bool = True  # dtkr: score in the space whitened by the pooled within-skill covariance
    # Σ ← (1-λ) Σ + λ tr(Σ)/d I keeps W stable with few skills or samples; None: λ = d / (d + inputs seen)
    whiten_shrinkage: float | None = None
    dtkr: DTKRSettings = field(default_factory=DTKRSettings)
    sapt: SAPTSettings = field(default_factory=SAPTSettings)
    format: FormatSettings = field(default_factory=FormatSettings)
    labels: LabelSettings = field(default_factory=LabelSettings)
    # keys, thresholds and covariance also learn each training input without its instruction, so a request
    # that words the instruction differently (or leaves it out) still lies inside the skill's region
    augment_inputs: bool = True
    demand: DemandSettings = field(default_factory=DemandSettings)  # clusters of live fallback requests

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"router mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 0 <= self.mix_keep_ratio <= 1:
            raise ValueError(f"mix_keep_ratio must be in [0, 1], got {self.mix_keep_ratio}")
        if self.whiten_shrinkage is not None and not 0 <= self.whiten_shrinkage <= 1:
            raise ValueError(f"whiten_shrinkage must be in [0, 1], got {self.whiten_shrinkage}")


@dataclass(frozen=True)
class Decision:
    """Where one request goes. `route` is the mix as responses show it, heaviest first; `mix` is what runs."""

    route: list[tuple[str, float]]
    reason: str  # matched | forced | base | below_threshold | format_mismatch | no_skills
    score: float = 0.0  # best slot score of the request

    @property
    def mix(self) -> Mix:
        """The route as the engine runs it (its order kept as `Mix.ranked`; empty: the base model)."""
        return Mix.of(self.route)

    @property
    def confidence(self) -> float:
        return self.route[0][1] if self.route else 0.0

    def header(self) -> str:
        """The x-skillpool-route header: the route as listed, 'base' when empty."""
        return format_pairs(self.route)


@dataclass(frozen=True)
class Features:
    """What a batch of requests is routed on: sentence embeddings, pooled token embeddings for sapt, and
    each request's word-gram hashes for the format gate (None: not format-gated)."""

    emb: np.ndarray
    pooled: torch.Tensor | None = None
    grams: list[np.ndarray] | None = None
    options: list[np.ndarray] | None = None  # gram ids of each request's spelled-out option list (router.needs)

    @classmethod
    def concat(cls, parts: Sequence[Features]) -> Features:
        """One batch from several (pooled and grams only when every part has them)."""
        pooled = [p.pooled for p in parts if p.pooled is not None]
        grams: list[np.ndarray] = [g for p in parts for g in (p.grams or [])]
        options: list[np.ndarray] = [o for p in parts for o in (p.options or [])]
        return cls(
            np.concatenate([p.emb for p in parts]),
            torch.cat(pooled) if len(pooled) == len(parts) else None,
            grams if all(p.grams is not None for p in parts) else None,
            options if all(p.options is not None for p in parts) else None,
        )


@dataclass
class _SkillKeys:
    vectors: np.ndarray  # (K, D) unit rows in the gate's search space
    threshold: float
    raw: np.ndarray | None = None  # (K, D) dtkr keys before whitening
    cov: torch.Tensor | None = None  # (D, D) covariance of the skill's input embeddings
    count: int = 0  # how many inputs that covariance was measured on
    calib: np.ndarray | None = None  # (n, D) a sample of the skill's input embeddings (whitened gate)
    fmt: FormatModel | None = None  # the skill's format model (None: stored without one, not format-gated)
    labels: LabelModel | None = None  # the skill's label set (None: stored without one, or not a classifier)
    fields: FieldModel | None = None  # the input fields it has seen (None: stored without)
    calib_folds: np.ndarray | None = None  # (n,) the fold each of those was held out of (None: in-sample only)
    fold_raw: np.ndarray | None = None  # (folds, K, D) dtkr keys fitted without each fold, before whitening


def whitening(cov: np.ndarray, shrinkage: float) -> np.ndarray:
    """W = Σ^-½ of the shrunk covariance (symmetric, so queries and keys map the same way)."""
    d = cov.shape[0]
    s = (1 - shrinkage) * cov + shrinkage * np.trace(cov) / d * np.eye(d)
    w, v = np.linalg.eigh(s)
    return ((v / np.sqrt(np.maximum(w, 1e-12))) @ v.T).astype(np.float32)


def _rows(x: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.numpy(), dtype=np.float32)


def _flat_groups(sub: torch.Tensor) -> np.ndarray:
    """(n, G, d/G) unit chunks → (n, d) rows scaled by 1/sqrt(G).

    Both sides scaled so: <flat(q), flat(k)> = mean_g cos(q_g, k_g), and one inner-product search
    over these rows is the exact DTKR slot score.
    """
    return _rows(sub.reshape(len(sub), -1) / np.sqrt(sub.shape[1]))
