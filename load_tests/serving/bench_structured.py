"""What a JSON schema costs a server: the same prompts from concurrent streaming clients as free text and under a
JSON schema, interleaved in one run, then the first request with a new schema against one whose grammar is
compiled already.

One `skillpool serve` (SmolLM2, --engine hf unless --engine says otherwise). The schema asks for one long string
(at least --min-chars characters), so a constrained answer runs to max_tokens as a free one with ignore_eos does:
both decode the same number of tokens and the difference is the grammar's (masks, their application, the matcher's
steps). Prints output tokens/s and TTFT p50 for both and their ratios, then TTFT p50 of a new schema (compiled
before its prefill) and of the same schema again. Run it on a quiet machine:

    .venv/bin/python -m load_tests.serving.bench_structured [--clients 16] [--per-client 2] [--rounds 2] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from load_tests.common.load import pct

MODEL = "SmolLM2-135M-Instruct"
TOPICS = [
    "the printing press",
    "the steam engine",
    "the telephone",
    "vaccines",
    "the bicycle",
    "radio",
    "the compass",
    "paper money",
    "the microscope",
    "railways",
    "photography",
    "the light bulb",
    "antibiotics",
    "the internet",
    "refrigeration",
    "the airplane",
]


def schema(min_chars: int, key: str = "summary") -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {key: {"type": "string", "minLength": min_chars, "maxLength": 4 * min_chars}},
        "required": [key],
        "additionalProperties": False,
    }


def one(client: Any, prompt: str, max_tokens: int, fmt: dict[str, Any] | None) -> dict[str, float]:
    """One streamed request: its TTFT, end-to-end time and completion tokens."""
    extra: dict[str, Any] = {} if fmt is not None else {"ignore_eos": True}
    t0 = time.perf_counter()
    first, tokens = None, 0
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
        **({"response_format": fmt} if fmt is not None else {}),
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"ttft": first if first is not None else float("nan"), "e2e": time.perf_counter() - t0, "tokens": tokens}


def load(
    client: Any, prompts: list[str], clients: int, max_tokens: int, fmt: dict[str, Any] | None
) -> dict[str, float]:
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as pool:
        got = list(pool.map(lambda p: one(client, p, max_tokens, fmt), prompts))
    wall = time.perf_counter() - t0
    return {
        "requests": len(got),
        "tok_s": sum(r["tokens"] for r in got) / wall,
        "ttft_p50": pct([r["ttft"] for r in got], 0.5),
        "tokens": statistics.mean(r["tokens"] for r in got),
    }


def main() -> int:
    from openai import OpenAI

    from skillpool.evaluation.process import ServerProcess

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--per-client", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="free and JSON rounds, interleaved")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--min-chars", type=int, default=600, help="the schema's string: long enough to reach max_tokens")
    ap.add_argument("--new-schemas", type=int, default=6, help="requests with a new schema (each then repeated)")
    args = ap.parse_args()

    prompts = [f"Write about the history of {TOPICS[i % len(TOPICS)]}." for i in range(args.clients * args.per_client)]
    fmt = {"type": "json_schema", "json_schema": {"name": "summary", "schema": schema(args.min_chars)}}
    with tempfile.TemporaryDirectory() as tmp:
        # no prefix cache: the two kinds of round send the same prompts, and the later would find them cached
        flags = ["--engine", args.engine, "--max-batch-size", str(args.clients), "--prefix-cache-tokens", "0"]
        with ServerProcess(Path(tmp) / "data", flags, startup_s=900) as srv:
            client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=900)
            one(client, prompts[0], 4, None)  # warm-up: the first forward's one-time costs
            one(client, prompts[0], 4, fmt)  # and the schema's grammar compiled, as a served schema would be
            free: list[dict[str, float]] = []
            json_: list[dict[str, float]] = []
            for r in range(args.rounds):
                for name, runs, f in (("free text", free, None), ("json schema", json_, fmt)):
                    runs.append(load(client, prompts, args.clients, args.max_tokens, f))
                    print(f"round {r + 1} {name}: {runs[-1]}", flush=True)
            new, cached = [], []
            for _ in range(args.new_schemas):
                fresh = {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": schema(8, "k" + uuid.uuid4().hex)},
                }
                new.append(one(client, prompts[1], 8, fresh)["ttft"])
                cached.append(one(client, prompts[1], 8, fresh)["ttft"])

    def mean(runs: list[dict[str, float]], key: str) -> float:
        return statistics.mean(r[key] for r in runs)

    print(
        f"\n{args.clients} clients x {args.per_client}, {args.max_tokens} tokens, {args.rounds} rounds, --engine {args.engine}"
    )
    print("| scenario | output tok/s | TTFT p50 (s) | tokens per answer |")
    print("|---|---|---|---|")
    for name, runs in (("free text (ignore_eos)", free), ("json schema", json_)):
        print(f"| {name} | {mean(runs, 'tok_s'):.1f} | {mean(runs, 'ttft_p50'):.3f} | {mean(runs, 'tokens'):.1f} |")
    print(
        f"json/free: tokens/s {mean(json_, 'tok_s') / mean(free, 'tok_s'):.2f}x (target >= 0.85x), "
        f"TTFT p50 {mean(json_, 'ttft_p50') / mean(free, 'ttft_p50'):.2f}x (target <= 1.2x)"
    )
    n, c = pct(new, 0.5), pct(cached, 0.5)
    print(f"first request with a new schema: TTFT p50 {n:.3f} s; the same schema again: {c:.3f} s ({n / c:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
