"""How OpenMP's idle threads wait, as `skillpool serve` meets it: sleeping at once (OMP_WAIT_POLICY=PASSIVE)
against spinning briefly first (GOMP_SPINCOUNT, OMP_WAIT_POLICY unset), in one run on one machine.

A decode step of a small model is hundreds of short parallel regions; a thread that sleeps between them pays a
wake-up in each, one that spins too long takes the cores from the router's MiniLM and the trainer. Each side is
a `skillpool serve` process (SmolLM2, --engine hf, --dtype auto) over the same pool of --skills synthetic skills,
with the side's variables; the sides take turns per scenario (the order alternating), through streaming openai
clients, SuperNI prompts, --max-tokens answers (ignore_eos), greedy:
  - base, 1 client x 4 requests;  - base, 16 closed-loop clients x 2;
  - auto, 16 clients x 2 (MiniLM routes every request while the engine decodes others);
  - base, 2 clients x 4 while an uploaded sst-2 skill trains in the same server.
Prints tok/s, TTFT p50 and ITL p50 per side, the ratios spin/sleep, and one JSON line last.

    .venv/bin/python -m load_tests.probes.bench_omp_wait [--spin 10000] [--max-tokens 64] [--skills 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from load_tests.common.datasets import rows, user_text
from load_tests.common.load import GROUP, TASKS, Load, make_skills, summarize
from load_tests.common.training import while_training

BASE = "SmolLM2-135M-Instruct"


def sides(spin: int) -> dict[str, dict[str, str | None]]:
    """Each side's variables (None: unset in the server's environment)."""
    return {
        "sleep": {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None},
        "spin": {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": str(spin)},
    }


def apply(env: dict[str, str | None]) -> None:
    """Set each variable of `env` in this process' environment; None unsets it."""
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def start(data: Path, env: dict[str, str | None]) -> Any:
    """A server started with `env` applied to this process' environment, which it inherits."""
    from skillpool.evaluation.process import ServerProcess

    old = {k: os.environ.get(k) for k in env}
    try:
        apply(env)
        return ServerProcess(data, ["--dtype", "auto", "--max-batch-size", "16"]).start()
    finally:
        apply(old)


def main() -> int:
    from openai import OpenAI

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spin", type=int, default=10_000, help="GOMP_SPINCOUNT of the spinning side")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--skills", type=int, default=4)
    args = ap.parse_args()
    texts = [user_text(r) for t in TASKS for r in rows(GROUP, t, "test", 20)]
    random.Random(0).shuffle(texts)
    train = "\n".join(json.dumps(r) for r in rows("long_sequence", "sst-2", "train", 200)).encode()
    root = Path(tempfile.mkdtemp(prefix="skillpool-omp-wait-"))
    servers, loads = {}, {}
    try:
        for name, env in sides(args.spin).items():
            make_skills(root / name, args.skills, 8)  # the same skills on each side (one seed)
            servers[name] = start(root / name, env)
            client = OpenAI(base_url=servers[name].url + "/v1", api_key="unused", max_retries=0, timeout=1800)
            loads[name] = Load(client, args.max_tokens)
            loads[name].one(BASE, texts[-1])  # warm-up
            loads[name].one("auto", texts[-2])

        def closed(name: str, clients: int, per: int, model: str) -> dict[str, float]:
            return summarize(*loads[name].closed(clients, per, lambda c, j: (model, texts[c * per + j])), 4.0, 0.5)

        scenarios: dict[str, Callable[[str], dict[str, float]]] = {
            "base, 1 client": lambda n: closed(n, 1, 4, BASE),
            "base, 16 clients": lambda n: closed(n, 16, 2, BASE),
            "auto, 16 clients": lambda n: closed(n, 16, 2, "auto"),
            "base, 2 clients, training": lambda n: while_training(
                servers[n].url, train, lambda: closed(n, 2, 4, BASE), {"epochs": 3, "prompt_variants": 0.0}
            )[0],
        }
        results: dict[str, dict[str, dict[str, float]]] = {name: {} for name in servers}
        order = list(servers)
        for scenario, run in scenarios.items():
            for name in order:
                s = results[name][scenario] = run(name)
                print(
                    f"  {scenario}, {name}: {s['tok_s']:.1f} tok/s, TTFT p50 {s['ttft_p50']:.2f}s, "
                    f"ITL p50 {s['itl_p50'] * 1000:.0f}ms",
                    flush=True,
                )
            order.reverse()
    finally:
        for srv in servers.values():
            srv.stop()
    print(f"\nGOMP_SPINCOUNT={args.spin} (spin) against OMP_WAIT_POLICY=PASSIVE (sleep), same run:")
    ratios = {}
    for scenario in scenarios:
        spin, sleep = results["spin"][scenario], results["sleep"][scenario]
        ratios[scenario] = {k: round(spin[k] / sleep[k], 3) for k in ("tok_s", "ttft_p50", "itl_p50")}
        r = ratios[scenario]
        print(f"  {scenario:28s} tok/s {r['tok_s']:.2f}x, TTFT p50 {r['ttft_p50']:.2f}x, ITL p50 {r['itl_p50']:.2f}x")
    keep = ("tok_s", "ttft_p50", "itl_p50")
    out = {n: {sc: {k: round(s[k], 3) for k in keep} for sc, s in res.items()} for n, res in results.items()}
    print(json.dumps({"spin": args.spin, "results": out, "ratios": ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
