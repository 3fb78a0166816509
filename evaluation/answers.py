"""`skillpool eval answers`: how well a skill answers when the user words the task differently.

Starts `skillpool serve` on a data dir, uploads each task's training rows (isolated by default, the default
config, seed 0), then asks every task's test rows under four wordings (answers_variants: the uploaded
instruction, a hand-written paraphrase, the instruction as a system message, the input alone) both forced to the
task's skill (model=<skill>) and routed (model=auto, with every task's skill in the pool), and optionally the base
model. Each side is scored by the task's metric (exact match for label tasks, ROUGE-L otherwise, as eval continual
scores it); answers_report gives every score a bootstrap interval, every variant's gap from the uploaded
instruction a paired one, and checks the paraphrase-gap criterion on the routed paraphrase gap (--max-task-gap,
--max-mean-gap). Writes JSON and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from skillpool.runtime.flags import number
from skillpool.trainer.config import TrainConfig
from skillpool.trainer.records import JobStatus

from .answers_report import GapCriterion, Rows, markdown_table, summarize
from .answers_variants import VARIANTS, AnswerTask
from .continual_sequence import _ask, _train, _trained_skills, server_argv
from .continual_task import load_tasks, set_budgets
from .run_options import add_server_run_flags, parse_server_run_flags, run_config, write_json
from .tasks import add_task_folders, load_paraphrases, paraphrase_sets, paraphrase_source, task_lines

ROUTES = ("forced", "auto", "base")


def _choices(text: str, known: tuple[str, ...], flag: str) -> list[str]:
    chosen = [x for x in text.split(",") if x]
    unknown = [x for x in chosen if x not in known]
    if unknown or not chosen:
        raise SystemExit(f"{flag}: pick from {', '.join(known)} (got {text!r})")
    return [x for x in known if x in chosen]  # the table's order, whatever order was given


def load_answer_tasks(args: argparse.Namespace, cfg: TrainConfig) -> list[AnswerTask]:
    """The tasks with their raw test rows and paraphrases (args.paraphrases: the --instructions files merged)."""
    para: dict[str, list[str]] = args.paraphrases
    tasks = load_tasks(args.tasks, args.train_limit, args.test_limit, args.metric, cfg)
    out = []
    for folder, task in zip(args.tasks, tasks, strict=True):
        rows = [json.loads(line) for line in task_lines(folder, "test")][: args.test_limit]
        if "paraphrase" in args.variants and folder.name not in para:
            raise SystemExit(
                f"--instructions: no paraphrases for {folder.name} (or leave the paraphrase variant out of --variants)"
            )
        out.append(AnswerTask(task, rows, para.get(folder.name, [])))
    return out


def _score_all(args: argparse.Namespace, tasks: list[AnswerTask], cfg: TrainConfig, data_dir: Path) -> dict[str, Any]:
    """Train (or keep, with --reuse) every task's skill, then ask every (route, variant, task)."""
    from openai import OpenAI

    from .process import ServerProcess

    mode = args.router_mode or ("sapt" if args.method == "sapt" else "dtkr")
    rows: Rows = {r: {v: {} for v in args.variants} for r in args.routes}
    said: dict[str, dict[str, dict[str, list[str]]]] = {r: {v: {} for v in args.variants} for r in args.routes}
    own: dict[str, dict[str, float]] = {v: {} for v in args.variants} if "auto" in args.routes else {}
    jobs: list[dict[str, Any]] = []
    with ServerProcess(data_dir, server_argv(args, mode)) as srv:
        kept = _trained_skills(srv.url) if args.reuse else {}
        t0 = time.perf_counter()
        for j, at in enumerate(tasks):
            if at.name in kept:
                job = kept[at.name]
                print(f"[{j + 1}/{len(tasks)}] {at.name}: kept from {data_dir} (job {job['id']})", flush=True)
            else:
                job = _train(
                    srv.url, srv.exited, args, cfg, at.task, f"[{j + 1}/{len(tasks)}] {at.name} ({args.method})"
                )
            jobs.append({k: job.get(k) for k in ("skill", "status", "error", "started_at", "finished_at")})
            if job["status"] != JobStatus.SUCCEEDED:
                raise RuntimeError(f"training {at.name} ended {job['status']}: {job.get('error')}")
        train_s = time.perf_counter() - t0
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=1800)
        t0 = time.perf_counter()
        for at in tasks:
            for variant in args.variants:
                asked = at.variant(variant)
                for route in args.routes:
                    model = {"forced": at.name, "auto": "auto", "base": "base"}[route]
                    answers, headers = _ask(client, model, asked, args.concurrency)
                    rows[route][variant][at.name] = asked.row_scores(answers)
                    said[route][variant][at.name] = answers
                    if route == "auto":
                        own[variant][at.name] = 100 * sum(h.split("=")[0] == at.name for h in headers) / len(headers)
                print(
                    f"{at.name} {variant}: "
                    + "  ".join(f"{r} {sum(rows[r][variant][at.name]) / len(asked.test):.1f}" for r in args.routes),
                    flush=True,
                )
        ask_s = time.perf_counter() - t0
    return {
        "rows": rows,
        "answers": said,
        "own": own,
        "jobs": jobs,
        "mode": mode,
        "time": {"train_s": round(train_s, 1), "ask_s": round(ask_s, 1)},
    }


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from skillpool.runtime.base_model import resolve_base_model

    cfg: TrainConfig = args.train_config
    base = resolve_base_model(args.model)
    tasks = load_answer_tasks(args, cfg)
    set_budgets([t.task for t in tasks], AutoTokenizer.from_pretrained(str(base.path)), args.max_new_tokens)
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="skillpool-answers-")) / "data"
    t_start = time.perf_counter()
    asked = _score_all(args, tasks, cfg, data_dir)
    names = [t.name for t in tasks]
    result: dict[str, Any] = {
        "tasks": names,
        "variants": args.variants,
        "routes": args.routes,
        "metrics": {t.name: t.task.metric for t in tasks},
        "n_test": {t.name: len(t.rows) for t in tasks},
        **summarize(asked["rows"], names, GapCriterion(args.max_task_gap, args.max_mean_gap)),
        "routed_to_own_skill": asked["own"],
        "row_scores": asked["rows"],
        "answers": asked["answers"],  # what was said, row by row: whether a miss copies the prompt's wording
        "jobs": asked["jobs"],
        "router_mode": asked["mode"],
        "time": {**asked["time"], "total_s": round(time.perf_counter() - t_start, 1)},
        "config": {
            **run_config(args, base.model_id, data_dir),
            "instructions": list(args.instructions or []),
            "reuse": args.reuse,
        },
    }
    return result


gap_points = number(float, lo=0)  # a --max-task-gap/--max-mean-gap value: a finite number of points, at least 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_task_folders(p)
    p.add_argument(
        "--instructions",
        type=paraphrase_source,
        nargs="+",
        default=None,
        metavar="NAME_OR_PATH",
        help=f"instruction paraphrases: a packaged set ({', '.join(paraphrase_sets())}) or a JSON file {{task folder "
        "name: [paraphrases]}; later ones win (needed for the paraphrase variant; never used to train)",
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument(
        "--routes", default="forced,auto", help=f"comma list of {', '.join(ROUTES)} (base: the base model alone)"
    )
    default = GapCriterion()
    p.add_argument(
        "--max-task-gap",
        type=gap_points,
        default=default.max_task_gap,
        metavar="POINTS",
        help="paraphrase-gap criterion: how far each task's routed paraphrase score may fall below its uploaded "
        "one (unless the paired 95%% interval reaches that far; default %(default)s)",
    )
    p.add_argument(
        "--max-mean-gap",
        type=gap_points,
        default=default.max_mean_gap,
        metavar="POINTS",
        help="paraphrase-gap criterion: how far the mean over tasks may fall (default %(default)s)",
    )
    add_server_run_flags(p, 300, 200, "training hyperparameters (JSON, as POST /tasks takes; seed 0)")
    p.add_argument(
        "--reuse", action="store_true", help="ask the skills --data-dir already holds instead of training them again"
    )
    p.add_argument("--markdown", type=Path, default=None, help="also write the table here")


def run(args: argparse.Namespace) -> dict[str, Any]:
    parse_server_run_flags(args)
    args.variants = _choices(args.variants, VARIANTS, "--variants")
    args.routes = _choices(args.routes, ROUTES, "--routes")
    for flag in ("train_limit", "test_limit", "max_new_tokens", "concurrency"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"--{flag.replace('_', '-')} must be at least 1")
    if args.reuse and (args.data_dir is None or not args.data_dir.is_dir()):
        raise SystemExit("--reuse: give the --data-dir whose skills to ask")
    args.paraphrases = {}
    for path in args.instructions or []:  # later files win
        try:
            args.paraphrases.update(load_paraphrases(path))
        except ValueError as e:
            raise SystemExit(str(e)) from None
    result = evaluate(args)
    table = markdown_table(result)
    print(table)
    write_json(args.json, result)
    print(f"wrote {args.json}")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(table)
        print(f"wrote {args.markdown}")
    return result
