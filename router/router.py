"""The router: one decision per request, `[(skill, weight)]` + score + reason.

Modes (a server setting; every skill stores the tensors of all key-based modes, so switching is free):
  dtkr      grouped sub-keys trained per skill (SLM); slot score = mean over groups of chunk cosines
  centroid  nearest k-means centroid of the skill's input embeddings (the baseline)
  sapt      a learned query projector over the base model's token embeddings (router.sapt)
For dtkr and centroid, all skills' keys live in one FAISS inner-product index over unit vectors. A
request takes the top-k slots over all skills; a temperature softmax over their scores, summed per
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

from .dtkr import DTKRSettings, slot_scores, split_groups, train_dtkr_keys
from .embedder import Embedder
from .keys import calibrate_threshold, centroid_keys

MODES = ("dtkr", "centroid")
CENTROID, DTKR = "centroid_keys", "dtkr_keys"


@dataclass(frozen=True)
class RouterSettings:
    mode: str = "centroid"  # dtkr stays opt-in until its thresholds are tuned (issue 3)
    n_keys: int = 8  # K: key slots per skill
    top_k: int = 8  # slots retrieved per request (over all skills)
    temperature: float = 0.05  # softmax temperature over slot scores
    min_weight: float = 0.05  # skills below this share are dropped and the rest renormalized
    threshold_percentile: float = 2.0  # of the skill's own inputs' best score ...
    threshold_margin: float = 0.05  # ... minus this margin
    dtkr: DTKRSettings = field(default_factory=DTKRSettings)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"router mode must be one of {', '.join(MODES)}, got {self.mode!r}")


@dataclass(frozen=True)
class Decision:
    route: list[tuple[str, float]]
    reason: str  # matched | forced | base | below_threshold | no_skills
    score: float = 0.0  # best slot score of the request

    @property
    def confidence(self) -> float:
        return self.route[0][1] if self.route else 0.0

    def header(self) -> str:
        return ",".join(f"{s}={w:.2f}" for s, w in self.route) if self.route else "base"


@dataclass
class _SkillKeys:
    vectors: np.ndarray  # (K, D) unit rows in the mode's search space
    threshold: float


def _rows(x: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(x.numpy(), dtype=np.float32)


def _flat_groups(sub: torch.Tensor) -> np.ndarray:
    """(n, G, d/G) unit chunks → (n, d) rows scaled by 1/sqrt(G).

    Both sides scaled so: <flat(q), flat(k)> = mean_g cos(q_g, k_g), and one inner-product search
    over these rows is the exact DTKR slot score.
    """
    return _rows(sub.reshape(len(sub), -1) / np.sqrt(sub.shape[1]))


@dataclass
class Router:
    embedder: Embedder
    settings: RouterSettings = field(default_factory=RouterSettings)

    def __post_init__(self) -> None:
        self._index: faiss.Index
        self._owners: list[str]
        self._skills: dict[str, _SkillKeys] = {}
        self._lock = threading.RLock()
        self._rebuild()

    # --- keys ---------------------------------------------------------------------------------
    def prepare_keys(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """A skill's router tensors from its training inputs: keys and thresholds for every mode."""
        return self.prepare_keys_from_embeddings(self.embedder.embed(texts))

    def prepare_keys_from_embeddings(self, emb: np.ndarray) -> dict[str, torch.Tensor]:
        s = self.settings
        cent = centroid_keys(emb, s.n_keys)
        dtkr = train_dtkr_keys(emb, s.n_keys, s.dtkr)
        thr_c = calibrate_threshold(emb, cent, s.threshold_percentile, s.threshold_margin)
        best_d = slot_scores(emb, dtkr, s.dtkr.groups).max(axis=1)
        thr_d = float(np.percentile(best_d, s.threshold_percentile) - s.threshold_margin)
        return {
            CENTROID: torch.from_numpy(cent),
            DTKR: dtkr,
            "threshold": torch.tensor([thr_c], dtype=torch.float32),  # centroid mode
            "threshold_dtkr": torch.tensor([thr_d], dtype=torch.float32),
        }

    def _search_keys(self, tensors: dict[str, torch.Tensor]) -> _SkillKeys:
        """The skill's keys as unit rows of the mode's search space (inner product = slot score)."""
        if self.settings.mode == "centroid":
            return _SkillKeys(_rows(tensors[CENTROID].float()), float(tensors["threshold"][0]))
        g = self.settings.dtkr.groups
        if DTKR in tensors:
            sub, thr = tensors[DTKR].float(), float(tensors["threshold_dtkr"][0])
            if sub.shape[1] != g:
                raise ValueError(f"skill keys have {sub.shape[1]} groups, the router is set to {g}")
        else:  # a skill stored without DTKR keys: its centroids as sub-keys
            sub, thr = split_groups(tensors[CENTROID].float(), g), float(tensors["threshold"][0])
        return _SkillKeys(_flat_groups(sub), thr)

    def _query_vectors(self, emb: np.ndarray) -> np.ndarray:
        if self.settings.mode == "centroid":
            return emb
        return _flat_groups(split_groups(torch.from_numpy(emb), self.settings.dtkr.groups))

    def add_skill(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        sk = self._search_keys(tensors)
        with self._lock:
            replacing = name in self._skills
            self._skills[name] = sk
            if replacing:
                self._rebuild()
            else:  # append to fresh copies: a concurrent route() keeps using the old pair
                index = faiss.clone_index(self._index)
                index.add(sk.vectors)
                self._index, self._owners = index, [*self._owners, *([name] * len(sk.vectors))]

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
            index.add(sk.vectors)
            owners.extend([name] * len(sk.vectors))
        self._index, self._owners = index, owners

    # --- routing ------------------------------------------------------------------------------
    def route(self, texts: Sequence[str]) -> list[Decision]:
        """One decision per text; all texts are embedded in one batch."""
        if not texts:
            return []
        return self.route_embeddings(self.embedder.embed(texts))

    def route_embeddings(self, emb: np.ndarray) -> list[Decision]:
        with self._lock:
            index, owners, skills = self._index, self._owners, dict(self._skills)
        if not owners:
            return [Decision(route=[], reason="no_skills") for _ in range(len(emb))]
        k = min(self.settings.top_k, len(owners))
        scores, ids = index.search(self._query_vectors(np.ascontiguousarray(emb, dtype=np.float32)), k)
        return [self._decide(scores[i], ids[i], owners, skills) for i in range(len(emb))]

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
