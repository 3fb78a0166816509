"""`skillpool eval continual` output: the score matrix and metrics table, the matrix and per-task plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _fmt(v: float | None) -> str:
    return "   -  " if v is None else f"{v:6.1f}"


def print_table(result: dict[str, Any]) -> None:
    names = result["tasks"]
    print(f"\nscore matrix ({result['method']}, model=auto; row j = after learning task j, %):")
    print(" " * 14 + "".join(f"{n[:8]:>9}" for n in names))
    for j, row in enumerate(result["matrix"]):
        print(f"{names[j][:13]:<14}" + "".join(f"{_fmt(v):>9}" for v in row))
    print(f"\n{'':<10}{'AP':>8}{'F.Ra':>8}{'FWT':>8}{'BWT':>8}   {'AP 95% interval':<18}FWT 95% interval")
    for label, m in [(result["method"], result), *result["baselines"].items()]:
        ci, fci = m.get("AP_ci95"), m.get("FWT_ci95")
        line = (
            f"{label:<10}"
            + "".join(f"{_fmt(m.get(k)):>8}" for k in ("AP", "F.Ra", "FWT", "BWT"))
            + f"   {f'[{ci[0]:.1f}, {ci[1]:.1f}]' if ci else '':<18}"
            + (f"[{fci[0]:+.1f}, {fci[1]:+.1f}]" if fci else "")
        )
        print(line.rstrip())
    for label, d in (result.get("vs_baselines") or {}).items():  # the same test rows resampled for both sides
        lo, hi = d["ci95"]
        print(f"AP {result['method']} - {label}: {d['AP_diff']:+.1f}, paired 95% interval [{lo:+.1f}, {hi:+.1f}]")
    gap = result.get("auto_minus_forced")
    if gap:  # the mix must not dilute the right skill
        print("\nmodel=auto minus the forced skill, final row: " + "  ".join(f"{n} {g:+.1f}" for n, g in gap.items()))
    tm = result["time"]
    print(
        f"\ntime: total {tm['total_s']:.0f}s; method training {tm['train_s']:.0f}s at {tm['train_tokens_per_s']:.0f} tok/s, "
        f"routed eval {tm['eval_s']:.0f}s; baselines training {tm['baseline_train_s']:.0f}s"
    )


def plot(result: dict[str, Any], folder: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    names = result["tasks"]
    out = []
    panels = [(result["method"], result["matrix"])] + [
        (n, b["matrix"]) for n, b in result["baselines"].items() if n != "mtl"
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(1 + 3.2 * len(panels), 3.6), squeeze=False)
    for ax, (label, m) in zip(axes[0], panels):
        arr = np.array([[np.nan if v is None else v for v in row] for row in m], dtype=float)
        ax.imshow(arr, vmin=0, vmax=100, cmap="viridis")
        for (j, i), v in np.ndenumerate(arr):
            if not np.isnan(v):
                ax.text(i, j, f"{v:.0f}", ha="center", va="center", color="white" if v < 60 else "black", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=7)
        ax.set_yticks(range(len(names)), [f"after {n}" for n in names], fontsize=7)
        ax.set_title(label)
    fig.tight_layout()
    path = folder / "score_matrix.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    out.append(path)
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(names) + 1)
    for i, n in enumerate(names):
        ax.plot(list(steps)[i:], [result["matrix"][j][i] for j in range(i, len(names))], marker="o", label=n)
    for label, b in result["baselines"].items():
        curve = b["ap_curve"]
        if all(v is not None for v in curve):
            ax.plot(steps, curve, linestyle="--", label=f"{label} (mean)")
    ax.set_xlabel("tasks learned")
    ax.set_ylabel("score (%)")
    ax.set_title(f"per-task scores, {result['method']} (model=auto)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = folder / "task_curves.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    out.append(path)
    return out
