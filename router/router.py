"""The router: one decision per request, `[(skill, weight)]` + confidence + reason.

Keys of all skills live in one FAISS inner-product index over unit vectors (cosine). A request
takes the top-k key slots over all skills; a temperature softmax over their scores, summed per
skill, gives the mix (JARe). If the best score is below the best skill's calibrated threshold the
request goes to the base model and counts as a fallback.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import faiss
import numpy as np
import torch

from .embedder import Embedder
from .keys import calibrate_threshold, centroid_keys

KEYS = "centroid_keys"


@dataclass(frozen=True)
class RouterSettings:
    n_keys: int = 8  # keys per skill
    top_k: int = 8  # key slots retrieved per request
    temperature: float = 0.05  # softmax temperature over cosine scores
    min_weight: float = 0.05  # skills below this share are dropped and the rest renormalized
    threshold_percentile: float = 2.0
    threshold_margin: float = 0.05


@dataclass(frozen=True)
class Decision:
    route: list[tuple[str, float]]
    reason: str  # matched | forced | base | below_threshold | no_skills
    score: float = 0.0  # best cosine score among the retrieved keys

    @property
    def confidence(self) -> float:
        return self.route[0][1] if self.route else 0.0

    def header(self) -> str:
        return ",".join(f"{s}={w:.2f}" for s, w in self.route) if self.route else "base"


@dataclass
class _SkillKeys:
    keys: np.ndarray  # (K, d) unit rows
    threshold: float


@dataclass
class Router:
    embedder: Embedder
    settings: RouterSettings = field(default_factory=RouterSettings)

    def __post_init__(self) -> None:
        self._skills: dict[str, _SkillKeys] = {}
        self._lock = threading.RLock()
        self._rebuild()

    # --- keys ---------------------------------------------------------------------------------
    def prepare_keys(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Build a skill's router tensors from its training inputs (stored by adapters_store)."""
        emb = self.embedder.embed(texts)
        keys = centroid_keys(emb, self.settings.n_keys)
        thr = calibrate_threshold(emb, keys, self.settings.threshold_percentile, self.settings.threshold_margin)
        return {KEYS: torch.from_numpy(keys), "threshold": torch.tensor([thr], dtype=torch.float32)}

    def add_skill(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        keys = tensors[KEYS].float().numpy()
        with self._lock:
            self._skills[name] = _SkillKeys(keys=np.ascontiguousarray(keys), threshold=float(tensors["threshold"][0]))
            self._rebuild()

    def remove_skill(self, name: str) -> None:
        with self._lock:
            if self._skills.pop(name, None) is not None:
                self._rebuild()

    @property
    def skills(self) -> list[str]:
        return list(self._skills)

    def _rebuild(self) -> None:
        index = faiss.IndexFlatIP(self.embedder.dim)
        owners: list[str] = []
        for name, sk in self._skills.items():
            index.add(sk.keys)
            owners.extend([name] * len(sk.keys))
        self._index, self._owners = index, owners

    # --- routing ------------------------------------------------------------------------------
    def route(self, texts: Sequence[str]) -> list[Decision]:
        """One decision per text; all texts are embedded in one batch."""
        if not texts:
            return []
        with self._lock:
            index, owners, skills = self._index, self._owners, dict(self._skills)
        if not owners:
            return [Decision(route=[], reason="no_skills") for _ in texts]
        emb = self.embedder.embed(texts)
        k = min(self.settings.top_k, len(owners))
        scores, ids = index.search(emb, k)
        return [self._decide(scores[i], ids[i], owners, skills) for i in range(len(texts))]

    def _decide(self, scores: np.ndarray, ids: np.ndarray, owners: list[str], skills: dict[str, _SkillKeys]) -> Decision:
        best_skill, best = owners[ids[0]], float(scores[0])
        if best < skills[best_skill].threshold:
            return Decision(route=[], reason="below_threshold", score=best)
        logits = (scores - scores.max()) / self.settings.temperature
        p = np.exp(logits)
        p /= p.sum()
        per_skill: dict[str, float] = {}
        for j, w in zip(ids, p):
            per_skill[owners[j]] = per_skill.get(owners[j], 0.0) + float(w)
        kept = {s: w for s, w in per_skill.items() if w >= self.settings.min_weight}
        total = sum(kept.values())
        route = sorted(((s, w / total) for s, w in kept.items()), key=lambda sw: -sw[1])
        return Decision(route=route, reason="matched", score=best)
