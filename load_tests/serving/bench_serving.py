"""Serving benchmark in the manner of `vllm bench serve`, every scenario measured in one run.

Writes synthetic skills (random LoRA blocks; router keys from real SuperNI task inputs) into fresh stores, starts
`skillpool serve`, and streams prompts from the datasets SKILLPOOL_DATASETS names through the openai client:
  - base model, 1 closed-loop client, then N closed-loop clients (continuous batching);
  - N clients, every request an explicit k=3 mix, all different (per-row adapters);
  - base model at Poisson request rates (open loop);
  - `auto` routing over a 10-skill pool;
  - `auto` against what it routes to (load_tests/serving/serving_auto.py): on an empty pool against base traffic, over
    the 10-skill pool against the same requests forced to `auto`'s routes, at 1 and N clients (--only auto);
  - one skill per request, drawn by Zipf popularity, from a 10-skill pool (all resident) and from a
    1,000-skill pool served with --max-loaded-skills 16 (the others load from the store on use); with the hf
    engine both again with prefix caching off (--only pools runs these alone): a prompt start is cached per
    skill, so a big pool's requests reuse fewer, and the like-for-like ratio is the engine's own price for one.
Reports TTFT p50/p99, inter-token latency p50/p99, end-to-end p50, output tokens/s, goodput under an SLO
(the share of requests meeting both TTFT and ITL bounds, and their tokens/s), the server's resident memory, and
the same-run ratios against their targets (N clients vs 1, mixes vs base, big pool vs small). Answers decode
exactly --max-tokens (ignore_eos). The last line is one JSON object per engine of those ratios:
{"engine", "tokens_16_over_1", "ttft_16_over_1", "mixes_over_base" (caching off where that round ran),
"big_pool_over_small" (caching off on both where that round ran), "big_pool_over_small_cached"}; --only pools
gives the last two.

    .venv/bin/python -m load_tests.serving.bench_serving [--engine hf,vllm] [--only all|core|auto|pools] [--clients 16] [--max-tokens 64] [--rates 1,2] [--big-pool 1000]
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from load_tests.common.datasets import rows, user_text
from load_tests.common.load import GROUP, TASKS, Load, make_skills, summarize
from load_tests.common.memory import rss_mib
from load_tests.serving.serving_auto import auto_scenarios


def like_for_like(flags: list[str]) -> list[str]:
    """The server of the base-against-mixes rounds: prefix caching off, since a mix cannot reuse the base model's
    prompt KV (a LoRA on k/v changes it) and all-different mixes share none among themselves."""
    return [*flags, "--prefix-cache-tokens", "0"]


def main() -> int:
    import httpx
    from openai import OpenAI

    from skillpool.evaluation.process import ServerProcess

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="hf", help="one engine or several, each measured in turn: hf,vllm")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--per-client", type=int, default=4, help="requests per closed-loop client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rates", default="1,2", help="Poisson request rates (req/s), base model")
    ap.add_argument("--poisson-requests", type=int, default=24)
    ap.add_argument("--skills", type=int, default=10)
    ap.add_argument("--big-pool", type=int, default=1000, help="0 skips the big-pool scenario")
    ap.add_argument("--max-loaded-skills", type=int, default=16, help="for the big pool")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument(
        "--rounds", type=int, default=2, help="interleaved base/mixes rounds with prefix caching off (hf engine)"
    )
    ap.add_argument(
        "--only",
        choices=("all", "core", "auto", "pools"),
        default="all",
        help="core: every scenario but auto's comparisons; pools: the popular-skills pools alone",
    )
    ap.add_argument(
        "--auto-vary",
        type=float,
        default=0.5,
        help="auto's comparisons: answer lengths drawn per prompt from max-tokens x [1-v, 1+v] (the same on both "
        "sides), so closed-loop clients do not all finish on one step; 0: every answer max-tokens long",
    )
    ap.add_argument(
        "--auto-server-flags",
        default="",
        help="more `serve` flags for auto's comparisons, e.g. '--embedder torch --routing-batch-size 32' (as before)",
    )
    ap.add_argument("--slo-ttft", type=float, default=4.0, help="goodput: TTFT bound (s)")
    ap.add_argument("--slo-itl", type=float, default=0.5, help="goodput: inter-token latency bound (s)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="skillpool-bench-"))
    print(f"writing {args.skills} synthetic skills ...", flush=True)
    names = make_skills(root / "small", args.skills, args.rank)
    prompts = [user_text(r) for t in TASKS for r in rows(GROUP, t, "test", 25)]
    rng = random.Random(0)
    rng.shuffle(prompts)
    n_req = args.clients * args.per_client
    combos: list[tuple[str, ...]] = []
    while len(combos) < n_req:  # k=3 mixes, all different
        c = tuple(sorted(rng.sample(names, 3)))
        if c not in combos:
            combos.append(c)
    mix_models = [f"{a}=0.5,{b}=0.3,{c}=0.2" for a, b, c in combos]
    base_id = "SmolLM2-135M-Instruct"

    def popular(pool: list[str]) -> Any:
        """Each request one skill, forced, drawn by Zipf popularity (s = 1.1): the same draws for any pool size."""
        weights = [1 / (i + 1) ** 1.1 for i in range(len(pool))]
        draw = random.Random(7).choices(pool, weights, k=n_req)
        return lambda c, j: (draw[c * args.per_client + j], prompts[(c * args.per_client + j) % len(prompts)])

    big_names: list[str] = []

    def run(engine: str) -> None:
        """Every scenario on one engine, with its table and ratios."""
        flags = ["--engine", engine, "--max-batch-size", str(max(args.clients, 16))]
        results: dict[str, dict[str, float]] = {}
        mem: dict[str, float] = {}

        def record(name: str, res_wall: tuple[list[dict[str, float]], float]) -> None:
            results[name] = summarize(*res_wall, args.slo_ttft, args.slo_itl)
            r = results[name]
            print(
                f"  {name}: {r['tok_s']:.1f} tok/s, ttft p50 {r['ttft_p50']:.2f}s, itl p50 {r['itl_p50'] * 1000:.0f}ms",
                flush=True,
            )

        pools_only = args.only == "pools"

        def pool_round(load: Load, pool: list[str], name: str) -> None:
            record(name, load.closed(args.clients, args.per_client, popular(pool)))

        def first_server(load: Load) -> None:
            """One client, N clients, mixes, Poisson rates and auto, on one server with prefix caching."""
            record("base, 1 client", load.closed(1, 4, lambda c, j: (base_id, prompts[j])))
            record(
                f"base, {args.clients} clients",
                load.closed(
                    args.clients,
                    args.per_client,
                    lambda c, j: (base_id, prompts[(c * args.per_client + j) % len(prompts)]),
                ),
            )
            record(
                f"k=3 mixes all different, {args.clients} clients",
                load.closed(
                    args.clients,
                    args.per_client,
                    lambda c, j: (
                        mix_models[c * args.per_client + j],
                        prompts[(c * args.per_client + j) % len(prompts)],
                    ),
                ),
            )
            for rate in [float(x) for x in args.rates.split(",") if x]:
                record(
                    f"base, Poisson {rate:g} req/s",
                    load.poisson(rate, args.poisson_requests, lambda c, j: (base_id, prompts[j % len(prompts)])),
                )
            record(
                f"auto, {args.skills}-skill pool, {args.clients} clients",
                load.closed(
                    args.clients,
                    args.per_client,
                    lambda c, j: ("auto", prompts[(c * args.per_client + j) % len(prompts)]),
                ),
            )

        def mixes_against_base(load: Load) -> None:
            """Interleaved rounds (base, mixes, mixes, base, ...) after a discarded warm-up: a machine that drifts
            moves both sides alike."""
            sides = {"base": lambda i: base_id, "k=3 mixes all different": lambda i: mix_models[i]}

            def closed_round(model: Any) -> tuple[list[dict[str, float]], float]:
                return load.closed(
                    args.clients,
                    args.per_client,
                    lambda c, j: (
                        model(c * args.per_client + j),
                        prompts[(c * args.per_client + j) % len(prompts)],
                    ),
                )

            closed_round(sides["k=3 mixes all different"])  # warm-up, not recorded
            rounds: dict[str, list[tuple[list[dict[str, float]], float]]] = {name: [] for name in sides}
            for r in range(args.rounds):
                order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                for name in order:
                    rounds[name].append(closed_round(sides[name]))
                    record(f"{name}, round {r + 1}, no prefix cache", rounds[name][-1])
            for name, parts in rounds.items():  # all rounds as one sample: tokens over summed wall time
                record(
                    f"{name}, {args.clients} clients, no prefix cache",
                    ([x for res, _ in parts for x in res], sum(wall for _, wall in parts)),
                )

        with ServerProcess(root / "small", flags) as srv:
            client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=900)
            load = Load(client, args.max_tokens)
            load.one(base_id, prompts[-1])  # warm-up, with a prompt the single client does not send
            if not pools_only:
                first_server(load)
            pool_round(load, names, f"popular skills, {args.skills}-skill pool")
            mem[f"{args.skills}-skill pool"] = rss_mib(srv.proc.pid)
            stats = httpx.get(srv.url + "/healthz").json()
            print(f"  healthz: {stats}", flush=True)
        # the big pool's servers: as the first one, and (hf) like for like, as the next one
        pool_servers = [(flags, "")] + ([(like_for_like(flags), ", no prefix cache")] if engine == "hf" else [])
        # like for like, prefix caching off (like_for_like; the hf engine's setting): mixes against the base and
        # the small pool
        if engine == "hf":
            with ServerProcess(root / "small", like_for_like(flags)) as srv:
                client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=900)
                load = Load(client, args.max_tokens)
                load.one(names[0], prompts[-1])
                if not pools_only:
                    mixes_against_base(load)
                pool_round(load, names, f"popular skills, {args.skills}-skill pool, no prefix cache")
        if args.big_pool:
            if not big_names:  # written once, served by every engine
                print(f"writing {args.big_pool} synthetic skills ...", flush=True)
                big_names.extend(make_skills(root / "big", args.big_pool, args.rank, seed=1))
            for server_flags, suffix in pool_servers:
                server_flags = [*server_flags, "--max-loaded-skills", str(args.max_loaded_skills)]
                with ServerProcess(root / "big", server_flags, startup_s=1800) as srv:
                    client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=900)
                    load = Load(client, args.max_tokens)
                    load.one(big_names[0], prompts[0])
                    name = f"popular skills, {args.big_pool}-skill pool, {args.max_loaded_skills} loaded{suffix}"
                    pool_round(load, big_names, name)
                    if not suffix:
                        mem[f"{args.big_pool}-skill pool"] = rss_mib(srv.proc.pid)
                    stats = httpx.get(srv.url + "/healthz").json()
                    print(f"  healthz: {stats}", flush=True)
        print(
            f"\nengine {engine}; {args.max_tokens}-token answers (ignore_eos), temperature 0; SuperNI generation prompts; "
            f"rank-{args.rank} LoRA on q,k,v,o; SLO: TTFT <= {args.slo_ttft}s and ITL <= {args.slo_itl}s"
        )
        print(
            f"{'scenario':44s} {'n':>3s} {'tok/s':>7s} {'ttft p50':>8s} {'ttft p99':>8s} {'itl p50':>7s} {'itl p99':>7s} {'e2e p50':>7s} {'goodput':>7s}"
        )
        for name, s in results.items():
            print(
                f"{name:44s} {s['n']:3.0f} {s['tok_s']:7.1f} {s['ttft_p50']:8.2f} {s['ttft_p99']:8.2f} {s['itl_p50']:7.3f} "
                f"{s['itl_p99']:7.3f} {s['e2e_p50']:7.2f} {s['goodput']:7.0%}"
            )
        ratios[engine] = {}
        print("\nratios (same run):")
        if not pools_only:
            one, many = results["base, 1 client"], results[f"base, {args.clients} clients"]
            mixes = results[f"k=3 mixes all different, {args.clients} clients"]
            ratios[engine] = {
                f"tokens_{args.clients}_over_1": round(many["tok_s"] / one["tok_s"], 3),
                f"ttft_{args.clients}_over_1": round(many["ttft_p50"] / one["ttft_p50"], 3),
                "mixes_over_base": round(mixes["tok_s"] / many["tok_s"], 3),
            }
            print(
                f"  {args.clients} clients vs 1: TTFT p50 {many['ttft_p50'] / one['ttft_p50']:.2f}x (target <= 4x), "
                f"output tok/s {many['tok_s'] / one['tok_s']:.2f}x (target >= 4x)"
            )
            print(
                f"  k=3 mixes vs base at {args.clients} clients: tok/s {mixes['tok_s'] / many['tok_s']:.2f}x "
                "(target >= 0.9x)"
            )
        plain = results.get(f"base, {args.clients} clients, no prefix cache")
        plain_mixes = results.get(f"k=3 mixes all different, {args.clients} clients, no prefix cache")
        if plain and plain_mixes:
            per_round = [
                results[f"k=3 mixes all different, round {r + 1}, no prefix cache"]["tok_s"]
                / results[f"base, round {r + 1}, no prefix cache"]["tok_s"]
                for r in range(args.rounds)
            ]
            ratios[engine]["mixes_over_base"] = round(plain_mixes["tok_s"] / plain["tok_s"], 3)  # the like-for-like one
            print(
                f"    with prefix caching off on both, {args.rounds} interleaved rounds: "
                f"{plain_mixes['tok_s'] / plain['tok_s']:.2f}x (per round: {', '.join(f'{x:.2f}x' for x in per_round)}; "
                "the base rows above reuse shared prompt starts, all-different mixes cannot)"
            )
        if args.big_pool:
            small_pool = f"popular skills, {args.skills}-skill pool"
            big_pool = f"popular skills, {args.big_pool}-skill pool, {args.max_loaded_skills} loaded"
            off = ", no prefix cache" if engine == "hf" else ""  # another engine: its own caching on both
            like = results[big_pool + off]["tok_s"] / results[small_pool + off]["tok_s"]
            cached = results[big_pool]["tok_s"] / results[small_pool]["tok_s"]
            ratios[engine]["big_pool_over_small"] = round(like, 3)
            ratios[engine]["big_pool_over_small_cached"] = round(cached, 3)
            print(
                f"  {args.big_pool}- vs {args.skills}-skill pool (popular skills), prefix caching off on both: "
                f"tok/s {like:.2f}x (target >= 0.95x); with it: {cached:.2f}x (hits: healthz' prefix_hit_tokens)"
            )
        print("  server RSS: " + ", ".join(f"{k} {v:.0f} MiB" for k, v in mem.items()))

    ratios: dict[str, dict[str, float]] = {}
    for engine in args.engine.split(","):
        if args.only != "auto":
            run(engine.strip())
        if args.only in ("all", "auto"):
            flags = ["--engine", engine.strip(), "--max-batch-size", str(max(args.clients, 16))]
            flags += args.auto_server_flags.split()
            lines = auto_scenarios(
                functools.partial(ServerProcess, extra_args=flags),
                {"empty pool": root / "empty", f"{args.skills}-skill pool": root / "small"},
                prompts,
                args.clients,
                args.per_client,
                args.max_tokens,
                args.rounds,
                (args.slo_ttft, args.slo_itl),
                vary=args.auto_vary,
            )
            print(
                f"\nengine {engine}: auto against what it routes to ({args.rounds} interleaved rounds, answer lengths x[1 +- {args.auto_vary}])"
            )
            print("\n".join(lines), flush=True)
    for engine, same_run in ratios.items():  # last: one JSON line per engine of the core scenarios' same-run ratios
        print(json.dumps({"engine": engine, **same_run}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
