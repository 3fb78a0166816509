"""`auto` against what it routes to, for bench_serving: does routing cost the engine anything?

  - an empty pool: every `auto` request falls back to the base model (and is still embedded, to feed the
    demand clusters), so `auto` against plain base traffic is the routing stage's cost alone;
  - a 10-skill pool: `auto` against the same requests forced to the route `auto` gave each of them (read from
    its x-skillpool-route header), so both sides decode the same mixes.

Each comparison runs 1 client and then N closed-loop clients in interleaved rounds (A B B A ...) after a
discarded warm-up of `auto` over the same prompts (which also gives the routes the forced side sends). Every
run tags its prompts ("[a1] ...") so that no run reuses another's prompt KV from the prefix cache (on, the
server's default), while a run's prompts share their instructions' KV as users' prompts do. The
router's share of the server's CPU time comes from skillpool_router_cpu_seconds_total over /proc's count for
the whole server process, over the `auto` rounds, and their requests' mean routing wait (arrival at the routing
stage to route) from skillpool_routing_wait_seconds.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from load_tests.common.load import Load, summarize

Result = tuple[list[dict[str, float]], float]


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process, all its threads (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


ROUTER_METRICS = (
    "skillpool_router_cpu_seconds_total",
    "skillpool_routing_wait_seconds_sum",
    "skillpool_routing_wait_seconds_count",
)


def router_metrics(url: str) -> dict[str, float]:
    """The routing stage's CPU seconds and its requests' summed wait and count, from the server's /metrics."""
    found = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        name, _, value = line.partition(" ")
        if name in ROUTER_METRICS:
            found[name] = float(value)
    missing = [m for m in ROUTER_METRICS if m not in found]
    if missing:
        raise RuntimeError(f"the server exports no {missing[0]}")
    return found


def interleaved(
    load: Load,
    clients: int,
    per_client: int,
    prompts: list[str],
    sides: dict[str, Callable[[str], str]],
    rounds: int,
    pid: int,
    url: str,
    vary: float = 0.0,
) -> tuple[dict[str, Result], float, float]:
    """Rounds of every side (order flipped each round) after a warm-up of the first; each side's rounds pooled.
    Every side sends the same prompts, each run under a tag of its own ("[a1] ...") so that no run finds
    another run's prompt KV in the prefix cache, while prompts within a run share their instructions' KV as
    users' prompts do. `sides` maps a side's name to the model for an (untagged) prompt. Also returns the
    router's share of the server's CPU time during the `auto` rounds and their requests' mean routing wait
    (arrival to route, seconds). `vary` > 0: each prompt's answer length is drawn once (the same on every side)
    from load.max_tokens × [1 - vary, 1 + vary]."""
    rng = random.Random(1)
    lengths = [max(1, round(load.max_tokens * (1 + vary * (2 * rng.random() - 1)))) for _ in prompts]

    def pick(model: Callable[[str], str], tag: str) -> Callable[[int, int], tuple[str, str, int]]:
        def f(c: int, j: int) -> tuple[str, str, int]:
            i = (c * per_client + j) % len(prompts)
            return model(prompts[i]), f"[{tag}] {prompts[i]}", lengths[i]

        return f

    first = next(iter(sides))
    load.closed(clients, per_client, pick(sides[first], "w"))  # warm-up, not recorded
    parts: dict[str, list[Result]] = {name: [] for name in sides}
    cpu = 0.0
    routing = dict.fromkeys(ROUTER_METRICS, 0.0)
    for r in range(rounds):
        for i, name in enumerate(sides):
            if r % 2:
                name = list(sides)[len(sides) - 1 - i]
            c0, r0 = process_cpu_s(pid), router_metrics(url)
            tag = f"{'ab'[list(sides).index(name)]}{r + 1}"
            parts[name].append(load.closed(clients, per_client, pick(sides[name], tag)))
            if name.startswith("auto"):
                cpu += process_cpu_s(pid) - c0
                for k, v in router_metrics(url).items():
                    routing[k] += v - r0[k]
    pooled = {n: ([x for res, _ in p for x in res], sum((w for _, w in p), 0.0)) for n, p in parts.items()}
    cpu_share = routing[ROUTER_METRICS[0]] / cpu if cpu else 0.0
    n = routing[ROUTER_METRICS[2]]
    return pooled, cpu_share, routing[ROUTER_METRICS[1]] / n if n else 0.0


def auto_scenarios(
    server: Callable[[Path], Any],
    pools: dict[str, Path],
    prompts: list[str],
    clients: int,
    per_client: int,
    max_tokens: int,
    rounds: int,
    slo: tuple[float, float],
    counts: tuple[int, ...] | None = None,
    vary: float = 0.0,
) -> list[str]:
    """Runs the comparison of each pool ("empty pool": against base; any other: against `auto`'s routes forced);
    returns the table rows and ratio lines to print."""
    from openai import OpenAI

    out: list[str] = []
    stats: dict[str, dict[str, float]] = {}

    def record(name: str, res: Result, share: float | None = None, wait: float = 0.0) -> dict[str, float]:
        s = stats[name] = summarize(*res, *slo)
        tail = f", router {share:.1%} of server CPU, routing wait mean {wait * 1000:.0f}ms" if share is not None else ""
        out.append(
            f"  {name:46s} {s['n']:3.0f} {s['tok_s']:7.1f} tok/s, ttft p50 {s['ttft_p50']:.2f}s "
            f"p99 {s['ttft_p99']:.2f}s, itl p50 {s['itl_p50'] * 1000:.0f}ms{tail}"
        )
        print(out[-1], flush=True)
        return s

    for label, folder in pools.items():
        with server(folder) as srv:
            client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=900)
            load = Load(client, max_tokens)
            load.one("auto", prompts[-1])  # warm-up: loads the router and the engine

            def base_model(t: str) -> str:
                return "base"

            def auto_route(t: str, routes: dict[str, str] = load.routes) -> str:  # what auto gave it in the warm-up
                return routes[f"[w] {t}"]

            other = ("base", base_model) if label == "empty pool" else (f"forced to auto's routes, {label}", auto_route)
            sides: dict[str, Callable[[str], str]] = {f"auto, {label}": lambda t: "auto", other[0]: other[1]}
            for n in counts or (1, clients):
                res, share, wait = interleaved(load, n, per_client, prompts, sides, rounds, srv.proc.pid, srv.url, vary)
                auto, forced = list(sides)
                plural = "s" * (n > 1)
                stats[f"{label} auto {n}"] = record(f"{auto}, {n} client{plural}", res[auto], share, wait)
                stats[f"{label} other {n}"] = record(f"{forced}, {n} client{plural}", res[forced])
            if label != "empty pool":  # the forced side replays the warm-up's routes: how often auto chose them

                def skills(route: str) -> set[str]:
                    return {pair.split("=")[0] for pair in route.split(",")}

                warm = {k.split("] ", 1)[1]: v for k, v in load.routes.items() if k.startswith("[w] ")}
                same = [skills(v) == skills(warm[k.split("] ", 1)[1]]) for k, v in load.routes.items() if k[1] == "a"]
                out.append(
                    f"  {label}: auto's measured routes name the warm-up's skills (which forced replays) for "
                    f"{sum(same)}/{len(same)} requests"
                )
    out.append("ratios (same run):")
    if "empty pool" in pools:
        e1, e16, b16 = (stats[f"empty pool {k}"] for k in ("auto 1", f"auto {clients}", f"other {clients}"))
        out.append(
            f"  auto on an empty pool vs base, {clients} clients: tok/s {e16['tok_s'] / b16['tok_s']:.2f}x (target >= 0.95x), "
            f"TTFT p50 {e16['ttft_p50'] / b16['ttft_p50']:.2f}x (target <= 1.2x); "
            f"vs one auto client's TTFT p50 {e16['ttft_p50'] / e1['ttft_p50']:.2f}x (target <= 2x)"
        )
    for label in (x for x in pools if x != "empty pool"):
        p16, f16 = stats[f"{label} auto {clients}"], stats[f"{label} other {clients}"]
        out.append(
            f"  auto over the {label} vs the same routes forced, {clients} clients: tok/s {p16['tok_s'] / f16['tok_s']:.2f}x "
            f"(target >= 0.95x), TTFT p50 {p16['ttft_p50'] / f16['ttft_p50']:.2f}x (target <= 1.2x)"
        )
    return out
