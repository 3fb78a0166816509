"""`skillpool eval answers-compare BEFORE.json AFTER.json`: two `eval answers` runs on the same test rows (a training
change's "before" and "after"), cell by cell: after − before per (route, wording, task) and per (route, wording)
over tasks, each with a paired bootstrap interval (the same resampled rows on both sides, as `eval answers`
pairs two wordings). A cell is `lower` when the whole interval lies below zero: the change made it worse beyond
what the test rows' noise explains.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .continual_metrics import ap_interval, row_mean

Rows = dict[str, dict[str, dict[str, list[float]]]]  # route -> variant -> task -> per-row scores


def _load(path: Path) -> dict[str, Any]:
    try:
        result = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"{path}: not an `eval answers` JSON ({e})") from None
    if not isinstance(result, dict) or "row_scores" not in result or "tasks" not in result:
        raise SystemExit(f"{path}: not an `eval answers` JSON (no row_scores or tasks)")
    return result


def _cell(after: list[list[float]], before: list[list[float]]) -> dict[str, Any]:
    diff = sum(row_mean(a) - row_mean(b) for a, b in zip(after, before, strict=True)) / len(after)
    lo, hi = ap_interval(after, before)
    return {
        "before": round(sum(map(row_mean, before)) / len(before), 2),
        "after": round(sum(map(row_mean, after)) / len(after), 2),
        "diff": round(diff, 2),
        "ci95": [round(lo, 2), round(hi, 2)],
        "lower": hi < 0,
    }


def compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Every (route, variant) both runs asked, over the tasks both learned; refuses runs on different rows."""
    tasks = [t for t in before["tasks"] if t in after["tasks"]]
    if not tasks:
        raise SystemExit("the two runs share no task")
    for t in tasks:
        if before["n_test"][t] != after["n_test"][t]:
            raise SystemExit(f"{t}: {before['n_test'][t]} test rows before, {after['n_test'][t]} after: not paired")
    b_rows: Rows = before["row_scores"]
    a_rows: Rows = after["row_scores"]
    cells: dict[str, dict[str, Any]] = {}
    for route in [r for r in b_rows if r in a_rows]:
        for variant in [v for v in b_rows[route] if v in a_rows[route]]:
            b, a = b_rows[route][variant], a_rows[route][variant]
            cells.setdefault(route, {})[variant] = {
                "per_task": {t: _cell([a[t]], [b[t]]) for t in tasks},
                "mean": _cell([a[t] for t in tasks], [b[t] for t in tasks]),
            }
    lower = [
        f"{route} {variant} {t}"
        for route, by_variant in cells.items()
        for variant, c in by_variant.items()
        for t, cell in c["per_task"].items()
        if cell["lower"]
    ]
    return {"tasks": tasks, "cells": cells, "lower": lower}


def markdown_table(result: dict[str, Any]) -> str:
    head = ["task", "route", "wording", "before", "after", "after − before"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for route, by_variant in result["cells"].items():
        for variant, c in by_variant.items():
            for t, cell in [*c["per_task"].items(), ("**mean**", c["mean"])]:
                lo, hi = cell["ci95"]
                mark = " (lower)" if cell["lower"] else ""
                lines.append(
                    f"| {t} | {route} | {variant} | {cell['before']:.1f} | {cell['after']:.1f} | "
                    f"{cell['diff']:+.1f} [{lo:.1f}, {hi:.1f}]{mark} |"
                )
    verdict = "none lower" if not result["lower"] else f"lower: {', '.join(result['lower'])}"
    lines.append(f"\nafter − before in points, paired 95% bootstrap intervals over the test rows; {verdict}")
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("before", type=Path, help="`eval answers --json` of the run before the change")
    p.add_argument("after", type=Path, help="the same command's JSON after it")
    p.add_argument("--json", type=Path, default=None, help="write the comparison here")
    p.add_argument("--markdown", type=Path, default=None, help="also write the table here")


def run(args: argparse.Namespace) -> dict[str, Any]:
    result = compare(_load(args.before), _load(args.after))
    table = markdown_table(result)
    print(table)
    for path, text in ((args.json, json.dumps(result, indent=2)), (args.markdown, table)):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    return result
