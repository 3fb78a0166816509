"""The quality gate: a new skill is registered only if it learned its task and left earlier skills intact.

1. The new block, forced (as `model=<skill>` serves it), must beat the better of the base model and the
   trivial answer (the most frequent training answer) on its held-out split by `quality_min_gain`, and by
   more than noise: the one-sided lower bound (mean − quality_z · standard error) of the per-example gain
   must be above 0: a broken upload (shuffled labels) scores like the trivial answer give or take noise,
   which the point bar alone lets through.
2. Every earlier skill's stored probe prompts are answered through the routed path (router decision →
   per-row LoRA mix), once with the pool as it is and once with the new skill added; a drop of more
   than `quality_max_drop` fails the job. Only rows whose route changed are generated twice.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from skillpool.adapters_store.store import SkillRecord
from skillpool.lora.mix import Mix
from skillpool.router import Router

from .config import TrainConfig
from .judge import Judge
from .records import Example
from .scoring import mean_score, metric_for, score


class QualityGateFailed(Exception):
    """The job fails with these numbers; nothing is registered."""

    def __init__(self, report: dict[str, Any]) -> None:
        self.report = report
        super().__init__("quality gate: " + "; ".join(report["reasons"]))


def answer_budget(tokenizer: Any, answers: Sequence[str], cap: int = 256) -> int:
    """Generation budget: the longest reference answer plus a little slack."""
    longest = max((len(tokenizer(a, add_special_tokens=False)["input_ids"]) for a in answers), default=1)
    return min(cap, longest + 8)


def trivial_answer(answers: Sequence[str]) -> str:
    return Counter(a.strip() for a in answers).most_common(1)[0][0] if answers else ""


def held_out_scores(judge: Judge, tok: Any, key: str, train: list[Example], held: list[Example]) -> dict[str, Any]:
    """The new block (forced), the base model and the trivial answer on the held-out split."""
    metric = metric_for([e["answer"] for e in train])
    if not held:
        return {"metric": metric, "score": None, "base_score": None, "trivial_score": None, "n": 0}
    refs, prompts = [e["answer"] for e in held], [e["messages"] for e in held]
    budget = answer_budget(tok, [e["answer"] for e in train])
    block = per_example(metric, judge.generate(prompts, [Mix.of({key: 1.0})] * len(held), budget), refs)
    base = per_example(metric, judge.generate(prompts, [Mix.base()] * len(held), budget), refs)
    trivial = per_example(metric, [trivial_answer([e["answer"] for e in train])] * len(held), refs)
    reference = max(base, trivial, key=sum)
    gains = [b - r for b, r in zip(block, reference)]
    mean_gain = sum(gains) / len(gains)
    sd = math.sqrt(sum((g - mean_gain) ** 2 for g in gains) / (len(gains) - 1)) if len(gains) > 1 else math.inf
    return {
        "metric": metric,
        "score": _mean(block),
        "base_score": _mean(base),
        "trivial_score": _mean(trivial),
        "n": len(held),
        "gain": mean_gain,
        "gain_se": sd / math.sqrt(len(gains)),
    }


def per_example(metric: str, predictions: Sequence[str], references: Sequence[str]) -> list[float]:
    return [score(metric, p, r) for p, r in zip(predictions, references)]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs)


@dataclass
class PoolProbe:
    """Earlier skills' probes answered through a scratch router, before and after adding the new skill."""

    router: Router
    earlier: list[SkillRecord]

    def run(
        self,
        judge: Judge,
        tok: Any,
        name: str,
        key: str,
        tensors: dict[str, Any],
        attention: dict[str, float] | None,
    ) -> dict[str, dict[str, Any]]:
        """`key`: the new block's key in the judge (the router knows it as `name`)."""
        probes = {rec.name: rec.probe() for rec in self.earlier}
        rows = [(rec.name, p) for rec in self.earlier for p in probes[rec.name]]
        if not rows:
            return {}
        keys = {name: key}
        for rec in self.earlier:
            if tensors_of := rec.router_tensors():  # a skill without keys is never routed to
                attention_of = (rec.meta.get("router") or {}).get("sapt_attention")
                self.router.add_skill(rec.name, tensors_of, attention_of)
            keys[rec.name] = judge.registered(rec.name, rec.adapter)
        feats = self.router.features([p["route_text"] for _, p in rows])
        before = [d.route for d in self.router.route_features(feats)]
        self.router.add_skill(name, tensors, attention)
        after = [d.route for d in self.router.route_features(feats)]
        changed = [i for i in range(len(rows)) if after[i] != before[i]]
        budget = answer_budget(tok, [p["answer"] for _, p in rows])
        prompts = [p["messages"] for _, p in rows]

        def keyed(route: list[tuple[str, float]]) -> Mix:
            return Mix.of([(keys[s], w) for s, w in route])

        answers_before = judge.generate(prompts, [keyed(m) for m in before], budget)
        answers_after = list(answers_before)
        if changed:
            redo = judge.generate([prompts[i] for i in changed], [keyed(after[i]) for i in changed], budget)
            for i, a in zip(changed, redo):
                answers_after[i] = a
        out: dict[str, dict[str, Any]] = {}
        rerouted = set(changed)
        for rec in self.earlier:
            idx = [i for i, (n, _) in enumerate(rows) if n == rec.name]
            if not idx:
                continue
            metric = (rec.meta.get("eval") or {}).get("metric") or metric_for([rows[i][1]["answer"] for i in idx])
            refs = [rows[i][1]["answer"] for i in idx]
            score_before = mean_score(metric, [answers_before[i] for i in idx], refs)
            score_after = mean_score(metric, [answers_after[i] for i in idx], refs)
            out[rec.name] = {
                "metric": metric,
                "before": score_before,
                "after": score_after,
                "drop": score_before - score_after,
                "n": len(idx),
                "rerouted": sum(1 for i in idx if i in rerouted),
            }
        return out


def verdict(new: dict[str, Any], earlier: dict[str, dict[str, Any]], cfg: TrainConfig, force: bool) -> dict[str, Any]:
    """The gate's report; `passed` False (and not forced) means the job fails with `reasons`."""
    reasons: list[str] = []
    if new.get("score") is not None:
        bar = max(new["base_score"], new["trivial_score"]) + cfg.quality_min_gain
        lower = new["gain"] - cfg.quality_z * new["gain_se"]
        new = {**new, "bar": bar, "gain_lower_bound": lower}
        if new["score"] < bar:
            reasons.append(
                f"new skill scores {new['score']:.3f} {new['metric']} on {new['n']} held-out examples, below the bar {bar:.3f} "
                f"(base model {new['base_score']:.3f}, most frequent answer {new['trivial_score']:.3f}, + quality_min_gain {cfg.quality_min_gain})"
            )
        elif lower <= 0:
            reasons.append(
                f"new skill's gain of {new['gain']:.3f} {new['metric']} over the better of the base model and the most frequent "
                f"answer is within noise on {new['n']} held-out examples (standard error {new['gain_se']:.3f}, quality_z {cfg.quality_z}): "
                "not shown to have learned the task"
            )
    for skill, r in earlier.items():
        if r["drop"] > cfg.quality_max_drop:
            reasons.append(
                f"skill {skill!r} drops from {r['before']:.3f} to {r['after']:.3f} {r['metric']} on its {r['n']} probe prompts "
                f"through the routed pool (more than quality_max_drop {cfg.quality_max_drop})"
            )
    return {
        "new": new,
        "earlier": earlier,
        "passed": not reasons,
        "forced": force and bool(reasons),
        "reasons": reasons,
    }
