"""`eval answers`' numbers and table: each (route, variant, task) score with its bootstrap interval, each variant's
paired difference from the uploaded instruction, and the paraphrase-gap criterion on the routed paraphrase gap.

Scores are in points (0-100) from per-row scores; intervals are eval continual's percentile bootstrap over the
test rows (continual_metrics.ap_interval), paired where two variants answered the same rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .continual_metrics import ap_interval, row_mean

BASE_VARIANT = "uploaded"

Rows = dict[str, dict[str, dict[str, list[float]]]]  # route -> variant -> task -> per-row scores


@dataclass(frozen=True)
class GapCriterion:
    """The paraphrase-gap criterion: each task's routed paraphrase score at most max_task_gap points below its
    uploaded score (or the paired 95% interval of the difference reaches that far), and the mean gap over tasks at
    most max_mean_gap points (`eval answers --max-task-gap/--max-mean-gap`)."""

    max_task_gap: float = 3.0
    max_mean_gap: float = 1.5

    def rule(self) -> str:
        return (
            f"auto: each task's paraphrase − uploaded ≥ −{self.max_task_gap:g} (or its paired 95% interval reaches "
            f"−{self.max_task_gap:g}), mean gap ≥ −{self.max_mean_gap:g}"
        )


def within_criterion(diff: float, ci: tuple[float, float], limit: float = GapCriterion.max_task_gap) -> bool:
    """A task's gap passes when it is no worse than -limit, or its paired interval does not rule -limit out."""
    return diff >= -limit or ci[0] <= -limit <= ci[1]


def _interval(rows: list[list[float]], minus: list[list[float]] | None = None) -> list[float]:
    return [round(x, 2) for x in ap_interval(rows, minus)]


def summarize(rows: Rows, tasks: list[str], criterion: GapCriterion | None = None) -> dict[str, Any]:
    """Scores, paired gaps (variant − uploaded) and the paraphrase-gap criterion, from the per-row scores of every
    side asked."""
    crit = criterion or GapCriterion()
    scores: dict[str, Any] = {}
    gaps: dict[str, Any] = {}
    for route, by_variant in rows.items():
        scores[route] = {}
        for variant, by_task in by_variant.items():
            per = {t: {"score": round(row_mean(by_task[t]), 2), "ci95": _interval([by_task[t]])} for t in tasks}
            mean = round(sum(row_mean(by_task[t]) for t in tasks) / len(tasks), 2)
            scores[route][variant] = {
                "per_task": per,
                "mean": mean,
                "mean_ci95": _interval([by_task[t] for t in tasks]),
            }
        if BASE_VARIANT not in by_variant:
            continue
        base = by_variant[BASE_VARIANT]
        gaps[route] = {}
        for variant, by_task in by_variant.items():
            if variant == BASE_VARIANT:
                continue
            per_gap = {}
            for t in tasks:
                diff = row_mean(by_task[t]) - row_mean(base[t])
                ci = ap_interval([by_task[t]], [base[t]])
                per_gap[t] = {
                    "diff": round(diff, 2),
                    "ci95": [round(x, 2) for x in ci],
                    "within_criterion": within_criterion(diff, ci, crit.max_task_gap),
                }
            mean_gap = sum(row_mean(by_task[t]) - row_mean(base[t]) for t in tasks) / len(tasks)
            gaps[route][variant] = {
                "per_task": per_gap,
                "mean": round(mean_gap, 2),
                "mean_ci95": _interval([by_task[t] for t in tasks], [base[t] for t in tasks]),
            }
    out: dict[str, Any] = {"scores": scores, "gaps": gaps, "paraphrase_gap": None}
    auto = gaps.get("auto", {}).get("paraphrase")
    if auto is not None:
        failing = [t for t, g in auto["per_task"].items() if not g["within_criterion"]]
        mean_ok = auto["mean"] >= -crit.max_mean_gap
        out["paraphrase_gap"] = {
            **asdict(crit),
            "rule": crit.rule(),
            "tasks_failing": failing,
            "mean_gap_ok": mean_ok,
            "met": not failing and mean_ok,
        }
    return out


def _cell(value: float, ci: list[float]) -> str:
    return f"{value:.1f} [{ci[0]:.1f}, {ci[1]:.1f}]"


def _pair(v: dict[str, Any]) -> dict[str, Any]:
    return {"value": v["score"], "ci": v["ci95"]}


def markdown_table(result: dict[str, Any]) -> str:
    """One table: a row per (task, route) and a mean row per route; a column per variant, the paired
    paraphrase − uploaded gap, and (auto) how often the request was routed to the task's own skill."""
    tasks, variants = result["tasks"], result["variants"]
    own = result.get("routed_to_own_skill", {})
    gap_col = "paraphrase" in variants and BASE_VARIANT in variants
    head = ["task", "route", *variants] + ["paraphrase − uploaded"] * gap_col + ["routed to own skill %"] * bool(own)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for route in result["routes"]:
        sc = result["scores"][route]
        gap = result["gaps"].get(route, {}).get("paraphrase")
        for t in [*tasks, None]:
            cells = [t or "**mean**", route]
            for v in variants:
                cells.append(
                    _cell(sc[v]["mean"], sc[v]["mean_ci95"]) if t is None else _cell(**_pair(sc[v]["per_task"][t]))
                )
            if gap_col and gap is not None:
                cells.append(
                    _cell(gap["mean"], gap["mean_ci95"])
                    if t is None
                    else _cell(gap["per_task"][t]["diff"], gap["per_task"][t]["ci95"])
                )
            if own:
                shown = [f"{own[v][t]:.0f}" for v in variants if v in own] if route == "auto" and t else []
                cells.append(" / ".join(shown))
            lines.append("| " + " | ".join(cells) + " |")
    if own:
        lines.append(f"\nrouted to own skill %: {' / '.join(v for v in variants if v in own)}")
    crit = result.get("paraphrase_gap") or result.get("bar")  # "bar": the same record in results written before
    if crit is not None:
        lines.append(
            f"\nparaphrase-gap criterion ({crit['rule']}): {'met' if crit['met'] else 'not met'}"
            + (f"; failing: {', '.join(crit['tasks_failing'])}" if crit["tasks_failing"] else "")
            + ("" if crit["mean_gap_ok"] else "; mean gap too large")
        )
    return "\n".join(lines) + "\n"
