"""Chat latency while a skill trains in the same server, against the same server idle.

One `skillpool serve` (SmolLM2, --engine hf): streaming chat requests from a few concurrent clients, first
with nothing else running, then while an uploaded sst-2 skill trains in the server's own trainer thread.
Prints TTFT and inter-token latency for both and their ratios, measured in one run. Run it on a quiet machine:

    .venv/bin/python -m load_tests.training.bench_train_vs_chat [--requests 24] [--clients 2] [--train-rows 300]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import tempfile
from pathlib import Path

from load_tests.common.datasets import rows, user_text
from load_tests.common.load import Load
from load_tests.common.training import while_training


def measure(load: Load, prompts: list[str], clients: int) -> list[dict[str, float]]:
    with cf.ThreadPoolExecutor(clients) as pool:
        return list(pool.map(lambda p: load.one("SmolLM2-135M-Instruct", p), prompts))


def main() -> int:
    from openai import OpenAI

    from skillpool.evaluation.process import ServerProcess

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--train-rows", type=int, default=300)
    args = ap.parse_args()
    prompts = [user_text(r) for r in rows("long_sequence", "agnews", "test", args.requests)]
    train = "\n".join(__import__("json").dumps(r) for r in rows("long_sequence", "sst-2", "train", args.train_rows))
    root = Path(tempfile.mkdtemp(prefix="skillpool-train-vs-chat-"))
    with ServerProcess(root / "data") as srv:
        load = Load(OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600), args.max_tokens)
        load.one("SmolLM2-135M-Instruct", prompts[-1])  # warm-up
        idle = measure(load, prompts, args.clients)
        busy, still = while_training(srv.url, train.encode(), lambda: measure(load, prompts, args.clients))
    p50 = {k: statistics.median(x["ttft"] for x in v) for k, v in (("idle", idle), ("training", busy))}
    itl = {k: statistics.median(x["itl"] for x in v) for k, v in (("idle", idle), ("training", busy))}
    print(f"{args.requests} streaming requests, {args.clients} clients, {args.max_tokens} tokens each")
    print(f"  idle server:        TTFT p50 {p50['idle']:.3f}s, ITL p50 {itl['idle'] * 1000:.0f}ms")
    print(f"  while a skill trains: TTFT p50 {p50['training']:.3f}s, ITL p50 {itl['training'] * 1000:.0f}ms")
    print(
        f"  ratio training/idle: TTFT p50 {p50['training'] / p50['idle']:.2f}x (target <= 2x), ITL {itl['training'] / itl['idle']:.2f}x"
    )
    print(f"  the job was still training when the last request ended: {still}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
