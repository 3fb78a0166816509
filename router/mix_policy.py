"""The mix policy: retrieved slots (or SAPT attention) → the weighted skill list a request is served with."""

from __future__ import annotations

import numpy as np

from .types import Decision, RouterSettings


def slot_weights(scores: np.ndarray, ids: np.ndarray, owners: list[str], temperature: float) -> dict[str, float]:
    """JARe: temperature softmax over the retrieved slots' scores, summed per skill."""
    p = np.exp((scores - scores.max()) / temperature)
    p /= p.sum()
    per_skill: dict[str, float] = {}
    for j, w in zip(ids, p):
        per_skill[owners[j]] = per_skill.get(owners[j], 0.0) + float(w)
    return per_skill


def top_mix(per_skill: dict[str, float], settings: RouterSettings) -> list[tuple[str, float]]:
    """Keep the top-k skills with at least min_weight and at least mix_keep_ratio of the top skill's weight,
    renormalized, heaviest first."""
    top = sorted(per_skill.items(), key=lambda sw: -sw[1])[: settings.top_k]
    floor = max(settings.min_weight, settings.mix_keep_ratio * top[0][1]) if top else settings.min_weight
    kept = {s: w for s, w in top if w >= floor} or dict(top[:1])
    total = sum(kept.values())
    return sorted(((s, w / total) for s, w in kept.items()), key=lambda sw: -sw[1])


def sapt_decision(
    names: list[str], attention: np.ndarray, best: float, rejected: set[str], settings: RouterSettings
) -> Decision:
    if not names:
        return Decision(route=[], reason="no_skills", score=best)
    if rejected:  # skills the format gate turned down get no share of the attention
        attention = np.where([nm in rejected for nm in names], 0.0, attention)
    top = np.argpartition(-attention, min(settings.top_k, len(names)) - 1)[: settings.top_k]  # O(n), not a sort
    return Decision(
        route=top_mix({names[j]: float(attention[j]) for j in top if attention[j] > 0}, settings),
        reason="matched",
        score=best,
    )
