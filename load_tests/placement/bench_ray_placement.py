"""The placement trace of load_tests/placement/bench_placement.py replayed through a real local Ray Serve: skillpool's engine
deployment (server/cluster) with a stand-in engine per replica that sleeps per token and keeps bench_placement's
two adapter tiers (tests/server/cluster/tiered_engine.py), driven by the RemoteEngine an ingress uses.

The trace is bench_placement's generator (fixed seed), smaller: --requests requests over --skills skills, mixes of
1-3 skills whose first is the heaviest (weights 1; 0.6/0.4; 0.5/0.3/0.2); a request's output tokens are its service
time x --mean-tokens. Skills are real store versions (tiny adapters): a store fetch reads the files. Each has
router centroid keys on a smooth curve by rank (cosine 0.9 at 10 ranks apart, 0.5 at 25, below 0 at 50), so the
trace's mixes join skills that are near in that space, as the router's mixes do.

Runs, each on freshly started replicas:
1. affinity: --replicas replicas, requests keyed by the mix's heaviest skill (`name#vN`, Ray Serve's multiplexing),
   open loop at bench_placement's 70% of capacity (replicas x max_ongoing_requests / mean service time);
2. unkeyed: the same, no key (Ray's power-of-two router): the control;
3. group: as 1, keyed by the heaviest skill's neighbourhood of --group-size skills (`--affinity-group-size`);
4. throughput: closed loop at full concurrency (replicas x max_ongoing_requests clients, --throughput-requests
   per replica), 1 replica then --replicas: output tokens/s;
5. kill: the affinity run again; one engine replica is killed (ray.kill) at --kill-at of the trace; reported: the
   requests that failed (and how many of them started after the kill), and the seconds until the hit ratio of
   requests' heaviest skills (5 s windows) is back to 90% of its value in the 20 s before the kill.
Adapter loads (GPU-tier misses) are compared with bench_placement's simulation of the same trace, replicas and
tiers. The last line printed is one JSON object.

    .venv/bin/python -m load_tests.placement.bench_ray_placement [--requests 10000] [--skills 400] [--replicas 4]
        [--host-slots 200] [--group-size 32] [--gpu-tier slru|lru] [--runs affinity,unkeyed,group,throughput,kill]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from load_tests.placement import bench_placement as bp
from tests.server.cluster.ray_deployment import Deployment, Outcome, one
from tests.synthetic import curve_skills

WEIGHTS = {1: (1.0,), 2: (0.6, 0.4), 3: (0.5, 0.3, 0.2)}
RUNS = ("affinity", "unkeyed", "group", "throughput", "kill")


def requests(trace: bp.Trace, mean_tokens: int) -> list[tuple[dict[str, float], int]]:
    """Each request's mix and output tokens."""
    out = []
    for mix, service in zip(trace.mixes, trace.service):
        out.append(
            ({f"skill-{s:04d}": w for s, w in zip(mix, WEIGHTS[len(mix)])}, max(1, round(service * mean_tokens)))
        )
    return out


async def open_loop(dep: Deployment, reqs: list[tuple[dict[str, float], int]], gaps: list[float], rate: float,
                    kill_at: float | None = None) -> tuple[list[Outcome], dict[str, Any]]:  # fmt: skip
    """Requests at the trace's arrival times (gaps scaled to `rate`); optionally kill a replica at that time."""
    t0, at, tasks = time.perf_counter(), 0.0, []
    killed: dict[str, Any] = {}
    for i, ((mix, tokens), gap) in enumerate(zip(reqs, gaps)):
        at += gap / rate
        if kill_at is not None and not killed and at >= kill_at:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            running = {r: v["stats"].get("running", 0) for r, v in dep.replica_stats().items()}
            killed = {"t": time.perf_counter() - t0, "replica": await asyncio.to_thread(dep.kill_one)}
            killed["running_at_last_report"] = running.get(killed["replica"], 0)
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        tasks.append(asyncio.ensure_future(one(dep.engine, i, mix, tokens, t0)))
    return list(await asyncio.gather(*tasks)), killed


async def closed_loop(dep: Deployment, reqs: list[tuple[dict[str, float], int]], clients: int) -> float:
    """Output tokens per second with `clients` requests always in flight."""
    queue = list(enumerate(reqs))
    t0, done = time.perf_counter(), []

    async def client() -> None:
        while queue:
            i, (mix, tokens) = queue.pop(0)
            done.append(await one(dep.engine, i, mix, tokens, t0))

    await asyncio.gather(*(client() for _ in range(clients)))
    return sum(o.tokens for o in done) / (time.perf_counter() - t0)


def tally(outcomes: list[Outcome]) -> dict[str, float]:
    lookups = [t for o in outcomes for t in o.tiers]
    return {
        "failed": sum(not o.ok for o in outcomes),
        "loads": sum(t != "gpu" for t in lookups),
        "store_fetches": sum(t == "store" for t in lookups),
        "gpu_hit": round(sum(t == "gpu" for t in lookups) / max(1, len(lookups)), 4),
        "key_gpu_hit": round(sum(o.tiers[:1] == ["gpu"] for o in outcomes) / max(1, len(outcomes)), 4),
    }


def recovery(outcomes: list[Outcome], kill_t: float, window: float = 5.0) -> dict[str, float]:
    """The heaviest skills' GPU hit ratio in the 20 s before the kill, and the seconds after it until a `window`
    of requests (by start time) is back to 90% of that."""

    def ratio(lo: float, hi: float) -> float | None:
        xs = [o.tiers[0] == "gpu" for o in outcomes if o.ok and lo <= o.start < hi]
        return sum(xs) / len(xs) if len(xs) >= 10 else None

    steady = ratio(kill_t - 20, kill_t) or 0.0
    end = max(o.start for o in outcomes)
    t = kill_t
    while t + window <= end:
        r = ratio(t, t + window)
        if r is not None and r >= 0.9 * steady:
            return {"steady_key_gpu_hit": round(steady, 4), "recovery_s": round(t + window - kill_t, 1)}
        t += 1.0
    return {"steady_key_gpu_hit": round(steady, 4), "recovery_s": math.inf}


def simulated(trace: bp.Trace, args: argparse.Namespace, policy: str) -> dict[str, float]:
    """bench_placement's simulation of the same trace, replicas and tiers."""
    saved = (bp.GPU_SLOTS, bp.HOST_SLOTS, bp.MAX_ONGOING)
    bp.GPU_SLOTS, bp.HOST_SLOTS, bp.MAX_ONGOING = args.gpu_slots, args.host_slots, args.max_ongoing
    try:
        res = bp.simulate(trace, args.replicas, policy, args.seed, args.mux_slots, args.group_size, args.gpu_tier)
    finally:
        bp.GPU_SLOTS, bp.HOST_SLOTS, bp.MAX_ONGOING = saved
    return {"loads": res.lookups - res.gpu_hits, "store_fetches": res.fetches}


def report(
    runs: dict[str, dict[str, float]],
    tput: dict[str, float],
    outcomes: list[Outcome],
    killed: dict[str, Any],
    sim: dict[str, dict[str, float]],
    replicas: int,
) -> tuple[dict[str, Any], list[tuple[str, bool]]]:
    """The JSON result and the targets' checks, of the runs that were made."""
    result: dict[str, Any] = {}
    checks: list[tuple[str, bool]] = []
    aff, ctl, grp = runs.get("affinity"), runs.get("unkeyed"), runs.get("group")
    result["loads"] = {}
    for name, run in (("affinity", aff), ("group", grp)):
        if run is not None:
            over_sim = round(run["loads"] / max(1, sim[name]["loads"]), 3)
            result["loads"] |= {name: run["loads"], f"{name}_simulated": sim[name]["loads"], f"{name}_over_simulation": over_sim}  # fmt: skip
            checks.append((f"{name}: loads within 10% of the simulation", abs(over_sim - 1) <= 0.1))
    if ctl is not None:
        result["store_fetches"] = {"unkeyed": ctl["store_fetches"]}
        for name, run in (("affinity", aff), ("group", grp)):
            if run is not None:
                ratio = round(run["store_fetches"] / max(1, ctl["store_fetches"]), 3)
                result["store_fetches"] |= {name: run["store_fetches"], f"{name}_over_unkeyed": ratio}
                result["store_fetches"][f"{name}_simulated"] = sim[name]["store_fetches"]
                checks.append((f"{name}: store fetches <= 0.5x unkeyed", ratio <= 0.5))
    result["key_gpu_hit"] = {name: run["key_gpu_hit"] for name, run in runs.items()}
    result["gpu_hit"] = {name: run["gpu_hit"] for name, run in runs.items()}
    result["5xx"] = {name: run["failed"] for name, run in runs.items()}
    checks.append(("no 5xx", not any(result["5xx"].values())))
    if tput:
        result["tokens_per_s"] = {**tput, "ratio": round(tput[str(replicas)] / tput["1"], 2)}
        checks.append((f"tokens/s {replicas} replicas >= {0.8 * replicas:.1f}x one", result["tokens_per_s"]["ratio"] >= 0.8 * replicas))  # fmt: skip
    if killed:
        failed = [o for o in outcomes if not o.ok]
        kill = {
            "failed": len(failed),
            "failed_started_after_kill": sum(o.start > killed["t"] for o in failed),
            "running_on_killed_at_last_report": killed["running_at_last_report"],
            **recovery(outcomes, killed["t"]),
        }
        result["kill"] = kill
        checks.append(("after the kill only in-flight requests failed", kill["failed_started_after_kill"] == 0))
        checks.append(("hit ratio back to 90% within 30 s", kill["recovery_s"] <= 30))
    return result, checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--skills", type=int, default=400)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--gpu-slots", type=int, default=16, help="GPU-tier slots per replica (and its multiplexed keys)")
    ap.add_argument("--host-slots", type=int, default=200)
    ap.add_argument("--gpu-tier", choices=bp.GPU_TIERS, default=bp.GPU_TIERS[0], help="the GPU tier's eviction")
    ap.add_argument("--max-ongoing", type=int, default=32, help="max_ongoing_requests per replica")
    ap.add_argument("--mean-tokens", type=int, default=8, help="output tokens of a request of mean service time")
    ap.add_argument("--per-token-s", type=float, default=0.25, help="the stand-in engine's sleep per token")
    ap.add_argument(
        "--throughput-requests",
        type=int,
        default=500,
        help="per replica, in the closed-loop runs (100 measure mostly the ramp-up)",
    )
    ap.add_argument("--mux-slots", type=int, default=None, help="multiplexed keys a replica holds (default: GPU slots)")
    ap.add_argument("--kill-at", type=float, default=0.4, help="kill a replica at this share of the kill run's trace")
    ap.add_argument("--group-size", type=int, default=32, help="skills per neighbourhood in the group run")
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated, of " + ", ".join(RUNS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-cpus", type=int, default=2, help="the local Ray's CPUs")
    ap.add_argument("--verbose", action="store_true", help="show the replicas' logs")
    args = ap.parse_args(argv)
    args.mux_slots = args.mux_slots or args.gpu_slots
    need = (
        args.requests,
        args.skills - bp.NEIGHBOURS,
        args.replicas,
        args.gpu_slots,
        args.max_ongoing,
        args.group_size,
    )
    if min(need) < 1:
        raise SystemExit(
            "--requests, --replicas, --gpu-slots, --max-ongoing and --group-size take positive counts; --skills > 50"
        )
    chosen = [r for r in args.runs.split(",") if r]
    if not chosen or set(chosen) - set(RUNS):
        raise SystemExit(f"--runs: choose from {', '.join(RUNS)}")
    import os

    from skillpool.server.cluster.deployments import REPLICA_ENV

    for k, v in REPLICA_ENV.items():  # this process routes: Ray Serve reads these when it is imported
        os.environ.setdefault(k, v)
    import ray

    from skillpool.runtime.base_model import resolve_base_model

    args.tokenizer = resolve_base_model().path
    trace = bp.make_trace(args.requests, args.skills, args.seed)
    reqs = requests(trace, args.mean_tokens)
    rate = bp.LOAD * args.replicas * args.max_ongoing / (args.mean_tokens * args.per_token_s)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp)
        curve_skills(data, args.skills)
        ray.init(num_cpus=args.num_cpus, include_dashboard=False, namespace="skillpool", log_to_driver=args.verbose)
        runs: dict[str, Any] = {}
        tput: dict[str, float] = {}
        outcomes: list[Outcome] = []
        killed: dict[str, Any] = {}
        try:
            for name, keyed, size in (("affinity", True, 1), ("unkeyed", False, 1), ("group", True, args.group_size)):
                if name not in chosen:
                    continue
                dep = Deployment(args, data, args.replicas, keyed, size)
                got, _ = asyncio.run(open_loop(dep, reqs, trace.gaps, rate))
                runs[name] = tally(got)
                dep.close()
                print(f"{name}: {runs[name]}", flush=True)
            for n in (1, args.replicas) if "throughput" in chosen else ():
                dep = Deployment(args, data, n, True)
                tput[str(n)] = round(
                    asyncio.run(closed_loop(dep, reqs[: n * args.throughput_requests], n * args.max_ongoing)), 1
                )
                dep.close()
                print(f"tokens/s with {n} replica(s): {tput[str(n)]}", flush=True)
            if "kill" in chosen:
                dep = Deployment(args, data, args.replicas, True)
                kill_t = args.kill_at * sum(trace.gaps) / rate
                outcomes, killed = asyncio.run(open_loop(dep, reqs, trace.gaps, rate, kill_at=kill_t))
                dep.close()
        finally:
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    print(f"\n{args.requests} requests, {args.skills} skills, {args.replicas} replicas, {rate:.1f} req/s offered; "
          f"{time.perf_counter() - t_start:.0f} s")  # fmt: skip
    sim: dict[str, dict[str, float]] = {n: simulated(trace, args, n) for n in ("affinity", "group") if n in runs}
    result, checks = report(runs, tput, outcomes, killed, sim, args.replicas)
    for text, ok in checks:
        print(f"{'holds' if ok else 'MISSES'}: {text}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
