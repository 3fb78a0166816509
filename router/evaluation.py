"""`skillpool eval routing`: learn tasks one by one into a fresh router and measure routing after each.

After every addition, on every task's test inputs: top-1 routing accuracy and mix weight on the right
skill and fallback rate for the tasks seen so far; for the tasks not yet added, how often they
correctly fall back to the base model. Prints a table, writes JSON, optionally draws a confusion
matrix and a routing-accuracy-vs-tasks curve. Needs no LLM for the key modes; sapt reads the base
model's token-embedding table (no transformer layers) and learns each task with attentive reflection
on a replay sample (`--replay-fraction`, 2% as the trainer stores) of every earlier task.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .embedder import CachedEmbedder, Embedder, SentenceEmbedder
from .router import MODES, Decision, Features, Router, RouterSettings
from .sapt import POOLS, SAPTSettings, TokenPooler
from .texts import route_text

TEXT_MODES = ("with-instruction", "input-only", "system-message")


@dataclass
class Task:
    name: str
    train: list[str]
    test: list[str]
    train_inputs: list[str] | None = None  # the input part of each training row (no instruction)
    train_answers: list[str] | None = None


def task_text(row: dict[str, Any], mode: str, instruction: str | None = None) -> str:
    """The routed text of a benchmark row: instruction + input as one user turn (`with-instruction`), the
    instruction as a system message (`system-message`, joined by the server's own route_text), or the
    input alone. `instruction` replaces the row's own; a '{input}' in it marks where the input goes."""
    inp = str(row.get("input", ""))
    if mode == "input-only":
        return inp or str(row.get("instruction", ""))
    instr = str(row.get("instruction", "")) if instruction is None else instruction
    if mode == "system-message":
        system = instr.replace("{input}", "").strip()
        return route_text([{"role": "system", "content": system}, {"role": "user", "content": inp}])
    if "{input}" in instr:
        return instr.replace("{input}", inp)
    return "\n".join(p for p in (instr, inp) if p)


def load_paraphrases(path: Path) -> dict[str, list[str]]:
    """{task folder name: [instruction paraphrases]} (keys starting with '_' are comments)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--instructions {path}: cannot read a JSON object ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"--instructions {path}: expected an object of task name -> list of instructions")
    out = {k: v for k, v in data.items() if not k.startswith("_")}
    for k, v in out.items():
        if not isinstance(v, list) or not v or not all(isinstance(x, str) and x.strip() for x in v):
            raise ValueError(f"--instructions {path}: {k!r} must be a non-empty list of non-empty strings")
    return out


def load_task(
    folder: Path,
    mode: str,
    train_limit: int | None,
    test_limit: int | None,
    paraphrases: list[str] | None = None,
) -> Task:
    """Training texts always carry the row's own instruction (what the skill was uploaded with); test
    rows get paraphrase i mod n when paraphrases are given (deterministic, every paraphrase used)."""
    if mode not in TEXT_MODES:
        raise ValueError(f"text mode must be one of {', '.join(TEXT_MODES)}, got {mode!r}")

    def read(split: str, limit: int | None) -> list[dict[str, Any]]:
        path = folder / f"{split}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found (a task folder holds train.jsonl and test.jsonl)")
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
        return rows[:limit]

    train, test = read("train", train_limit), read("test", test_limit)
    train_mode = "input-only" if mode == "input-only" else "with-instruction"
    return Task(
        folder.name,
        [task_text(r, train_mode) for r in train],
        [task_text(r, mode, paraphrases[i % len(paraphrases)] if paraphrases else None) for i, r in enumerate(test)],
        [str(r.get("input") or r.get("instruction", "")) for r in train],
        [str(r.get("output", "")) for r in train],
    )


def _top(d: Decision) -> str:
    return d.route[0][0] if d.route else "base"


def _learn(router: Router, task: Task, train: Features, replay: dict[str, torch.Tensor], held_fraction: float) -> None:
    name = task.name
    tensors = router.prepare_keys_from_embeddings(train.emb, task.train, task.train_inputs, task.train_answers)
    attention = None
    if router.settings.mode == "sapt":
        assert train.pooled is not None
        n_held = max(1, int(len(train.pooled) * held_fraction))  # ā is measured on held-out inputs, as SAPT does
        sapt, attention = router.prepare_sapt_pooled(name, train.pooled[n_held:], train.pooled[:n_held], replay)
        tensors.update(sapt)
    router.add_skill(name, tensors, sapt_attention=attention)


def evaluate(tasks: list[Task], router: Router, replay_fraction: float = 0.02, seed: int = 0) -> dict[str, Any]:
    """The whole learning sequence; embeddings are computed once per task."""
    f_train = {t.name: router.features(t.train) for t in tasks}
    f_test = {t.name: router.features(t.test) for t in tasks}
    rng = np.random.default_rng(seed)
    replay: dict[str, torch.Tensor] = {}
    steps: list[dict[str, Any]] = []
    final_decisions: dict[str, list[Decision]] = {}
    for i, task in enumerate(tasks):
        t0 = time.perf_counter()
        _learn(router, task, f_train[task.name], replay, held_fraction=0.1)
        prep_s = time.perf_counter() - t0
        pooled = f_train[task.name].pooled
        if pooled is not None:  # what the trainer stores for later attentive reflection
            replay[task.name] = pooled[
                rng.choice(len(pooled), max(1, round(len(pooled) * replay_fraction)), replace=False)
            ]
        per_task: dict[str, dict[str, float]] = {}
        for j, other in enumerate(tasks):
            ds = router.route_features(f_test[other.name])
            fb = float(np.mean([not d.route for d in ds]))
            by_format = float(
                np.mean([d.reason == "format_mismatch" for d in ds])
            )  # the part of fb the format gate made
            if j <= i:
                per_task[other.name] = {
                    "top1": float(np.mean([_top(d) == other.name for d in ds])),
                    "weight": float(np.mean([dict(d.route).get(other.name, 0.0) for d in ds])),
                    "fallback": fb,
                    "fallback_format": by_format,
                    "n": len(ds),
                }
                if i == len(tasks) - 1:
                    final_decisions[other.name] = ds
            else:
                per_task[other.name] = {"fallback_unseen": fb, "fallback_format": by_format, "n": len(ds)}
        seen = [v for v in per_task.values() if "top1" in v]
        unseen = [v["fallback_unseen"] for v in per_task.values() if "fallback_unseen" in v]
        steps.append(
            {
                "added": task.name,
                "tasks_seen": i + 1,
                "top1": float(np.mean([v["top1"] for v in seen])),
                "weight": float(np.mean([v["weight"] for v in seen])),
                "fallback_seen": float(np.mean([v["fallback"] for v in seen])),
                "fallback_unseen": float(np.mean(unseen)) if unseen else None,
                "prepare_s": prep_s,
                "per_task": per_task,
            }
        )
    names = [t.name for t in tasks]
    labels = [*names, "base"]
    confusion = [[sum(_top(d) == lab for d in final_decisions[n]) for lab in labels] for n in names]
    last = steps[-1]
    unseen_all = [s["fallback_unseen"] for s in steps if s["fallback_unseen"] is not None]
    n_total = sum(len(final_decisions[n]) for n in names)
    return {
        "final": {
            "top1": last["top1"],
            "top1_micro": sum(confusion[i][i] for i in range(len(names))) / max(1, n_total),
            "weight": last["weight"],
            "fallback_seen": last["fallback_seen"],
            # every task is seen at the end: unseen fallback is averaged over the steps where some were unseen
            "fallback_unseen": float(np.mean(unseen_all)) if unseen_all else None,
            "per_task": {n: last["per_task"][n] for n in names},
        },
        "steps": steps,
        "confusion": {"labels": labels, "rows": names, "counts": confusion},
    }


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = RouterSettings()
    p.add_argument(
        "--tasks",
        type=Path,
        nargs="+",
        required=True,
        help="task folders (train.jsonl + test.jsonl), learned in this order",
    )
    p.add_argument("--router", choices=MODES, default=d.mode)
    p.add_argument(
        "--text",
        choices=TEXT_MODES,
        default="with-instruction",
        help="test prompts: instruction + input in one user turn, the instruction as a system message, or the input",
    )
    p.add_argument(
        "--instructions",
        type=Path,
        default=None,
        help="JSON {task: [instruction paraphrases]}: replaces each test row's instruction (training keeps its own)",
    )
    p.add_argument("--train-limit", type=int, default=300)
    p.add_argument("--test-limit", type=int, default=None, help="default: all test inputs")
    p.add_argument("--json", type=Path, required=True, help="write the results here")
    p.add_argument("--plots", type=Path, default=None, help="folder for routing_confusion.png and routing_curve.png")
    p.add_argument("--keys", type=int, default=d.n_keys)
    p.add_argument("--groups", type=int, default=d.dtkr.groups)
    p.add_argument("--top-k", type=int, default=d.top_k)
    p.add_argument("--temperature", type=float, default=d.temperature)
    p.add_argument("--threshold-percentile", type=float, default=d.threshold_percentile)
    p.add_argument("--threshold-margin", type=float, default=d.threshold_margin)
    p.add_argument(
        "--white-threshold-percentile", type=float, default=d.white_threshold_percentile, help="dtkr: whitened gate"
    )
    p.add_argument("--white-threshold-margin", type=float, default=d.white_threshold_margin, help="dtkr: whitened gate")
    p.add_argument(
        "--format-gate",
        choices=("on", "off"),
        default="on" if d.format.enabled else "off",
        help="fall back when a request lacks the fixed prompt text (instruction, options, field names) of its skills",
    )
    p.add_argument(
        "--format-min-df",
        type=float,
        default=d.format.min_df,
        help="share of a skill's inputs a gram must be in to be part of its format",
    )
    p.add_argument(
        "--format-margin", type=float, default=d.format.margin, help="nats below the skill's held-out percentile"
    )
    p.add_argument("--format-percentile", type=float, default=d.format.percentile)
    p.add_argument(
        "--format-source",
        choices=("inputs", "prompts"),
        default=d.format.source,
        help="fit the format gate on the inputs without instruction (fields) or on whole training prompts",
    )
    p.add_argument(
        "--labels",
        choices=("on", "off"),
        default="on" if d.labels.enabled else "off",
        help="gate on the skill's label set: a request naming some of its labels but not all falls back",
    )
    p.add_argument(
        "--augment-inputs",
        choices=("on", "off"),
        default="on" if d.augment_inputs else "off",
        help="keys and thresholds also learn each training input without its instruction",
    )
    p.add_argument("--replay-fraction", type=float, default=0.02, help="sapt: replay sample kept per task")
    p.add_argument("--sapt-steps", type=int, default=d.sapt.steps)
    p.add_argument("--sapt-lambda", type=float, default=d.sapt.arm_lambda, help="weight of attentive reflection")
    p.add_argument("--sapt-pool", choices=POOLS, default=d.sapt.pool)
    p.add_argument(
        "--model", type=Path, default=None, help="sapt: local base checkpoint (default: the packaged SmolLM2)"
    )
    p.add_argument(
        "--cache", type=Path, default=None, help="keep sentence embeddings here between runs (keyed by model and texts)"
    )
    p.add_argument("--device", default=None, help="where MiniLM runs: cpu or cuda (default: cuda when available)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import replace

    d = RouterSettings()
    settings = RouterSettings(
        mode=args.router,
        n_keys=args.keys,
        top_k=args.top_k,
        temperature=args.temperature,
        threshold_percentile=args.threshold_percentile,
        threshold_margin=args.threshold_margin,
        white_threshold_percentile=args.white_threshold_percentile,
        white_threshold_margin=args.white_threshold_margin,
        dtkr=replace(d.dtkr, groups=args.groups),
        sapt=SAPTSettings(steps=args.sapt_steps, arm_lambda=args.sapt_lambda, pool=args.sapt_pool),
        format=replace(
            d.format,
            enabled=args.format_gate == "on",
            min_df=args.format_min_df,
            margin=args.format_margin,
            percentile=args.format_percentile,
            source=args.format_source,
        ),
        labels=replace(d.labels, enabled=args.labels == "on"),
        augment_inputs=args.augment_inputs == "on",
    )
    para = load_paraphrases(args.instructions) if args.instructions else {}
    if para and args.text == "input-only":
        raise ValueError("--instructions replaces the instruction, which --text input-only leaves out")
    missing = [f.name for f in args.tasks if para and f.name not in para]
    if missing:
        raise ValueError(f"--instructions {args.instructions} has no paraphrases for {', '.join(missing)}")
    tasks = [load_task(f, args.text, args.train_limit, args.test_limit, para.get(f.name)) for f in args.tasks]
    pooler = None
    if args.router == "sapt":
        from skillpool.adapters_store.base_model import resolve_base_model

        pooler = TokenPooler.from_checkpoint(
            args.model or resolve_base_model().path, settings.sapt.max_tokens, settings.sapt.pool
        )
    t0 = time.perf_counter()
    embedder: Embedder = SentenceEmbedder(device=args.device)
    if args.cache:
        embedder = CachedEmbedder(embedder, args.cache)
    result = evaluate(tasks, Router(embedder, settings, pooler), args.replay_fraction)
    result["config"] = {
        "router": args.router,
        "text": args.text,
        "instructions": str(args.instructions) if args.instructions else None,
        "train_limit": args.train_limit,
        "test_limit": args.test_limit,
        "tasks": [t.name for t in tasks],
        "settings": {k: v for k, v in vars(args).items() if k not in ("tasks", "json", "plots")},
    }
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print_table(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {args.json}")
    if args.plots:
        for p in plot(result, args.plots, f"{args.router}, {args.text}"):
            print(f"wrote {p}")
    return result
