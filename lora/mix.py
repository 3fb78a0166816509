"""`Mix`: the weighted set of skills one request is served with, as one value from the router to the engine.

A mix is canonical: its pairs sorted by skill name, each weight finite and > 0, the weights summing to 1, so
two mixes are equal (and hash alike) exactly when they mean the same thing. The empty mix is the base model
(no adapter): `Mix.base()`, which is falsy. Zero weights are dropped; a non-empty input whose weights are all
zero, or any weight that is negative, not finite or not a number, is refused (ValueError). Only a weight over
300 orders of magnitude below another can still end at 0.0, when dividing by the sum underflows: it keeps its
place (the client named it) and adds nothing.

Besides the canonical pairs a mix keeps `ranked`, the same pairs heaviest first with ties in the order they
were given: the order a routing decision or a client's `model="a=2,b=1"` lists them in, which is what
responses show and what the engine sums the blocks in. It is not part of equality or the hash.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

Pairs = tuple[tuple[str, float], ...]

# Weights whose sum is this close to 1 are kept bit for bit: renormalizing them would only move each by an
# ulp, and a decision's weights should reach the engine exactly as the router computed them.
NORMALIZED_TOL = 1e-12


def format_pairs(pairs: Iterable[tuple[str, float]]) -> str:
    """'skill=0.70,other=0.30' (two decimals), or 'base' for none: the x-skillpool-route header's text."""
    return ",".join(f"{s}={w:.2f}" for s, w in pairs) or "base"


@dataclass(frozen=True)
class Mix:
    """Skills and their weights; `Mix(pairs)` accepts the pairs in any order and unnormalized (see the module)."""

    pairs: Pairs = ()
    ranked: Pairs = field(default=(), init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        merged: dict[str, float] = {}
        for skill, w in self.pairs:
            if not isinstance(skill, str):
                raise TypeError(f"a mix's skill must be a name, got {skill!r}")
            if not isinstance(w, (int, float)) or isinstance(w, bool) or not math.isfinite(w) or w < 0:
                raise ValueError(f"mix weight of {skill!r} must be a finite number >= 0, got {w!r}")
            merged[skill] = merged.get(skill, 0.0) + float(w)
        total = sum(merged.values())
        if merged and not (math.isfinite(total) and total > 0):
            raise ValueError(f"mix weights must have a finite positive sum, got {total!r}")
        scale = 1.0 if abs(total - 1.0) <= NORMALIZED_TOL else total
        given = [(s, w / scale) for s, w in merged.items() if w > 0.0]
        object.__setattr__(self, "pairs", tuple(sorted(given)))
        object.__setattr__(self, "ranked", tuple(sorted(given, key=lambda sw: -sw[1])))  # stable: ties as given

    @classmethod
    def of(cls, weights: Mapping[str, float] | Iterable[tuple[str, float]]) -> Mix:
        """From {skill: weight} or (skill, weight) pairs; a skill named twice gets the sum of its weights."""
        return cls(tuple(weights.items() if isinstance(weights, Mapping) else weights))

    @classmethod
    def base(cls) -> Mix:
        """The base model: no skill."""
        return cls()

    @property
    def skills(self) -> tuple[str, ...]:
        return tuple(s for s, _ in self.pairs)

    @property
    def weights(self) -> tuple[float, ...]:
        """The weights in the order of `skills`."""
        return tuple(w for _, w in self.pairs)

    @property
    def top(self) -> str | None:
        """The heaviest skill (the first of `ranked`); None for the base model."""
        return self.ranked[0][0] if self.ranked else None

    def renamed(self, name: Callable[[str], str]) -> Mix:
        """The same weights and ranking under other skill keys (e.g. each skill's resident version key)."""
        return Mix(tuple((name(s), w) for s, w in self.ranked))

    def __iter__(self) -> Iterator[tuple[str, float]]:
        return iter(self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def __str__(self) -> str:
        return format_pairs(self.ranked)
