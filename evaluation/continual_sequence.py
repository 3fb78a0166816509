"""`eval continual`'s server side: the task sequence through a real `skillpool serve`, scored after every task.

Each task's rows are uploaded to POST /tasks with the chosen method and its job followed to the end; then every
task learned so far is asked through the openai client with model="auto" (routed) and the new task with
model=<its skill> (the task-ID oracle; stored blocks are frozen, so a forced block scores the same at every
later step and is asked once). Every step is appended to the progress log as it is measured.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from skillpool.trainer.config import TrainConfig
from skillpool.trainer.records import JobStatus

from .continual_metrics import row_mean
from .continual_resume import Earlier
from .continual_task import Task
from .progress_log import ProgressLog


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

    A request whose connection broke is sent again (a "connection reset by peer" while the server is up and
    answering every other request ends no run). The client is made with max_retries 0, so an error the
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
    from .tasks_client import TasksClient, UploadRefused

    client = TasksClient(url)
    try:
        job = client.upload(task.name, task.train_body, method=args.method, config=cfg.to_dict(), force=args.force)
    except UploadRefused as e:
        raise SystemExit(str(e)) from None
    return client.follow(job["id"], label, gone=gone)


def _trained_skills(url: str) -> dict[str, dict[str, Any]]:
    """Skill name → the last job that trained it to the end, from the server's job records (they survive a
    restart): what a cut run finished."""
    from .tasks_client import TasksClient

    jobs = TasksClient(url).jobs()
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
