"""What logprobs cost serving: 16 closed-loop streaming clients on the base model, each answer with its tokens'
logprobs and 5 alternatives (`logprobs: true, top_logprobs: 5`) against the same requests without, in one run.

The two loads alternate round by round on one server, so a slower minute of the machine falls on both; output
tokens/s of each round, their medians and the ratio (target: with logprobs >= 0.9x without) are printed, with the
logprobs the last round received (one per token, each with 5 alternatives). Answers decode exactly --max-tokens.

    .venv/bin/python -m load_tests.serving.bench_logprobs [--engine hf|vllm] [--clients 16] [--per-client 4] [--max-tokens 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from load_tests.common.datasets import rows, user_text
from load_tests.common.load import GROUP, TASKS, Load, summarize

TOP = 5
TARGET = 0.9


class Checked(Load):
    """A load that also counts the logprobs its streams carried (with logprobs: one per token, TOP alternatives)."""

    def __init__(self, client: Any, max_tokens: int, logprobs: bool) -> None:
        super().__init__(client, max_tokens, (lambda _: {"logprobs": True, "top_logprobs": TOP}) if logprobs else None)
        self.tokens_with_logprobs = self.full = 0

    def seen(self, chunk: Any) -> None:
        logprobs = chunk.choices[0].logprobs if chunk.choices else None
        for lp in logprobs.content or [] if logprobs else []:
            self.tokens_with_logprobs += 1
            self.full += len(lp.top_logprobs) == TOP


def main() -> int:
    from openai import OpenAI

    from skillpool.evaluation.process import ServerProcess

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--per-client", type=int, default=4, help="requests per closed-loop client and round")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="rounds of each load, alternating")
    args = ap.parse_args()
    prompts = [user_text(r) for t in TASKS for r in rows(GROUP, t, "test", 16)]
    data = Path(tempfile.mkdtemp(prefix="skillpool-bench-logprobs-")) / "data"
    flags = ["--engine", args.engine, "--max-batch-size", str(max(args.clients, 16))]
    if args.engine == "vllm":
        flags += ["--max-model-len", "2048"]
    with ServerProcess(data, flags, startup_s=900) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id  # the base model

        def pick(c: int, j: int) -> tuple[str, str]:
            return model, prompts[(c * args.per_client + j) % len(prompts)]

        Load(client, 8).closed(4, 1, pick)  # warm-up: first-call costs stay out of both loads
        tok_s: dict[bool, list[float]] = {False: [], True: []}
        last: Checked | None = None
        for r in range(args.rounds):
            for with_lp in (False, True):
                load = Checked(client, args.max_tokens, logprobs=with_lp)
                res, wall = load.closed(args.clients, args.per_client, pick)
                s = summarize(res, wall, slo_ttft=1e9, slo_itl=1e9)
                tok_s[with_lp].append(s["tok_s"])
                print(
                    f"round {r + 1} logprobs {'on ' if with_lp else 'off'}: {s['tok_s']:.1f} tok/s, TTFT p50 "
                    f"{s['ttft_p50']:.2f} s, ITL p50 {s['itl_p50'] * 1000:.0f} ms ({int(s['n'])} requests)",
                    flush=True,
                )
                last = load if with_lp else last
    off, on = statistics.median(tok_s[False]), statistics.median(tok_s[True])
    ratio = on / off
    assert last is not None
    print(
        f"\n{args.engine}, {args.clients} clients, {args.max_tokens} tokens an answer: without logprobs {off:.1f} tok/s, "
        f"with (top {TOP}) {on:.1f} tok/s: {ratio:.2f}x (target >= {TARGET}x) "
        f"[{'ok' if ratio >= TARGET else 'BELOW TARGET'}]"
    )
    print(
        f"logprobs received in the last round: {last.tokens_with_logprobs} tokens, {last.full} with {TOP} alternatives"
    )
    return 0 if ratio >= TARGET and last.tokens_with_logprobs > 0 and last.full == last.tokens_with_logprobs else 1


if __name__ == "__main__":
    sys.exit(main())
