"""Placement of skill mixes across N serving replicas: a trace-driven simulation of random, power-of-two and
skill-affinity routing, and what each does to the replicas' adapter caches.

A model of the workload, not a measurement of any serving system. The trace (fixed seed, shared by every N and
policy): --skills skills with Zipf popularity s=1.1 by rank; each request a mix of 1, 2 or 3 skills (probabilities
0.5/0.3/0.2) whose first skill is drawn by popularity and is the mix's heaviest, the others drawn uniformly and
distinct from the 50 ranks nearest the first (a window of 51 ranks around it, clipped at the ends, less itself);
Poisson arrivals at 70% of the replicas' total capacity (N x max_ongoing_requests / mean service time); service
time exponential with mean 1, independent of the mix. Each replica admits at most max_ongoing_requests (32) at a
time and keeps two tiers: 64 GPU slots and 1,024 host slots (LRU). Every skill of a mix is looked up on the
replica the request starts on: in the GPU tier it is a GPU hit; else in the host tier a host hit (it moves into
the GPU tier, evicting one); else a store fetch (it enters both). A lookup refreshes the skill in each tier that
holds it. The GPU tier evicts as the engines do (--gpu-tier slru: server/engines/slru.py, a segmented LRU whose
second use of a resident skill protects it), or by plain LRU (--gpu-tier lru).

Policies (a replica is full at max_ongoing_requests; a full one is never chosen, as Ray Serve's replicas reject
requests past max_ongoing_requests and its router retries):
- random: uniform over the replicas that are not full (Ray's random router, retried until one accepts).
- pow2: two distinct replicas at random, the less loaded of those not full; a fresh pair while both are full.
- affinity: Ray Serve's model multiplexing (``@serve.multiplexed``, ``multiplexed_model_id``) keyed by the request's
  heaviest skill, as Ray's router does it (MultiplexMixin.apply_multiplex_routing): a replica "holds" the ids its
  loader loaded, an LRU of ``max_num_models_per_replica`` (--mux-slots, default the GPU slots; keys only, apart
  from the engine's tiers). A request goes to the least loaded replica holding its key (Ray: the less loaded of two
  holders at random; the same for one or two). When none holds it or all holders are full, it spills to the least
  loaded of the replicas holding the fewest ids (Ray's fallback after a rejection, well inside the 1-2 s matching
  timeout), which then holds the key. Id sets reach the router at once (Ray pushes them asynchronously).
- group: affinity keyed by the heaviest skill's neighbourhood, as the server keys with --affinity-group-size
  (server/cluster/groups.py, --group-size skills a group), of vectors on a smooth curve by rank
  (tests/synthetic.py `directions`: cosine 0.9 at 10 ranks apart, below 0 at 50), so a mix's skills are near.
- partition: a bound, not a router: the GPU slots x N most popular skills are packed by popularity onto the
  replicas, the rest go by windows of 64 ranks in turn; a request goes to its heaviest skill's replica unless it
  is full (then the least loaded). It knows the ranks, which no router does.
A request that finds every replica full waits in one FIFO queue at the router; when a request completes, the
queue's head starts on the replica that freed the slot (the only one with room). Ray's FIFO router may instead
hand that slot to a queued request whose model id matches; we do not model that.

Reported per N and policy: gpu_hit (share of skill lookups served by the GPU tier), host_hit, store_fetch_rate
(store fetches per request), key_gpu_hit (share of requests whose heaviest skill was in the GPU tier),
busiest_over_mean (the busiest replica's served requests over the mean) and queued (share of requests that
waited for a slot). The last line printed is one JSON object {"N": {"8": {"random": {...}, ...}, ...}}.

    .venv/bin/python -m load_tests.placement.bench_placement [--requests 200000] [--skills 10000] [--replicas 4,8,16]
        [--seed 0] [--policies random,pow2,affinity,group,partition] [--mux-slots 64] [--group-size 64]
        [--gpu-tier slru|lru]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from load_tests.placement.skill_vectors import group_keys
from skillpool.server.engines.slru import SegmentedLRU

ZIPF_S = 1.1
MIX_SIZES = (1, 2, 3)
MIX_PROBS = (0.5, 0.3, 0.2)
NEIGHBOURS = 50
GPU_SLOTS = 64
HOST_SLOTS = 1024
MAX_ONGOING = 32
LOAD = 0.7
POLICIES = ("random", "pow2", "affinity", "group", "partition")
WINDOW = 64  # ranks per tail block (partition)
GROUP_SIZE = 64  # skills per neighbourhood (group)
GPU_TIERS = ("slru", "lru")  # the GPU tier's eviction: the engines' segmented LRU, or plain LRU
KEYS = ("gpu_hit", "store_fetch_rate", "busiest_over_mean")  # the JSON line's fields
Results = dict[str, dict[str, dict[str, float]]]  # N -> policy -> figure -> value


@dataclass
class Trace:
    """Requests in arrival order: unit inter-arrival gaps (scaled by the rate per N), service times, mixes."""

    gaps: list[float]
    service: list[float]
    mixes: list[tuple[int, ...]]
    skills: int  # ranks 0 .. skills - 1


def make_trace(requests: int, skills: int, seed: int) -> Trace:
    if skills < NEIGHBOURS + 1:
        raise SystemExit(f"--skills must be at least {NEIGHBOURS + 1}")
    rng = np.random.default_rng(seed)
    weights = np.arange(1, skills + 1, dtype=np.float64) ** -ZIPF_S
    first = rng.choice(skills, size=requests, p=weights / weights.sum())
    size = rng.choice(np.array(MIX_SIZES), size=requests, p=np.array(MIX_PROBS))
    # Two distinct offsets into the 50 neighbours: the second skips the first.
    o1 = rng.integers(0, NEIGHBOURS, size=requests)
    o2 = rng.integers(0, NEIGHBOURS - 1, size=requests)
    o2 = o2 + (o2 >= o1)
    start = np.clip(first - NEIGHBOURS // 2, 0, skills - NEIGHBOURS - 1)

    def neighbour(offset: np.ndarray) -> np.ndarray:
        rank = start + offset
        return rank + (rank >= first)  # the window less the first skill itself

    s2, s3 = neighbour(o1), neighbour(o2)
    mixes: list[tuple[int, ...]] = []
    for f, n, a, b in zip(first.tolist(), size.tolist(), s2.tolist(), s3.tolist(), strict=True):
        mixes.append((f,) if n == 1 else (f, a) if n == 2 else (f, a, b))
    gaps = rng.exponential(1.0, size=requests).tolist()
    service = rng.exponential(1.0, size=requests).tolist()
    return Trace(gaps=gaps, service=service, mixes=mixes, skills=skills)


@dataclass
class Replica:
    gpu: SegmentedLRU[int]
    host: OrderedDict[int, None] = field(default_factory=OrderedDict)
    keys: OrderedDict[int, None] = field(default_factory=OrderedDict)  # the multiplexed model ids it holds
    load: int = 0
    served: int = 0


@dataclass
class Result:
    replicas: int
    policy: str
    requests: int
    lookups: int = 0
    gpu_hits: int = 0
    host_hits: int = 0
    fetches: int = 0
    key_gpu_hits: int = 0
    queued: int = 0
    dispatches: int = 0
    served: list[int] = field(default_factory=list)
    assigned: list[int] = field(default_factory=list)  # the replica each request ran on

    def summary(self) -> dict[str, float]:
        mean = sum(self.served) / len(self.served)
        return {
            "gpu_hit": round(self.gpu_hits / self.lookups, 4),
            "host_hit": round(self.host_hits / self.lookups, 4),
            "store_fetch_rate": round(self.fetches / self.requests, 4),
            "key_gpu_hit": round(self.key_gpu_hits / self.requests, 4),
            "busiest_over_mean": round(max(self.served) / mean, 4),
            "queued": round(self.queued / self.requests, 4),
        }


class Simulation:
    def __init__(
        self,
        trace: Trace,
        replicas: int,
        policy: str,
        seed: int,
        mux_slots: int = GPU_SLOTS,
        groups: tuple[int, ...] | None = None,
        gpu_tier: str = GPU_TIERS[0],
    ) -> None:
        """`groups`: each rank's group key (group_keys), for the group policy."""
        if gpu_tier not in GPU_TIERS:
            raise SystemExit(f"unknown GPU tier {gpu_tier!r}: choose from {', '.join(GPU_TIERS)}")
        if policy not in POLICIES:
            raise SystemExit(f"unknown policy {policy!r}: choose from {', '.join(POLICIES)}")
        if policy == "group" and groups is None:
            raise ValueError("the group policy needs each skill's group (group_keys)")
        self.trace, self.groups = trace, groups
        self.policy = policy
        self.mux_slots = mux_slots
        capacity = GPU_SLOTS if gpu_tier == "slru" else None  # no capacity: nothing protected, plain LRU
        self.reps = [Replica(SegmentedLRU(capacity)) for _ in range(replicas)]
        self.holders: dict[int, set[int]] = {}
        self.rng = random.Random(seed * 1_000_003 + replicas * 101 + POLICIES.index(policy))
        self.result = Result(replicas=replicas, policy=policy, requests=len(trace.mixes))
        self.result.assigned = [-1] * len(trace.mixes)
        self.home = self._packed(replicas) if policy == "partition" else {}

    @staticmethod
    def _packed(replicas: int) -> dict[int, int]:
        """partition: the most popular ranks, heaviest first, each onto the replica with the least weight so far."""
        weight = [0.0] * replicas
        home = {}
        for rank in range(GPU_SLOTS * replicas):
            idx = min(range(replicas), key=weight.__getitem__)
            home[rank] = idx
            weight[idx] += (rank + 1) ** -ZIPF_S
        return home

    def key(self, skill: int) -> int:
        """The multiplexed model id of a request whose heaviest skill is `skill`."""
        if self.policy == "group":
            assert self.groups is not None
            return self.groups[skill]
        return skill

    def open_replicas(self) -> list[int]:
        return [i for i, r in enumerate(self.reps) if r.load < MAX_ONGOING]

    def least_loaded(self, candidates: list[int]) -> int:
        low = min(self.reps[i].load for i in candidates)
        return self.rng.choice([i for i in candidates if self.reps[i].load == low])

    def choose(self, key: int, open_: list[int]) -> int:
        if self.policy == "random":
            return self.rng.choice(open_)
        n = len(self.reps)
        if self.policy == "pow2":
            while True:
                a = self.rng.randrange(n)
                b = self.rng.randrange(n - 1) if n > 1 else a
                pair = [a] if n == 1 else [a, b + (b >= a)]
                ok = [i for i in pair if self.reps[i].load < MAX_ONGOING]
                if ok:
                    return self.least_loaded(ok)
        if self.policy == "partition":
            home = self.home.get(key, (key // WINDOW) % n)
            return home if self.reps[home].load < MAX_ONGOING else self.least_loaded(open_)
        key = self.key(key)
        holding = [i for i in self.holders.get(key, ()) if self.reps[i].load < MAX_ONGOING]
        if holding:
            return self.least_loaded(holding)
        fewest = min(len(self.reps[i].keys) for i in open_)
        return self.least_loaded([i for i in open_ if len(self.reps[i].keys) == fewest])

    def hold_key(self, idx: int, key: int) -> None:
        keys = self.reps[idx].keys
        if key in keys:
            keys.move_to_end(key)
            return
        keys[key] = None
        self.holders.setdefault(key, set()).add(idx)
        if len(keys) > self.mux_slots:
            old, _ = keys.popitem(last=False)
            self.holders[old].discard(idx)

    def lookup(self, rep: Replica, skill: int) -> bool:
        """One skill against the replica's tiers; True when the GPU tier had it."""
        res = self.result
        res.lookups += 1
        gpu, host = rep.gpu, rep.host
        if skill in gpu:
            gpu.touch(skill)
            if skill in host:
                host.move_to_end(skill)
            res.gpu_hits += 1
            return True
        if skill in host:
            host.move_to_end(skill)
            res.host_hits += 1
        else:
            res.fetches += 1
            host[skill] = None
            if len(host) > HOST_SLOTS:
                host.popitem(last=False)
        gpu.touch(skill)
        if len(gpu) > GPU_SLOTS and (victim := gpu.first()) is not None:
            gpu.discard(victim)
        return False

    def start(self, req: int, idx: int, now: float, done: list[tuple[float, int, int]]) -> None:
        res = self.result
        if res.assigned[req] != -1:
            raise AssertionError(f"request {req} started twice")
        res.assigned[req] = idx
        res.dispatches += 1
        rep = self.reps[idx]
        rep.load += 1
        rep.served += 1
        mix = self.trace.mixes[req]
        if self.policy in ("affinity", "group"):
            self.hold_key(idx, self.key(mix[0]))
        for j, skill in enumerate(mix):
            if self.lookup(rep, skill) and j == 0:
                res.key_gpu_hits += 1
        heapq.heappush(done, (now + self.trace.service[req], req, idx))

    def run(self) -> Result:
        n = len(self.reps)
        rate = LOAD * n * MAX_ONGOING  # mean service time 1
        done: list[tuple[float, int, int]] = []
        waiting: deque[int] = deque()
        now = 0.0

        def finish_until(t: float) -> None:
            while done and done[0][0] <= t:
                end, _, idx = heapq.heappop(done)
                self.reps[idx].load -= 1
                if waiting:
                    self.start(waiting.popleft(), idx, end, done)

        for req, gap in enumerate(self.trace.gaps):
            now += gap / rate
            finish_until(now)
            open_ = self.open_replicas()
            if open_:
                self.start(req, self.choose(self.trace.mixes[req][0], open_), now, done)
            else:
                self.result.queued += 1
                waiting.append(req)
        finish_until(float("inf"))
        self.result.served = [r.served for r in self.reps]
        return self.result


def simulate(
    trace: Trace,
    replicas: int,
    policy: str,
    seed: int,
    mux_slots: int = GPU_SLOTS,
    group_size: int = GROUP_SIZE,
    gpu_tier: str = GPU_TIERS[0],
) -> Result:
    groups = group_keys(trace.skills, group_size) if policy == "group" else None
    return Simulation(trace, replicas, policy, seed, mux_slots, groups, gpu_tier).run()


def run_all(
    trace: Trace,
    replicas: list[int],
    policies: list[str],
    seed: int,
    mux_slots: int = GPU_SLOTS,
    group_size: int = GROUP_SIZE,
    gpu_tier: str = GPU_TIERS[0],
) -> Results:
    return {
        str(n): {p: simulate(trace, n, p, seed, mux_slots, group_size, gpu_tier).summary() for p in policies}
        for n in replicas
    }


def table(n: str, rows: dict[str, dict[str, float]]) -> str:
    cols = ("gpu_hit", "host_hit", "store_fetch_rate", "key_gpu_hit", "busiest_over_mean", "queued")
    lines = [f"N={n} replicas", "| policy | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for policy, row in rows.items():
        lines.append(f"| {policy} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |")
    return "\n".join(lines)


def targets(results: Results) -> list[tuple[str, bool]]:
    checks: list[tuple[str, bool]] = []
    at8 = results.get("8", {})
    for policy in ("affinity", "group"):
        if "random" not in at8 or policy not in at8:
            continue
        rnd, aff = at8["random"], at8[policy]
        ratio = aff["gpu_hit"] / rnd["gpu_hit"]
        checks.append((f"N=8 {policy} gpu_hit >= 1.6x random ({ratio:.2f}x)", ratio >= 1.6))
        fetch = aff["store_fetch_rate"] / rnd["store_fetch_rate"]
        checks.append((f"N=8 {policy} store_fetch_rate <= 0.5x random ({fetch:.2f}x)", fetch <= 0.5))
        busy = aff["busiest_over_mean"]
        checks.append((f"N=8 {policy} busiest_over_mean <= 1.15 ({busy:.3f})", busy <= 1.15))
    if all(k in results and "affinity" in results[k] for k in ("4", "8", "16")):
        hits = [results[k]["affinity"]["gpu_hit"] for k in ("4", "8", "16")]
        text = " < ".join(f"{h:.3f}" for h in hits)
        checks.append((f"affinity gpu_hit rises N=4 -> 8 -> 16 ({text})", hits[0] < hits[1] < hits[2]))
    return checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=200_000)
    ap.add_argument("--skills", type=int, default=10_000)
    ap.add_argument("--replicas", default="4,8,16", help="comma-separated replica counts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated, of " + ", ".join(POLICIES))
    ap.add_argument("--mux-slots", type=int, default=GPU_SLOTS, help="affinity: model ids a replica holds (its LRU)")
    ap.add_argument("--group-size", type=int, default=GROUP_SIZE, help="group: skills per neighbourhood")
    ap.add_argument("--gpu-tier", choices=GPU_TIERS, default=GPU_TIERS[0], help="the GPU tier's eviction")
    args = ap.parse_args(argv)
    replicas = [int(x) for x in args.replicas.split(",") if x]
    policies = [p for p in args.policies.split(",") if p]
    if not replicas or min(replicas) < 1 or min(args.mux_slots, args.requests, args.group_size) < 1:
        raise SystemExit("--replicas, --mux-slots, --group-size and --requests take positive counts")
    t0 = time.perf_counter()
    trace = make_trace(args.requests, args.skills, args.seed)
    results = run_all(trace, replicas, policies, args.seed, args.mux_slots, args.group_size, args.gpu_tier)
    print(
        f"{args.requests} requests, {args.skills} skills, Zipf s={ZIPF_S}, seed {args.seed}; per replica "
        f"{GPU_SLOTS} GPU ({args.gpu_tier}) / {HOST_SLOTS} host slots, max_ongoing_requests {MAX_ONGOING}, load {LOAD:.0%}; "
        f"affinity's model-id LRU {args.mux_slots}; groups of {args.group_size}"
    )
    for n, rows in results.items():
        print()
        print(table(n, rows))
    checks = targets(results)
    if checks:
        print()
        for text, ok in checks:
            print(f"{'holds' if ok else 'MISSES'}: {text}")
    print(f"\n{time.perf_counter() - t0:.1f} s")
    print(json.dumps({"N": {n: {p: {k: r[k] for k in KEYS} for p, r in rows.items()} for n, rows in results.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
