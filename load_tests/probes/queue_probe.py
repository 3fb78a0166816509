"""Probe how RQ 3.0.0 recovers a training job when its worker dies (evidence for docs/design/decisions.md).

RQ is the closest library to our own Redis protocol (trainer/jobs/redis_queue.py), so this checks, against real
processes, the numbers that decided against it. Four scenarios run side by side, each with its own
redis-server, RQ fork `Worker`s and sleep-only jobs (no CPU load), all enqueued with `job_timeout=-1` and
`Retry(max=2)`:

  a  default worker settings: SIGKILL the busy worker and its work horse mid-job; seconds until a second,
     idle worker restarts the job (capped at --cap-a; RQ's code says ~810 s, see the docs).
  b  the same with worker_ttl=30, job_monitoring_interval=5, maintenance_interval=5.
  c  SIGKILL of the worker's parent process only: does the work horse (own process group) keep running?
  d  an 80 s job under job_monitoring_interval=5 (heartbeat TTL 65 s) next to an idle worker that does
     maintenance every 5 s: how many times is it started?

RQ is never imported into skillpool's venv. The probe makes (if missing) a throwaway venv at --venv with
`pip install rq==3.0.0 redis` and runs the workers and enqueues there; it talks to Redis with redis-py only.
It takes about 3.5 minutes and needs `redis-server` on PATH.

    .venv/bin/python -m load_tests.probes.queue_probe --venv /tmp/qv
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

RQ_VERSION = "3.0.0"
JOB_S = 120  # the job in a and b: long enough that only a restart can start it a second time
TUNED = {"worker_ttl": 30, "job_monitoring_interval": 5, "maintenance_interval": 5}

# Runs in the throwaway venv: one sleep-only job that records each start and end in Redis.
JOBS_PY = """
import json, os, time
import redis
R = redis.Redis(port=int(os.environ["PROBE_REDIS_PORT"]))
def sleeper(key, seconds):
    R.rpush("probe:starts:" + key, json.dumps({"t": time.time(), "pid": os.getpid(), "ppid": os.getppid()}))
    end = time.time() + seconds
    while time.time() < end:
        time.sleep(0.5)
    R.rpush("probe:ends:" + key, json.dumps({"t": time.time(), "pid": os.getpid()}))
    return "ok"
"""

# Runs in the throwaway venv: `worker NAME [k=v ...]` starts an RQ fork Worker (RQ defaults unless given);
# `enqueue KEY SECONDS` enqueues probe_jobs.sleeper with no job timeout and two retries.
RQ_PY = """
import os, sys
import redis
from rq import Queue, Retry, Worker
r = redis.Redis(port=int(os.environ["PROBE_REDIS_PORT"]))
q = Queue("train", connection=r)
if sys.argv[1] == "worker":
    kw = {k: int(v) for k, v in (a.split("=") for a in sys.argv[3:])}
    Worker([q], connection=r, name=sys.argv[2], **kw).work(with_scheduler=False)
else:
    q.enqueue("probe_jobs.sleeper", sys.argv[2], int(sys.argv[3]), job_id=sys.argv[2], job_timeout=-1,
              retry=Retry(max=2))
"""


@dataclass
class Result:
    scenario: str
    setup: str
    outcome: str


def ensure_venv(venv: Path) -> Path:
    """The venv's python, with rq==RQ_VERSION and redis installed (created on first use)."""
    py = venv / "bin" / "python"
    if not py.exists():
        print(f"creating {venv} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = subprocess.run([str(py), "-c", "import rq; print(rq.__version__)"], capture_output=True, text=True)
    if probe.returncode != 0 or probe.stdout.strip() != RQ_VERSION:
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"rq=={RQ_VERSION}", "redis"], check=True)
    return py


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(cond: Callable[[], bool], timeout: float, step: float = 0.25) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
    return None if fields[0] == "Z" else int(fields[1])


class Lab:
    """One redis-server plus the RQ processes of one scenario; everything it started dies with it."""

    def __init__(self, py: Path, workdir: Path, tag: str) -> None:
        self.py, self.dir, self.tag = py, workdir / tag, tag
        self.dir.mkdir()
        self.port = free_port()
        self.env = {**os.environ, "PROBE_REDIS_PORT": str(self.port), "PYTHONPATH": str(workdir)}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.horses: list[int] = []
        self._spawn(["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no"], "redis")
        self.r = redis.Redis(port=self.port, decode_responses=True)
        if not wait_for(self._pings, 10):
            raise RuntimeError(f"redis-server on port {self.port} did not start")

    def _pings(self) -> bool:
        try:
            return bool(self.r.ping())
        except redis.ConnectionError:
            return False

    def _spawn(self, cmd: list[str], log: str) -> subprocess.Popen[bytes]:
        out = open(self.dir / f"{log}.log", "wb")  # noqa: SIM115  # closed with the process
        p = subprocess.Popen(
            cmd, cwd=self.dir, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.procs.append(p)
        return p

    def worker(self, name: str, settings: dict[str, int] | None = None) -> subprocess.Popen[bytes]:
        args = [f"{k}={v}" for k, v in (settings or {}).items()]
        p = self._spawn([str(self.py), str(self.dir.parent / "probe_rq.py"), "worker", name, *args], name)
        if not wait_for(lambda: self.r.sismember("rq:workers", f"rq:worker:{name}") == 1, 30):
            raise RuntimeError(f"{self.tag}: worker {name} did not register (see {self.dir}/{name}.log)")
        return p

    def enqueue(self, key: str, seconds: int) -> None:
        cmd = [str(self.py), str(self.dir.parent / "probe_rq.py"), "enqueue", key, str(seconds)]
        subprocess.run(cmd, env=self.env, check=True, capture_output=True)

    def starts(self, key: str) -> list[dict[str, float]]:
        return [json.loads(x) for x in self.r.lrange(f"probe:starts:{key}", 0, -1)]

    def ends(self, key: str) -> list[dict[str, float]]:
        return [json.loads(x) for x in self.r.lrange(f"probe:ends:{key}", 0, -1)]

    def first_start(self, key: str, timeout: float = 30) -> dict[str, float]:
        if not wait_for(lambda: len(self.starts(key)) >= 1, timeout):
            raise RuntimeError(f"{self.tag}: job {key} never started")
        start = self.starts(key)[0]
        self.horses.append(int(start["pid"]))
        return start

    def close(self) -> None:
        for pid in self.horses:  # work horses live in their own process groups (os.setpgrp in RQ)
            kill_group(pid)
        for p in reversed(self.procs):
            kill_group(p.pid)
            p.wait()


@contextmanager
def lab(py: Path, workdir: Path, tag: str) -> Iterator[Lab]:
    lb = Lab(py, workdir, tag)
    try:
        yield lb
    finally:
        lb.close()


def restart_after_kill(lb: Lab, settings: dict[str, int] | None, cap_s: float) -> str:
    """Kill a busy worker and its horse (parent first, so it cannot fail the job itself); time the restart."""
    a = lb.worker("wa", settings)
    start = lb.first_start("job")
    lb.worker("wb", settings)  # idle: started after the job was taken, so only a recovery can give it the job
    time.sleep(3)
    kill_group(a.pid)
    kill_group(int(start["pid"]))
    killed = time.time()
    if wait_for(lambda: len(lb.starts("job")) >= 2, cap_s, step=0.5):
        again = lb.starts("job")[1]
        lb.horses.append(int(again["pid"]))
        return f"restarted {again['t'] - killed:.0f} s after the kill"
    return f"not restarted within {cap_s:.0f} s"


def scenario_a(py: Path, workdir: Path, cap_s: float) -> Result:
    with lab(py, workdir, "a") as lb:
        lb.enqueue("job", JOB_S * 10)
        outcome = restart_after_kill(lb, None, cap_s)
    return Result("a SIGKILL worker+horse", "RQ defaults (ttl 420, monitor 30, maint 600)", outcome)


def scenario_b(py: Path, workdir: Path) -> Result:
    with lab(py, workdir, "b") as lb:
        lb.enqueue("job", JOB_S)
        outcome = restart_after_kill(lb, TUNED, cap_s=JOB_S)
    return Result("b SIGKILL worker+horse", "ttl 30, monitor 5, maint 5", outcome)


def scenario_c(py: Path, workdir: Path) -> Result:
    seconds = 20
    with lab(py, workdir, "c") as lb:
        lb.enqueue("job", seconds)
        a = lb.worker("wa", TUNED)
        start = lb.first_start("job")
        horse = int(start["pid"])
        time.sleep(2)
        kill_group(a.pid)  # the parent's group only: the horse called os.setpgrp()
        time.sleep(2)
        ppid = parent_of(horse)
        orphan = ppid is not None and ppid != a.pid
        finished = wait_for(lambda: len(lb.ends("job")) >= 1, seconds + 10, step=0.5)
        status = str(lb.r.hget("rq:job:job", "status"))
    if not orphan:
        return Result("c SIGKILL parent only", "ttl 30, monitor 5, maint 5", "orphan: no (horse died with parent)")
    ran = f"ran to its end (job status {status})" if finished else "did not finish"
    return Result("c SIGKILL parent only", "ttl 30, monitor 5, maint 5", f"orphan: yes (ppid {ppid}), {ran}")


def scenario_d(py: Path, workdir: Path) -> Result:
    seconds = 80
    with lab(py, workdir, "d") as lb:
        lb.enqueue("job", seconds)
        lb.worker("wa", TUNED)
        lb.first_start("job")
        lb.worker("wb", TUNED)
        finished = wait_for(lambda: len(lb.ends("job")) >= 1, seconds + 30, step=1)
        time.sleep(2)
        starts, ends = len(lb.starts("job")), len(lb.ends("job"))
    done = "finished" if finished else "did not finish"
    return Result(
        f"d {seconds} s job, live worker",
        "monitor 5 (heartbeat TTL 65 s), idle worker maint 5",
        f"started {starts}x, ended {ends}x ({done})",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--venv", type=Path, default=Path(tempfile.gettempdir()) / "queue_probe_venv")
    ap.add_argument("--cap-a", type=float, default=180.0, help="seconds to wait for the restart in scenario a")
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("redis-server is not on PATH")
    py = ensure_venv(args.venv)
    workdir = Path(tempfile.mkdtemp(prefix="queue_probe_"))
    (workdir / "probe_jobs.py").write_text(JOBS_PY)
    (workdir / "probe_rq.py").write_text(RQ_PY)
    print(f"rq {RQ_VERSION} in {args.venv}; logs in {workdir}", flush=True)

    runs: dict[str, Callable[[], Result]] = {
        "a": lambda: scenario_a(py, workdir, args.cap_a),
        "b": lambda: scenario_b(py, workdir),
        "c": lambda: scenario_c(py, workdir),
        "d": lambda: scenario_d(py, workdir),
    }
    results: dict[str, Result] = {}
    lock = threading.Lock()

    def run(tag: str, fn: Callable[[], Result]) -> None:
        try:
            res = fn()
        except Exception as e:  # one broken scenario must not hide the others
            res = Result(tag, "-", f"error: {e}")
        with lock:
            results[tag] = res
            print(f"{res.scenario}: {res.outcome}", flush=True)

    t0 = time.monotonic()
    threads = [threading.Thread(target=run, args=(tag, fn)) for tag, fn in runs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    table = [("scenario", "settings", "result")] + [
        (r.scenario, r.setup, r.outcome) for r in map(results.get, runs) if r
    ]
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    took = time.monotonic() - t0
    print(
        f"\nRQ {RQ_VERSION} probe, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, {took:.0f} s"
    )
    for n, row in enumerate(table):
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


if __name__ == "__main__":
    main()
