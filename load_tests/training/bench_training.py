"""Training speed as users meet it: the time from an upload to a registered skill, and the trainer's tokens/s and
steps/s, against the same measurement at an earlier commit, in one run on one machine.

Each side is a real `skillpool serve` process on a fresh data dir (the path `skillpool upload` takes: POST /tasks,
then the job's status until it ends, then /v1/models lists the skill). `--baseline REV` exports that commit with
`git archive` into a temporary folder laid out as the `skillpool` package and puts it first on PYTHONPATH for its
server, so that server imports the commit's code (each side prints the file its `skillpool.trainer.loop` comes
from). The sides take turns (`--rounds`), baseline first. Printed per side: seconds from upload to registered,
training seconds (the loop's own clock), optimizer steps, steps/s, tokens/s (prompt + answer tokens, padding not
counted) and the server's CPU seconds over the job (less sensitive than wall time to other work on the machine);
then the ratios new/baseline and one JSON line last:

    .venv/bin/python -m load_tests.training.bench_training [--rows 300] [--config '{"epochs": 2}'] [--baseline REV]
        [--task long_sequence/agnews] [--rounds 1] [--server-args='--dtype auto'] [--baseline-server-args='']
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from load_tests.common.datasets import rows
from skillpool.evaluation.tasks_client import FollowError, TasksClient, UploadRefused

REPO = Path(__file__).resolve().parent.parent
# the repository's folders that are the skillpool package's subpackages (pyproject's package-dir)
PACKAGES = ("runtime", "lora", "adapters_store", "router", "trainer", "server", "cli", "evaluation")


def export(rev: str, root: Path) -> Path:
    """`rev`'s tree as an importable `skillpool` package under `root`; returns the folder to put on PYTHONPATH."""
    pkg = root / "skillpool"
    pkg.mkdir(parents=True)
    listed = subprocess.run(
        ["git", "ls-tree", "--name-only", rev], cwd=REPO, capture_output=True, check=True, text=True
    )
    present = [p for p in PACKAGES if p in listed.stdout.split()]  # an earlier commit may predate a package
    archive = subprocess.run(["git", "archive", rev, *present], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(pkg)], input=archive, check=True)
    (pkg / "__init__.py").write_text("")  # a regular package: found on PYTHONPATH before the editable install
    return root


@contextmanager
def python_path(folder: Path | None) -> Iterator[None]:
    """PYTHONPATH with `folder` first while the block runs (a server started in it inherits it)."""
    old = os.environ.get("PYTHONPATH")
    if folder is not None:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), old) if p)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def imported_from() -> str:
    """The file `skillpool.trainer.loop` comes from for a child process started now."""
    code = "import skillpool.trainer.loop as m; print(m.__file__)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat, fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(side: str, body: bytes, config: dict[str, Any], server_args: list[str], root: Path) -> dict[str, Any]:
    """One upload through a fresh server: the times and rates of its job."""
    from skillpool.evaluation.process import ServerProcess

    source = imported_from()
    print(f"[{side}] skillpool.trainer.loop from {source}", flush=True)
    with ServerProcess(root / "data", server_args, log_path=root / "server.log") as srv:
        assert srv.proc is not None
        cpu0, t0 = cpu_seconds(srv.proc.pid), time.monotonic()
        tasks = TasksClient(srv.url)
        try:
            job = tasks.follow(
                tasks.upload("bench", body, config=config)["id"], progress=False, poll_s=0.5, gone=srv.exited
            )
        except (UploadRefused, FollowError) as e:
            raise SystemExit(f"[{side}] {e}") from None
        if job["status"] != "succeeded":
            raise SystemExit(f"[{side}] the job ended {job['status']}: {job.get('error')}")
        while "bench" not in [m["id"] for m in httpx.get(srv.url + "/v1/models", timeout=30).json()["data"]]:
            time.sleep(0.2)
        total_s, cpu_s = time.monotonic() - t0, cpu_seconds(srv.proc.pid) - cpu0
    p = job["progress"]
    train_s = p["tokens"] / p["tokens_per_s"]  # the loop's clock: from its start to its last step
    out = {
        "side": side,
        "source": source,
        "upload_to_registered_s": round(total_s, 2),
        "train_s": round(train_s, 2),
        "steps": p["total"],
        "steps_per_s": round(p["total"] / train_s, 4),
        "tokens_per_s": round(p["tokens_per_s"], 1),
        "tokens": p["tokens"],
        "server_cpu_s": round(cpu_s, 1),
        "gate_score": (job.get("eval") or {}).get("score"),
        "final_loss": p.get("loss"),
    }
    print(f"[{side}] {json.dumps(out)}", flush=True)
    return out


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("upload_to_registered_s", "train_s", "steps_per_s", "tokens_per_s", "server_cpu_s")
    med = {k: statistics.median(r[k] for r in runs) for k in keys}
    return {**med, "steps": runs[0]["steps"], "source": runs[0]["source"], "rounds": len(runs)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=300, help="training rows uploaded (the task's first N)")
    ap.add_argument("--task", default="long_sequence/agnews", help="GROUP/TASK under SKILLPOOL_DATASETS")
    ap.add_argument("--config", default='{"epochs": 2}', help="the upload's hyperparameters (JSON)")
    ap.add_argument("--baseline", default=None, help="a commit to compare with (e.g. HEAD); none: this tree only")
    ap.add_argument("--rounds", type=int, default=1, help="uploads a side, the sides taking turns")
    ap.add_argument("--server-args", default="", help="extra `skillpool serve` flags of this tree's server")
    ap.add_argument("--baseline-server-args", default="", help="extra `skillpool serve` flags of the baseline's")
    args = ap.parse_args()
    group, task = args.task.split("/", 1)
    body = "\n".join(json.dumps(r) for r in rows(group, task, "train", args.rows)).encode()
    config = json.loads(args.config)
    work = Path(tempfile.mkdtemp(prefix="skillpool-bench-training-"))
    sides: list[tuple[str, Path | None, list[str]]] = []
    if args.baseline:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", args.baseline], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        sides.append(
            (f"baseline {rev}", export(args.baseline, work / "baseline-src"), shlex.split(args.baseline_server_args))
        )
    sides.append(("new", None, shlex.split(args.server_args)))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in sides}
    for r in range(args.rounds):
        for name, folder, extra in sides:
            with python_path(folder):
                runs[name].append(measure(name, body, config, extra, work / f"{name.split()[0]}-{r}"))
    result: dict[str, Any] = {"rows": args.rows, "task": args.task, "config": config, "cpus": os.cpu_count()}
    result["sides"] = {name: summary(v) for name, v in runs.items()}
    print(f"\n{args.task}, {args.rows} rows, config {args.config}, {args.rounds} round(s), medians:")
    print(f"{'side':<18} {'upload→skill s':>15} {'train s':>9} {'steps':>6} {'steps/s':>8} {'tok/s':>8} {'CPU s':>8}")
    for name, s in result["sides"].items():
        print(
            f"{name:<18} {s['upload_to_registered_s']:>15.1f} {s['train_s']:>9.1f} {s['steps']:>6} "
            f"{s['steps_per_s']:>8.3f} {s['tokens_per_s']:>8.0f} {s['server_cpu_s']:>8.0f}"
        )
    if args.baseline:
        new, old = result["sides"]["new"], result["sides"][sides[0][0]]
        result["ratio_new_over_baseline"] = {
            k: round(new[k] / old[k], 3) for k in ("upload_to_registered_s", "train_s", "server_cpu_s")
        }
        ratios = result["ratio_new_over_baseline"]
        print(
            f"new / baseline: upload→skill {ratios['upload_to_registered_s']:.3f}×, training {ratios['train_s']:.3f}×, "
            f"server CPU {ratios['server_cpu_s']:.3f}×"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
