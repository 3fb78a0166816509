"""The mix policy: which skills a routed request is served with, and their weights."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from skillpool.router import RouterSettings
from skillpool.router.mix_policy import slot_weights, top_mix


def test_a_clear_winner_is_served_alone_and_a_torn_router_mixes() -> None:
    s = replace(RouterSettings(), mix_keep_ratio=0.5)
    assert top_mix({"yahoo": 0.85, "agnews": 0.15}, s) == [("yahoo", 1.0)]  # a small share would dilute it
    torn = top_mix({"yelp": 0.5, "amazon": 0.4, "imdb": 0.1}, s)
    assert [n for n, _ in torn] == ["yelp", "amazon"] and sum(w for _, w in torn) == pytest.approx(1.0)
    assert torn[0][1] == pytest.approx(0.5 / 0.9)
    keep_all = RouterSettings()  # the default: the JARe mix as the paper has it, only min_weight drops
    assert [n for n, _ in top_mix({"yahoo": 0.85, "agnews": 0.15}, keep_all)] == ["yahoo", "agnews"]
    assert [n for n, _ in top_mix({"yahoo": 0.97, "agnews": 0.03}, keep_all)] == ["yahoo"]


def test_slot_scores_to_skill_weights() -> None:
    owners = ["a", "a", "b"]
    w = slot_weights(np.array([0.50, 0.49, 0.30]), np.array([0, 1, 2]), owners, temperature=0.02)
    assert w["a"] > 0.99 and w["a"] + w["b"] == pytest.approx(1.0)


def test_the_keep_ratio_is_validated() -> None:
    with pytest.raises(ValueError, match="mix_keep_ratio"):
        RouterSettings(mix_keep_ratio=1.5)
