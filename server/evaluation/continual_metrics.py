"""Continual-learning metrics over a score matrix (algorithms.md §4), in percentage points.

matrix[j][i] = score on task i after training task j (i <= j; later tasks are None). T tasks, ã_i the
score of task i trained alone.
  AP   = mean_i a[T-1][i]
  F.Ra = mean_{i<T-1} (max_{i<=j<T-1} a[j][i] - a[T-1][i])
  FWT  = mean_i (a[i][i] - ã_i)
  BWT  = mean_{i<T-1} (a[T-1][i] - a[i][i])
F.Ra and BWT need T >= 2; FWT needs ã. A matrix with only its last row (the multi-task baseline, which
never passes through the intermediate states) has AP only.
"""

from __future__ import annotations

from collections.abc import Sequence

Matrix = Sequence[Sequence[float | None]]


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


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
