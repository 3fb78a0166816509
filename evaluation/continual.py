"""`skillpool eval continual`: a task sequence through the real server, scored after every task.

Starts `skillpool serve` on a fresh data dir, uploads each task's training rows to POST /tasks with the
chosen method, waits for the job (progress bar), then asks every task learned so far through the
openai client with model="auto" (routed) and the new task with model=<its skill> (task-ID oracle;
stored blocks are frozen, so a forced block scores the same at every later step and is asked once).
Baselines come from the same backbone, data split and hyperparameters, trained in this process after
the server stops, or with --parallel in processes of their own beside it (a GPU run: the sides share the GPU):
`seq` one LoRA fine-tuned on the tasks in turn, `mtl` one LoRA on all tasks jointly. Every side appends each
step it measures to `<json stem>.progress.jsonl` (progress_log.py), so a run cut short keeps what it scored.
FWT needs ã_i (task i trained alone): the isolated method's oracle diagonal; for other methods it is
read from an isolated run's JSON (--reference) or trained here. The final row's per-row scores are kept
(`row_scores`), so every AP comes with a bootstrap interval and the method's AP minus each baseline's with a
paired one (`vs_baselines`): all sides answer the same test rows. Each task's rows right after it was learned
(`diagonal_rows`) and trained alone (`single_task_rows`, also read from --reference) give FWT a paired interval.
--resume goes on with a run that was cut short (a GPU lease ended): on the same --data-dir and --json, it keeps
the steps the log holds and the skills the server trained, and measures only the rest.

This module is the command (its flags, the run and the result JSON); the server's side is continual_sequence,
what --resume keeps is continual_resume, a task and its folder continual_task, the metrics continual_metrics.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from skillpool.trainer.config import TrainConfig, as_recorded_now

from .baselines import Baselines, BaselineSides, logged_result, logged_training
from .continual_metrics import ap_curve, ap_interval, auto_vs_forced, cl_metrics, fwt_interval, row_mean
from .continual_report import plot, print_table
from .continual_resume import earlier_steps, run_setup
from .continual_sequence import run_server_sequence
from .continual_task import Task, load_tasks, set_budgets
from .progress_log import ProgressLog, log_path, read_log
from .run_options import add_server_run_flags, parse_server_run_flags, run_config, write_json
from .tasks import add_task_folders

BASELINES = ("oracle", "seq", "mtl")
SWITCHES = {  # the on/off flags and their help
    "--parallel": "train the baselines (seq, mtl, trained alone) in processes of their own beside the server's "
    "sequence instead of after it: for a GPU, which they share; on a CPU they only split its cores",
    "--resume": "go on with a run that was cut short, with its --data-dir and --json: keep the steps its progress "
    "log holds and the skills it trained, and measure the rest",
}


def _reference_single(
    path: Path, tasks: list[Task], args: argparse.Namespace
) -> tuple[list[float], list[list[float]] | None]:
    """ã from an isolated run with the same limits and hyperparameters, and its per-row scores where the
    JSON keeps them (runs before FWT's interval did not)."""
    ref = json.loads(path.read_text())
    want = {"train_limit": args.train_limit, "test_limit": args.test_limit, "train_config": args.train_config.to_dict()}
    recorded = {**ref.get("config", {})}
    recorded["train_config"] = as_recorded_now(recorded.get("train_config"))
    for key, value in want.items():
        if recorded.get(key) != value:
            raise SystemExit(f"--reference {path} was run with another {key}; FWT needs the same setup")
    single = ref.get("single_task") or {}
    missing = [t.name for t in tasks if t.name not in single]
    if missing:
        raise SystemExit(f"--reference {path} has no single-task score for {missing}")
    per_row = ref.get("single_task_rows") or {}
    if not all(t.name in per_row for t in tasks):
        return [float(single[t.name]) for t in tasks], None
    for t in tasks:
        if len(per_row[t.name]) != len(t.test):
            raise SystemExit(
                f"--reference {path} scored {len(per_row[t.name])} test rows of {t.name}, this run has {len(t.test)}"
            )
    return [float(single[t.name]) for t in tasks], [[float(v) for v in per_row[t.name]] for t in tasks]


def _with_metrics(matrix: list[list[float | None]], single: list[float] | None) -> dict[str, Any]:
    return {**cl_metrics(matrix, single), "matrix": matrix, "ap_curve": ap_curve(matrix)}


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from skillpool.runtime.base_model import resolve_base_model

    cfg: TrainConfig = args.train_config
    base = resolve_base_model(args.model)
    tasks = load_tasks(args.tasks, args.train_limit, args.test_limit, args.metric, cfg)
    baselines = set(args.baselines)
    t_start = time.perf_counter()
    from transformers import AutoTokenizer

    set_budgets(tasks, AutoTokenizer.from_pretrained(str(base.path)), args.max_new_tokens)
    reference = _reference_single(args.reference, tasks, args) if args.reference and args.method != "isolated" else None
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="skillpool-continual-")) / "data"
    # an isolated block is trained alone on the base model: the server's oracle rows are the trained-alone rows
    need_single = args.method != "isolated" and reference is None
    kinds = ["single"] * need_single + [k for k in ("seq", "mtl") if k in baselines]
    setup = run_setup(args, tasks, base.model_id)
    names = [t.name for t in tasks]
    earlier = None
    if args.resume:
        earlier = earlier_steps(read_log(log_path(args.json)), setup, args.method, names, kinds)
        print(
            f"resuming: {len(earlier.server)} of {len(tasks)} tasks scored before the cut; finished sides kept: "
            + (", ".join(earlier.sides) or "none"),
            flush=True,
        )
    log = ProgressLog.fresh(log_path(args.json), setup, earlier.lines() if earlier else None)
    bl = Baselines(base.path, cfg, log)
    kept = {kind: logged_result(kind, lines, names) for kind, lines in earlier.sides.items()} if earlier else {}
    with BaselineSides(bl, kinds, tasks, args.parallel, kept) as sides:
        server = run_server_sequence(args, tasks, cfg, data_dir, log, between=sides.check, earlier=earlier)
        side = sides.results()
    untimed = server["untimed_steps"]
    for lines in earlier.sides.values() if earlier else []:  # a kept side's training counts as this run's does
        seconds, tokens, missing = logged_training(lines)
        bl.train_s, bl.tokens, untimed = bl.train_s + seconds, bl.tokens + tokens, untimed + missing
    single_rows: list[list[float]] | None
    if args.method == "isolated":
        single_rows = server["row_scores"]["oracle"]
    elif reference is not None:
        single_rows = reference[1]
    else:
        single_rows = side["single"]
    single = reference[0] if reference is not None else [row_mean(r) for r in single_rows or []]
    rows = {"auto": server["row_scores"]["auto"]}
    diagonals = {"auto": server["diagonal_rows"], "oracle": server["row_scores"]["oracle"]}  # frozen: final = diagonal
    result: dict[str, Any] = {**_with_metrics(server["matrix"], single), "method": args.method}
    result["baselines"] = {}
    if "oracle" in baselines:
        rows["oracle"] = server["row_scores"]["oracle"]
        result["baselines"]["oracle"] = {
            **_with_metrics(server["oracle_matrix"], single),
            "note": "model=<skill>; stored blocks are frozen, so each block is asked once, right after it is learned",
        }
    if "seq" in baselines:
        seq_matrix, rows["seq"], diagonals["seq"] = side["seq"]
        result["baselines"]["seq"] = _with_metrics(seq_matrix, single)
    if "mtl" in baselines:
        rows["mtl"] = side["mtl"]
        last: list[list[float | None]] = [[None] * len(tasks) for _ in tasks]
        last[-1] = [row_mean(r) for r in rows["mtl"]]
        result["baselines"]["mtl"] = _with_metrics(last, None)
    result["AP_ci95"] = ap_interval(rows["auto"])
    for name, b in result["baselines"].items():
        b["AP_ci95"] = ap_interval(rows[name])
    if single_rows is not None:  # FWT's paired interval: each task's rows, learned in turn vs trained alone
        for name, m in [("auto", result), *result["baselines"].items()]:
            if name in diagonals:
                m["FWT_ci95"] = fwt_interval(diagonals[name], single_rows)
    result["vs_baselines"] = {
        name: {"AP_diff": result["AP"] - b["AP"], "ci95": ap_interval(rows["auto"], rows[name])}
        for name, b in result["baselines"].items()
    }
    result.update(
        {
            "tasks": [t.name for t in tasks],
            "metrics": {t.name: t.metric for t in tasks},
            "single_task": {t.name: s for t, s in zip(tasks, single)},
            "single_task_rows": {t.name: r for t, r in zip(tasks, single_rows)} if single_rows is not None else None,
            "diagonal_rows": diagonals,
            "routed_to_own_skill": server["routed_to_own_skill"],
            "row_scores": rows,
            "auto_minus_forced": dict(
                zip([t.name for t in tasks], auto_vs_forced(server["matrix"], server["oracle_matrix"]))
            ),
            "jobs": server["jobs"],
            "router_mode": server["router_mode"],
            "time": {
                **server["time"],
                "baseline_train_s": round(bl.train_s, 1),
                "baseline_train_tokens": bl.tokens,
                "baseline_tokens_per_s": round(bl.tokens / bl.train_s, 1) if bl.train_s else None,
                "total_s": round(time.perf_counter() - t_start, 1),
            },
            "config": {
                **run_config(args, base.model_id, data_dir),
                "parallel": args.parallel,
                # --resume: what this run kept from the cut one. The training and eval seconds include the kept
                # steps' (their log lines carry them), total_s is this run's wall; untimed_steps counts kept lines
                # from a log written before lines carried their seconds
                "resumed": None
                if earlier is None
                else {"server_tasks": len(earlier.server), "sides": sorted(earlier.sides), "untimed_steps": untimed},
            },
        }
    )
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_task_folders(p)
    add_server_run_flags(p, None, None, "training hyperparameters for every task (JSON, as POST /tasks takes)")
    p.add_argument("--plots", type=Path, default=None)
    p.add_argument("--baselines", default="oracle,seq,mtl", help=f"comma list of {', '.join(BASELINES)} (empty: none)")
    p.add_argument(
        "--reference", type=Path, default=None, help="an isolated run's JSON: its single-task scores give FWT"
    )
    for flag, text in SWITCHES.items():
        p.add_argument(flag, action="store_true", help=text)


def run(args: argparse.Namespace) -> dict[str, Any]:
    parse_server_run_flags(args)
    if args.resume and (args.data_dir is None or not args.data_dir.is_dir()):
        raise SystemExit("--resume: give the cut run's --data-dir (its trained skills)")
    if args.resume and not log_path(args.json).is_file():
        raise SystemExit(f"--resume: no progress log {log_path(args.json)} (the cut run's --json sets it)")
    args.baselines = [b for b in args.baselines.split(",") if b]
    unknown = sorted(set(args.baselines) - set(BASELINES))
    if unknown:
        raise SystemExit(f"--baselines: unknown {unknown} (known: {', '.join(BASELINES)})")
    result = evaluate(args)
    print_table(result)
    write_json(args.json, result)
    print(f"wrote {args.json} (each step as it was measured: {log_path(args.json)})")
    if args.plots:
        for p in plot(result, args.plots):
            print(f"wrote {p}")
    return result
