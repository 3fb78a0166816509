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
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from skillpool.router.build import EMBEDDERS, make_embedder
from skillpool.router.embedder import CachedEmbedder, Embedder
from skillpool.router.flags import EVAL_FIELDS, add_router_flags, router_settings
from skillpool.router.modes import mode_class
from skillpool.router.router import Decision, Features, Router
from skillpool.router.sapt import TokenPooler

from .routing_report import plot, print_table
from .run_options import write_json
from .tasks import TEXT_MODES, Task, add_task_folders, load_paraphrases, load_task, paraphrase_sets, paraphrase_source


def _top(d: Decision) -> str:
    return d.route[0][0] if d.route else "base"


def _learn(router: Router, task: Task, train: Features, replay: dict[str, torch.Tensor], held_fraction: float) -> None:
    name = task.name
    tensors = router.prepare_keys_from_embeddings(train.emb, task.train, task.train_inputs, task.train_answers)
    attention = None
    if router.mode.learns_projector:
        assert train.pooled is not None
        n_held = max(1, int(len(train.pooled) * held_fraction))  # ā is measured on held-out inputs, as SAPT does
        state = router.sapt_state().learn(name, train.pooled[n_held:], train.pooled[:n_held], replay)
        sapt, attention = state.learned(name)
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_task_folders(p)
    add_router_flags(p, ("mode",))  # the flags in today's order: `settings` in the JSON keeps its key order
    p.add_argument(
        "--text",
        choices=TEXT_MODES,
        default="with-instruction",
        help="test prompts: instruction + input in one user turn, the instruction as a system message, or the input",
    )
    p.add_argument(
        "--instructions",
        type=paraphrase_source,
        default=None,
        metavar="NAME_OR_PATH",
        help=f"instruction paraphrases, a packaged set ({', '.join(paraphrase_sets())}) or a JSON file {{task: "
        "[paraphrases]}: they replace each test row's instruction (training keeps its own)",
    )
    p.add_argument("--train-limit", type=int, default=300)
    p.add_argument("--test-limit", type=int, default=None, help="default: all test inputs")
    p.add_argument("--json", type=Path, required=True, help="write the results here")
    p.add_argument("--plots", type=Path, default=None, help="folder for routing_confusion.png and routing_curve.png")
    add_router_flags(p, [f for f in EVAL_FIELDS if f != "mode" and not f.startswith("sapt.")])
    p.add_argument("--replay-fraction", type=float, default=0.02, help="sapt: replay sample kept per task")
    add_router_flags(p, [f for f in EVAL_FIELDS if f.startswith("sapt.")])
    p.add_argument(
        "--model", type=Path, default=None, help="sapt: local base checkpoint (default: the packaged SmolLM2)"
    )
    p.add_argument(
        "--cache", type=Path, default=None, help="keep sentence embeddings here between runs (keyed by model and texts)"
    )
    p.add_argument("--device", default=None, help="where MiniLM runs: cpu or cuda (default: cuda when available)")
    p.add_argument(
        "--embedder",
        choices=EMBEDDERS,
        default="torch",
        help="MiniLM's runtime, as `serve --embedder` (default torch; onnx runs on every core here)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = router_settings(args)
    para = load_paraphrases(args.instructions) if args.instructions else {}
    if para and args.text == "input-only":
        raise ValueError("--instructions replaces the instruction, which --text input-only leaves out")
    missing = [f.name for f in args.tasks if para and f.name not in para]
    if missing:
        raise ValueError(f"--instructions {args.instructions} has no paraphrases for {', '.join(missing)}")
    tasks = [load_task(f, args.text, args.train_limit, args.test_limit, para.get(f.name)) for f in args.tasks]
    pooler = None
    if mode_class(args.router).learns_projector:
        from skillpool.runtime.base_model import resolve_base_model

        pooler = TokenPooler.from_checkpoint(
            args.model or resolve_base_model().path, settings.sapt.max_tokens, settings.sapt.pool
        )
    t0 = time.perf_counter()
    embedder: Embedder = make_embedder(args.embedder, args.device, threads=os.cpu_count() or 1)
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
    write_json(args.json, result)
    print(f"wrote {args.json}")
    if args.plots:
        for p in plot(result, args.plots, f"{args.router}, {args.text}"):
            print(f"wrote {p}")
    return result
