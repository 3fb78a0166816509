"""The format gate: does a request carry the constant parts of the prompts a skill was trained on?

Input similarity cannot tell apart two tasks whose inputs look alike: an unseen task that shares an
instruction template's words and a seen sibling's domain (yelp after amazon, rte after mnli) scores
as high as the sibling's own inputs. What does tell them apart is the prompt's fixed text: the
instruction, its label options, the field names ("Title:", "sentence 1:"). A skill answers in the
format it was trained on, so a request without that text asks for something the skill never saw
(imdb's "Option: Good, Bad" sent to amazon's five-star skill gets a star label back).

Model, per skill: every lower-cased word unigram and bigram (punctuation is a word) that at least
`min_df` of the skill's inputs contain, each an independent Bernoulli with presence probability p
(Jeffreys-smoothed). A request's score is the log-likelihood ratio of its presence pattern against
"every gram present": each missing gram costs log(p / (1 - p)), about 6.4 nats for a gram that all of
300 inputs contain, and grams the request adds cost nothing. The threshold is a low percentile of the
skill's own held-out scores (k folds, the model fitted on the other folds) minus a margin, so a skill
whose inputs share no fixed text (free chat) gets no gram above `min_df` and a gate that passes all.

Grams are stored as 64-bit hashes (safetensors holds tensors, not strings).
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

_WORD = re.compile(r"\w+|[^\w\s]")


@dataclass(frozen=True)
class FormatSettings:
    enabled: bool = True
    min_df: float = 0.5  # a gram is part of the skill's format if at least this share of its inputs contain it
    max_grams: int = 256  # the most frequent ones are kept
    percentile: float = 1.0  # of the skill's held-out scores ...
    margin: float = 2.0  # ... minus this many nats (less than one missing near-universal gram)
    folds: int = 5
    min_inputs: int = 20  # fewer inputs: presence rates are too coarse to model, no gate
    candidates: int = 32  # a request's top slots whose owners are checked (bounded cost with 1,000 skills)
    # inputs: fitted on the skill's inputs without the instruction (field names: what a paraphrase keeps);
    # prompts: on whole training prompts, instruction included (only the uploaded wording passes)
    source: str = "inputs"
    # min_df for the inputs fit: only near-universal grams (the fields). Free text makes common words ("the",
    # ".") frequent, and a lower min_df lets them set a threshold so low that a look-alike without the fields passes
    input_min_df: float = 0.95

    def __post_init__(self) -> None:
        if not 0 < self.min_df <= 1:
            raise ValueError(f"format min_df must be in (0, 1], got {self.min_df}")
        if self.max_grams < 1 or self.folds < 2 or self.candidates < 1:
            raise ValueError("format max_grams and candidates must be >= 1, folds >= 2")
        if self.source not in ("inputs", "prompts"):
            raise ValueError(f"format source must be inputs or prompts, got {self.source!r}")


def gram_ids(text: str) -> np.ndarray:
    """Sorted unique 64-bit hashes of the text's lower-cased word unigrams and bigrams."""
    words = _WORD.findall(text.lower())
    grams = {*words, *(f"{a} {b}" for a, b in itertools.pairwise(words))}
    if not grams:
        return np.zeros(0, dtype=np.int64)
    raw = b"".join(hashlib.blake2b(g.encode(), digest_size=8).digest() for g in grams)
    return np.unique(np.frombuffer(raw, dtype="<i8"))


@dataclass(frozen=True)
class FormatModel:
    grams: np.ndarray  # (m,) int64 hashes
    log_odds: np.ndarray  # (m,) log(p / (1 - p)): what a request missing the gram loses
    threshold: float  # -inf: no gate

    def scores(self, requests: Sequence[np.ndarray]) -> np.ndarray:
        """0 when every format gram is present, minus the log-odds of each missing one."""
        if not len(self.grams):
            return np.zeros(len(requests), dtype=np.float32)
        return np.array([-self.log_odds[~_present(r, self.grams)].sum() for r in requests], dtype=np.float32)

    def accepts(self, requests: Sequence[np.ndarray]) -> np.ndarray:
        return self.scores(requests) >= self.threshold

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            "format_grams": torch.from_numpy(self.grams.astype(np.int64)),
            "format_log_odds": torch.from_numpy(self.log_odds.astype(np.float32)),
            "threshold_format": torch.tensor([self.threshold], dtype=torch.float32),
        }

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> FormatModel | None:
        """None for a skill stored without a format model (it is not format-gated)."""
        if "format_grams" not in tensors:
            return None
        return cls(
            tensors["format_grams"].numpy().astype(np.int64),
            tensors["format_log_odds"].float().numpy(),
            float(tensors["threshold_format"][0]),
        )


def _present(request: np.ndarray, grams: np.ndarray) -> np.ndarray:
    """Which of `grams` the request's sorted gram ids contain (a binary search each, no sort)."""
    if not len(request):
        return np.zeros(len(grams), dtype=bool)
    return request[np.minimum(np.searchsorted(request, grams), len(request) - 1)] == grams


def accepts_each(request: np.ndarray, models: Sequence[FormatModel | None]) -> np.ndarray:
    """Does one request pass each model's gate (None: no model, passes)? One vectorized pass over all their
    grams: a request is checked against up to `candidates` skills, and a call per skill added up (docs/routing.md)."""
    out = np.ones(len(models), dtype=bool)
    gated = [(i, m) for i, m in enumerate(models) if m is not None and len(m.grams) and m.threshold > float("-inf")]
    if not gated:
        return out
    sizes = np.array([len(m.grams) for _, m in gated])
    grams = np.concatenate([m.grams for _, m in gated])
    log_odds = np.concatenate([m.log_odds for _, m in gated])
    scores = -np.add.reduceat(np.where(_present(request, grams), 0.0, log_odds), np.cumsum(sizes) - sizes)
    out[[i for i, _ in gated]] = scores >= np.array([m.threshold for _, m in gated])
    return out


def _fit(sets: Sequence[np.ndarray], s: FormatSettings) -> tuple[np.ndarray, np.ndarray]:
    n = len(sets)
    ids, counts = np.unique(np.concatenate(sets) if n else np.zeros(0, dtype=np.int64), return_counts=True)
    keep = counts >= s.min_df * n
    ids, counts = ids[keep], counts[keep]
    top = np.argsort(-counts, kind="stable")[: s.max_grams]
    p = (counts[top] + 0.5) / (n + 1.0)
    order = np.argsort(ids[top])
    return ids[top][order], np.log(p / (1 - p))[order].astype(np.float32)


def fit_format(texts: Sequence[str], s: FormatSettings) -> FormatModel:
    """The skill's format model, with its threshold calibrated on held-out folds of the same inputs."""
    sets = [gram_ids(t) for t in texts]
    grams, log_odds = _fit(sets, s)
    if len(sets) < max(s.min_inputs, s.folds):
        return FormatModel(grams, log_odds, float("-inf"))
    fold = np.arange(len(sets)) % s.folds
    held = np.empty(len(sets), dtype=np.float32)
    for f in range(s.folds):
        g, lo = _fit([x for x, k in zip(sets, fold) if k != f], s)
        held[fold == f] = FormatModel(g, lo, 0.0).scores([x for x, k in zip(sets, fold) if k == f])
    return FormatModel(grams, log_odds, float(np.percentile(held, s.percentile) - s.margin))
