"""`skillpool eval routing` output: the per-step table, the confusion matrix and the routing curve."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def print_table(result: dict[str, Any]) -> None:
    print(f"{'step':>4s} {'added':28s} {'top1':>6s} {'weight':>6s} {'fb_seen':>7s} {'fb_unseen':>9s}")
    for s in result["steps"]:
        fu = "-" if s["fallback_unseen"] is None else f"{s['fallback_unseen']:.3f}"
        print(
            f"{s['tasks_seen']:4d} {s['added'][:28]:28s} {s['top1']:6.3f} {s['weight']:6.3f} {s['fallback_seen']:7.3f} {fu:>9s}"
        )
    f = result["final"]
    print(
        f"\nfinal: top1 {f['top1']:.4f} (micro {f['top1_micro']:.4f}), weight {f['weight']:.4f}, "
        f"fallback seen {f['fallback_seen']:.4f}, fallback unseen {f['fallback_unseen'] if f['fallback_unseen'] is None else round(f['fallback_unseen'], 4)}"
    )
    print("per task:", ", ".join(f"{n} {v['top1']:.3f}" for n, v in f["per_task"].items()))


def plot(result: dict[str, Any], folder: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    conf = result["confusion"]
    counts = np.array(conf["counts"], dtype=float)
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(1 + 0.6 * len(conf["labels"]), 1 + 0.55 * len(conf["rows"])))
    im = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    ax.set_xticks(range(len(conf["labels"])), conf["labels"], rotation=60, ha="right")
    ax.set_yticks(range(len(conf["rows"])), conf["rows"])
    for i in range(share.shape[0]):
        for j in range(share.shape[1]):
            if counts[i, j]:
                ax.text(
                    j,
                    i,
                    f"{share[i, j]:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if share[i, j] > 0.5 else "black",
                )
    ax.set_xlabel("routed to (top-1)")
    ax.set_ylabel("true task")
    ax.set_title(f"routing confusion — {title}")
    fig.colorbar(im, ax=ax, fraction=0.03)
    fig.tight_layout()
    cm = folder / "routing_confusion.png"
    fig.savefig(cm, dpi=120)
    plt.close(fig)

    steps = result["steps"]
    x = [s["tasks_seen"] for s in steps]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [s["top1"] for s in steps], "o-", label="top-1 accuracy (seen tasks)")
    ax.plot(x, [s["weight"] for s in steps], "s--", label="mix weight on the right skill")
    ax.plot(x, [s["fallback_seen"] for s in steps], "^-", label="fallback rate, seen tasks")
    fu = [(s["tasks_seen"], s["fallback_unseen"]) for s in steps if s["fallback_unseen"] is not None]
    if fu:
        ax.plot(*zip(*fu), "v-", label="fallback rate, unseen tasks")
    ax.set_xlabel("tasks learned")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xticks(x)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    ax.set_title(f"routing vs tasks — {title}")
    fig.tight_layout()
    curve = folder / "routing_curve.png"
    fig.savefig(curve, dpi=120)
    plt.close(fig)
    return [cm, curve]
