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
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skillpool.trainer.config import METHODS, TrainConfig
from skillpool.trainer.datasets import parse_jsonl
from skillpool.trainer.records import JobStatus
from skillpool.trainer.scoring import metric_for
from skillpool.trainer.skill_trainer import split_examples

from .baselines import Baselines, BaselineSides, logged_result, logged_training
from .continual_metrics import ap_curve, ap_interval, auto_vs_forced, cl_metrics, fwt_interval, row_mean
from .continual_report import plot, print_table
from .continual_task import Task
from .progress_log import RUN, ProgressLog, log_path, read_log
from .tasks import task_lines

BASELINES = ("oracle", "seq", "mtl")
METRICS = ("auto", "exact_match", "rouge_l")


@dataclass
class Earlier:
    """What a cut-short run with the same setup measured, kept by --resume: the server side's steps (the method's
    line and the forced line) for its first tasks, and the baseline sides that finished, by their lines."""

    server: list[tuple[dict[str, Any], dict[str, Any]]]
    sides: dict[str, list[dict[str, Any]]]

    def lines(self) -> list[dict[str, Any]]:
        return [line for step in self.server for line in step] + [line for s in self.sides.values() for line in s]


def earlier_steps(
    lines: list[dict[str, Any]], setup: dict[str, Any], method: str, names: list[str], kinds: list[str]
) -> Earlier:
    """The steps of a progress log that a resumed run keeps. The server side goes on after the longest prefix
    of tasks it scored whole; a baseline side is kept only when it finished (a side restarts from its start, as
    seq's one LoRA is not stored)."""
    if not lines or lines[0].get("side") != RUN:
        raise SystemExit("--resume: the progress log does not start with its run's setup (written before --resume?)")
    before = lines[0]["setup"]
    for key, value in setup.items():
        if before.get(key) != value:
            raise SystemExit(f"--resume: the cut run had {key} {before.get(key)!r}, this one {value!r}")
    last = {(x["side"], x["after"]): x for x in lines[1:]}  # a step measured twice: the later line
    server = []
    for name in names:
        if (method, name) not in last or ("forced", name) not in last:
            break
        server.append((last[method, name], last["forced", name]))
    sides = {}
    for kind in kinds:
        mine = [x for x in lines[1:] if x["side"] == kind]
        if [x["after"] for x in mine] == (names[-1:] if kind == "mtl" else names):
            sides[kind] = mine
    return Earlier(server, sides)


def _read_rows(folder: Path, split: str, limit: int | None) -> bytes:
    try:
        lines = task_lines(folder, split)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    return "\n".join(lines[:limit] if limit else lines).encode()


def load_tasks(
    folders: list[Path], train_limit: int | None, test_limit: int | None, metric: str, cfg: TrainConfig
) -> list[Task]:
    tasks = []
    for folder in folders:
        body = _read_rows(folder, "train", train_limit)
        examples = parse_jsonl(body)
        test = parse_jsonl(_read_rows(folder, "test", test_limit))
        answers = [e["answer"] for e in examples]
        tasks.append(
            Task(
                folder.name.lower(),
                body,
                split_examples(examples, cfg)[0],
                test,
                metric_for(answers) if metric == "auto" else metric,
            )
        )
    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise SystemExit(f"task names must be unique: {names}")
    return tasks


def set_budgets(tasks: list[Task], tokenizer: Any, cap: int) -> None:
    from skillpool.trainer.quality import answer_budget

    for t in tasks:
        t.budget = answer_budget(tokenizer, [e["answer"] for e in t.train], cap)


# --- the server path --------------------------------------------------------------------------------
def server_argv(args: argparse.Namespace, mode: str) -> list[str]:
    """The flags of the `skillpool serve` this run starts: the router mode and model it needs, then the user's
    --server-args (an engine sized for a GPU, say; `run` refuses flags that would clash with these)."""
    return (
        ["--router-mode", mode]
        + (["--model", str(args.model)] if args.model else [])
        + list(getattr(args, "server_argv", None) or [])
    )


CONNECTION_TRIES = 3  # a request that could not reach the server is sent again, at most this many times in all


def _ask(client: Any, model: str, task: Task, concurrency: int) -> tuple[list[str], list[str]]:
    """(answers, x-skillpool-route headers), sent concurrently so the server batches them.

    A request whose connection broke is sent again: one "connection reset by peer", while the server was up and
    answering every other request, ended a 2-hour run. The client is made with max_retries 0, so an error the
    server answered (4xx, 5xx) or a timeout still ends the run at once; a greedy answer does not depend on which
    try gave it. A server that died fails every try and ends the run too.
    """
    from openai import APIConnectionError, APITimeoutError

    def one(ex: dict[str, Any]) -> tuple[str, str]:
        for attempt in range(1, CONNECTION_TRIES + 1):
            try:
                raw = client.chat.completions.with_raw_response.create(
                    model=model, messages=ex["messages"], temperature=0, max_tokens=task.budget
                )
                break
            except APITimeoutError:  # a subclass of APIConnectionError: the server is there, only slow
                raise
            except APIConnectionError:
                if attempt == CONNECTION_TRIES:
                    raise
                time.sleep(0.5 * attempt)
        return raw.parse().choices[0].message.content or "", raw.headers.get("x-skillpool-route", "")

    with cf.ThreadPoolExecutor(concurrency) as pool:
        out = list(pool.map(one, task.test))
    return [a for a, _ in out], [h for _, h in out]


def _train(
    url: str, gone: Callable[[], str | None], args: argparse.Namespace, cfg: TrainConfig, task: Task, label: str
) -> Any:
    """Upload the task's rows to POST /tasks and follow the job to its end: the job's last record."""
    import httpx

    from .upload import follow

    data = {
        "name": task.name,
        "method": args.method,
        "config": json.dumps(cfg.to_dict()),
        "force": str(args.force).lower(),
    }
    r = httpx.post(url + "/tasks", files={"file": (f"{task.name}.jsonl", task.train_body)}, data=data, timeout=300)
    if r.status_code != 202:
        raise SystemExit(f"upload of {task.name} refused: {r.status_code} {r.text}")
    return follow(url, r.json()["id"], label, gone=gone)


def _trained_skills(url: str) -> dict[str, dict[str, Any]]:
    """Skill name → the last job that trained it to the end, from the server's job records (they survive a
    restart): what a cut run finished."""
    import httpx

    jobs = httpx.get(url + "/tasks", timeout=60).raise_for_status().json()["data"]
    done = sorted((j for j in jobs if j["status"] == JobStatus.SUCCEEDED), key=lambda j: j["finished_at"] or 0)
    return {j["skill"]: j for j in done}


def run_server_sequence(
    args: argparse.Namespace,
    tasks: list[Task],
    cfg: TrainConfig,
    data_dir: Path,
    log: ProgressLog | None = None,
    between: Callable[[], None] | None = None,  # after each task: raises if a side beside the server failed
    earlier: Earlier | None = None,  # --resume: the steps the cut run measured (the data dir has its skills)
) -> dict[str, Any]:
    from openai import OpenAI

    from .process import ServerProcess

    mode = args.router_mode or ("sapt" if args.method == "sapt" else "dtkr")
    extra = server_argv(args, mode)
    t = len(tasks)
    matrix: list[list[float | None]] = [[None] * t for _ in range(t)]
    oracle: list[list[float | None]] = [[None] * t for _ in range(t)]
    routed: list[list[float | None]] = [[None] * t for _ in range(t)]
    rows: dict[str, list[list[float]]] = {"auto": [], "oracle": []}  # the final row's per-row scores
    diagonal: list[list[float]] = []  # each task's per-row auto scores right after it was learned (FWT)
    jobs: list[dict[str, Any]] = []
    eval_s, untimed = 0.0, 0  # untimed: kept steps whose line carries no seconds (a log from before it did)
    log = log or ProgressLog()
    names = [task.name for task in tasks]
    kept = earlier.server if earlier is not None else []
    with ServerProcess(data_dir, extra) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=1800)
        trained = _trained_skills(srv.url) if earlier is not None else {}
        for j, task in enumerate(tasks):
            if task.name in trained:  # trained before the cut: scored, not trained again
                job = trained[task.name]
                print(f"[{j + 1}/{t}] {task.name}: trained before the cut (job {job['id']})", flush=True)
            elif j < len(kept):
                raise SystemExit(
                    f"--resume: the log scored {task.name}, but the data dir {data_dir} has no skill of that name: "
                    "not the cut run's --data-dir?"
                )
            else:
                job = _train(srv.url, srv.exited, args, cfg, task, f"[{j + 1}/{t}] {task.name} ({args.method})")
            jobs.append(
                {k: job.get(k) for k in ("skill", "status", "error", "eval", "progress", "started_at", "finished_at")}
            )
            if job["status"] != JobStatus.SUCCEEDED:
                raise RuntimeError(
                    f"training {task.name} ended {job['status']}: {job.get('error')}"
                    + ("" if args.force else " (--force registers anyway)")
                )
            if j < len(kept):
                line, forced = kept[j]
                step_rows, own, forced_rows = line["rows"], line["routed_to_own_skill"], forced["rows"][task.name]
                eval_s += line.get("eval_s", 0.0)
                untimed += "eval_s" not in line
            else:
                t0 = time.perf_counter()
                step_rows, own = {}, {}
                for earlier_task in tasks[: j + 1]:  # model=auto: what a user gets, after every task
                    answers, headers = _ask(client, "auto", earlier_task, args.concurrency)
                    step_rows[earlier_task.name] = earlier_task.row_scores(answers)
                    own[earlier_task.name] = (
                        100 * sum(h.split("=")[0] == earlier_task.name for h in headers) / len(headers)
                    )
                answers, _ = _ask(client, task.name, task, args.concurrency)
                forced_rows = task.row_scores(answers)
                step_s = time.perf_counter() - t0
                eval_s += step_s
                log.scored(args.method, task.name, step_rows, routed_to_own_skill=own, eval_s=round(step_s, 2))
                log.scored("forced", task.name, {task.name: forced_rows})
            for i, name in enumerate(names[: j + 1]):
                matrix[j][i], routed[j][i] = row_mean(step_rows[name]), own[name]
            if j == t - 1:
                rows["auto"] = [step_rows[name] for name in names]
            diagonal.append(step_rows[task.name])
            rows["oracle"].append(forced_rows)  # a frozen block: its final row is this
            for jj in range(j, t):
                oracle[jj][j] = row_mean(forced_rows)
            # the whole row on stdout too, for a reader watching the run
            print(
                f"after {task.name}: "
                + "  ".join(f"{tasks[i].name} {matrix[j][i]:.1f}" for i in range(j + 1))
                + f" | forced {task.name} {oracle[j][j]:.1f} | routed to own skill %: "
                + "  ".join(f"{tasks[i].name} {routed[j][i]:.0f}" for i in range(j + 1)),
                flush=True,
            )
            if between is not None:
                between()
    train_s = sum((jb["finished_at"] or 0) - (jb["started_at"] or 0) for jb in jobs)
    tokens = sum(int((jb["progress"] or {}).get("tokens") or 0) for jb in jobs)
    return {
        "matrix": matrix,
        "oracle_matrix": oracle,
        "routed_to_own_skill": routed,
        "row_scores": rows,
        "diagonal_rows": diagonal,
        "jobs": jobs,
        "router_mode": mode,
        "untimed_steps": untimed,
        "time": {
            "train_s": round(train_s, 1),
            "eval_s": round(eval_s, 1),
            "train_tokens": tokens,
            "train_tokens_per_s": round(tokens / max(train_s, 1e-9), 1),
        },
    }


def _reference_single(
    path: Path, tasks: list[Task], args: argparse.Namespace
) -> tuple[list[float], list[list[float]] | None]:
    """ã from an isolated run with the same limits and hyperparameters, and its per-row scores where the
    JSON keeps them (runs before FWT's interval did not)."""
    ref = json.loads(path.read_text())
    want = {"train_limit": args.train_limit, "test_limit": args.test_limit, "train_config": args.train_config.to_dict()}
    for key, value in want.items():
        if ref.get("config", {}).get(key) != value:
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


def run_setup(args: argparse.Namespace, tasks: list[Task], model_id: str) -> dict[str, Any]:
    """What a resumed run must share with the run it goes on with (the progress log's first line)."""
    return {
        "tasks": [t.name for t in tasks],
        "method": args.method,
        "train_limit": args.train_limit,
        "test_limit": args.test_limit,
        "train_config": args.train_config.to_dict(),
        "metric": args.metric,
        "max_new_tokens": args.max_new_tokens,
        "router_mode": args.router_mode,
        "model": model_id,
        "force": args.force,
    }


def _with_metrics(matrix: list[list[float | None]], single: list[float] | None) -> dict[str, Any]:
    return {**cl_metrics(matrix, single), "matrix": matrix, "ap_curve": ap_curve(matrix)}


def evaluate(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    from skillpool.adapters_store.base_model import resolve_base_model

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
                "tasks": [str(p) for p in args.tasks],
                "method": args.method,
                "train_limit": args.train_limit,
                "test_limit": args.test_limit,
                "train_config": cfg.to_dict(),
                "metric": args.metric,
                "max_new_tokens": args.max_new_tokens,
                "model": base.model_id,
                "force": args.force,
                "data_dir": str(data_dir),
                "server_args": getattr(args, "server_args", ""),
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
    p.add_argument(
        "--tasks",
        type=Path,
        nargs="+",
        required=True,
        help="task folders (train.jsonl, test.jsonl), learned in this order",
    )
    p.add_argument("--method", choices=METHODS, default="isolated")
    p.add_argument("--train-limit", type=int, default=None, help="first N training rows per task (default: all)")
    p.add_argument("--test-limit", type=int, default=None, help="first N test rows per task (default: all)")
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--plots", type=Path, default=None)
    p.add_argument("--baselines", default="oracle,seq,mtl", help=f"comma list of {', '.join(BASELINES)} (empty: none)")
    p.add_argument(
        "--config", default="{}", help="training hyperparameters for every task (JSON, as POST /tasks takes)"
    )
    p.add_argument(
        "--metric", choices=METRICS, default="auto", help="auto: exact match for label tasks, ROUGE-L otherwise"
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=64, help="cap on the answer length (each task: its longest answer + 8)"
    )
    p.add_argument("--router-mode", default=None, help="default: sapt for --method sapt, else dtkr")
    p.add_argument(
        "--reference", type=Path, default=None, help="an isolated run's JSON: its single-task scores give FWT"
    )
    p.add_argument("--force", action="store_true", help="register skills even when the quality gate fails")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument(
        "--parallel",
        action="store_true",
        help="train the baselines (seq, mtl, trained alone) in processes of their own beside the server's sequence "
        "instead of after it: for a GPU, which they share; on a CPU they only split its cores",
    )
    p.add_argument("--data-dir", type=Path, default=None, help="the server's data dir (default: a fresh temp dir)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="go on with a run that was cut short, with its --data-dir and --json: keep the steps its progress log "
        "holds and the skills it trained, and measure the rest",
    )
    p.add_argument("--model", type=Path, default=None, help="local base checkpoint (default: the packaged SmolLM2)")
    p.add_argument(
        "--server-args",
        default="",
        help="more flags for the server it starts, e.g. --server-args='--max-batch-size 64 --max-batched-tokens 16384'"
        " on a GPU (the '=' keeps them one value)",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    from skillpool.trainer.config import ConfigError

    try:
        args.train_config = TrainConfig.from_dict(json.loads(args.config))
    except (json.JSONDecodeError, ConfigError) as e:
        raise SystemExit(f"--config: {e}") from None
    try:
        args.server_argv = shlex.split(args.server_args)
    except ValueError as e:
        raise SystemExit(f"--server-args: {e}") from None
    owned = ("--port", "--data-dir", "--router-mode", "--model")  # argparse also takes a prefix, e.g. --data
    for flag in (a.split("=")[0] for a in args.server_argv if a.startswith("--") and len(a) > 2):
        if any(o.startswith(flag) for o in owned):
            raise SystemExit(
                f"--server-args: {flag}: the run sets --port and --data-dir itself, and --router-mode and --model "
                "through its own options of those names"
            )
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
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json} (each step as it was measured: {log_path(args.json)})")
    if args.plots:
        for p in plot(result, args.plots):
            print(f"wrote {p}")
    return result
