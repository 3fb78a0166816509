"""Continual-learning metrics over a score matrix (docs/evaluation.md), in percentage points.

matrix[j][i] = score on task i after training task j (i <= j; later tasks are None). T tasks, ã_i the
score of task i trained alone.
  AP   = mean_i a[T-1][i]
  F.Ra = mean_{i<T-1} (max_{i<=j<T-1} a[j][i] - a[T-1][i])
  FWT  = mean_i (a[i][i] - ã_i)
  BWT  = mean_{i<T-1} (a[T-1][i] - a[i][i])
F.Ra and BWT need T >= 2; FWT needs ã. A matrix with only its last row (the multi-task baseline, which
never passes through the intermediate states) has AP only.

An AP over 50 test rows a task moves by whole answers (2 points each), so a comparison of two APs comes with a
bootstrap interval over the test rows (ap_interval): paired, the same resampled rows for both, when both
answered the same rows. FWT is the same kind of mean, of the diagonal's rows minus the trained-alone rows, so it
gets the paired interval too (fwt_interval).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Matrix = Sequence[Sequence[float | None]]


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def row_mean(rows: Sequence[float]) -> float:
    """A task's score from its per-row scores (0 for a task without test rows)."""
    return sum(rows) / len(rows) if rows else 0.0


def _full(matrix: Matrix) -> bool:
    return all(matrix[j][i] is not None for j in range(len(matrix)) for i in range(j + 1))


def cl_metrics(matrix: Matrix, single: Sequence[float] | None = None) -> dict[str, float | None]:
    """AP, F.Ra, FWT, BWT of a lower-triangular score matrix (None where a value is undefined)."""
    t = len(matrix)
    if t == 0 or any(len(row) != t for row in matrix):
        raise ValueError(f"the score matrix must be T x T, got {[len(r) for r in matrix]} rows for T={t}")
    final = matrix[-1]
    if any(v is None for v in final):
        raise ValueError("the last row of the score matrix must score every task")
    last = [float(v) for v in final if v is not None]
    out: dict[str, float | None] = {"AP": _mean(last), "F.Ra": None, "FWT": None, "BWT": None}
    if not _full(matrix):
        return out
    a = [[float(v) if v is not None else 0.0 for v in row] for row in matrix]
    if t >= 2:
        out["F.Ra"] = _mean([max(a[j][i] for j in range(i, t - 1)) - a[t - 1][i] for i in range(t - 1)])
        out["BWT"] = _mean([a[t - 1][i] - a[i][i] for i in range(t - 1)])
    if single is not None:
        if len(single) != t:
            raise ValueError(f"need one single-task score per task ({t}), got {len(single)}")
        out["FWT"] = _mean([a[i][i] - float(single[i]) for i in range(t)])
    return out


def ap_curve(matrix: Matrix) -> list[float | None]:
    """Mean score over the tasks learned so far, after each task (None where a row is missing)."""
    out: list[float | None] = []
    for j, row in enumerate(matrix):
        seen = row[: j + 1]
        out.append(None if any(v is None for v in seen) else sum(float(v) for v in seen if v is not None) / (j + 1))
    return out


def auto_vs_forced(matrix: Matrix, forced: Matrix) -> list[float]:
    """Per task, its final `model=auto` score minus its forced skill's score (the oracle's last row): what
    routing and mixing cost (< 0) or add (> 0) over serving the task's own skill alone."""
    auto, own = matrix[-1], forced[-1]
    if any(v is None for v in auto) or any(v is None for v in own) or len(auto) != len(own):
        raise ValueError("both last rows must score every task")
    return [float(a) - float(f) for a, f in zip(auto, own) if a is not None and f is not None]


def ap_interval(
    rows: Sequence[Sequence[float]],
    minus: Sequence[Sequence[float]] | None = None,
    level: float = 0.95,
    draws: int = 4000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of AP from per-row scores (rows[i]: task i's test rows, in points), or of
    AP(rows) − AP(minus) when `minus` scored the same rows in the same order: each draw resamples every task's
    rows with replacement and uses the same rows for both sides (a paired comparison, far tighter than two
    separate intervals where both sides get the same rows right or wrong)."""
    if not rows or any(len(r) == 0 for r in rows):
        raise ValueError("every task needs at least one scored row")
    if minus is not None and [len(r) for r in minus] != [len(r) for r in rows]:
        raise ValueError(
            f"a paired interval needs the same rows on both sides: {[len(r) for r in rows]} vs {[len(r) for r in minus]}"
        )
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    ap = np.zeros(draws)
    for i, r in enumerate(rows):
        x = np.asarray(r, dtype=float) - (np.asarray(minus[i], dtype=float) if minus is not None else 0.0)
        ap += x[rng.integers(0, len(x), size=(draws, len(x)))].mean(axis=1)
    lo, hi = np.quantile(ap / len(rows), [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def fwt_interval(
    diagonal: Sequence[Sequence[float]], single: Sequence[Sequence[float]], level: float = 0.95
) -> tuple[float, float]:
    """Paired bootstrap interval of FWT: diagonal[i] holds task i's per-row scores right after it was learned,
    single[i] the same rows' scores of task i trained alone (FWT = mean_i (a[i][i] - ã_i), one row at a time)."""
    return ap_interval(diagonal, single, level=level)
