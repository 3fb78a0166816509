"""What the serving benchmarks share: synthetic skills keyed by SuperNI tasks, a streaming closed-/open-loop load
through the openai client, and the summary of its per-request timings."""

from __future__ import annotations

import concurrent.futures as cf
import random
import statistics
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from load_tests.common.datasets import rows, user_text
from tests.synthetic import task_skills

if TYPE_CHECKING:
    pass

GROUP = "superni"
TASKS = (
    "task1729_personachat_generate_next",
    "task639_multi_woz_user_utterance_generation",
    "task1590_diplomacy_text_generation",
    "task748_glucose_reverse_cause_event_detection",
)


def task_texts(per_task: int = 200) -> list[list[str]]:
    """The user texts of each of TASKS' first training rows: what make_skills builds the skills' router keys from."""
    return [[user_text(r) for r in rows(GROUP, t, "train", per_task)] for t in TASKS]


def make_skills(data_dir: Path, n: int, rank: int, seed: int = 0) -> list[str]:
    """tests.synthetic.task_skills on the packaged model with the keys of TASKS' texts."""
    return task_skills(data_dir, n, rank, task_texts(), seed)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


class Load:
    """Streams requests and records, per request: TTFT, mean inter-token latency, end-to-end time, tokens."""

    def __init__(self, client: Any, max_tokens: int, extra: Any = None) -> None:
        """`extra`: model -> more request fields, for a server that takes its adapters another way (llama.cpp), or
        for what a benchmark compares (logprobs)."""
        self.client, self.max_tokens, self.extra = client, max_tokens, extra
        self.routes: dict[str, str] = {}  # each prompt's last x-skillpool-route (what `auto` served it)

    def seen(self, chunk: Any) -> None:
        """Each streamed chunk, for a benchmark that checks what the answers carried."""

    def one(self, model: str, text: str, max_tokens: int | None = None) -> dict[str, float]:
        t0 = time.perf_counter()
        first = last = None
        ntok = 0
        raw = self.client.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            temperature=0,
            max_tokens=max_tokens or self.max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, **(self.extra(model) if self.extra else {})},
        )
        self.routes[text] = raw.headers.get("x-skillpool-route", "")
        for chunk in raw.parse():
            self.seen(chunk)
            if chunk.choices and chunk.choices[0].delta.content:
                last = time.perf_counter()
                first = first or last
            if chunk.usage:
                ntok = chunk.usage.completion_tokens
        end = time.perf_counter()
        ttft = (first or end) - t0
        itl = ((last or end) - (first or end)) / max(1, ntok - 1)
        return {"ttft": ttft, "itl": itl, "e2e": end - t0, "tokens": ntok}

    def closed(self, clients: int, per_client: int, pick: Any) -> tuple[list[dict[str, float]], float]:
        """`clients` closed loops, each sending its next request when the last one ends."""
        t0 = time.perf_counter()

        def client(c: int) -> list[dict[str, float]]:
            return [self.one(*pick(c, j)) for j in range(per_client)]

        with cf.ThreadPoolExecutor(clients) as pool:
            futs = [pool.submit(client, c) for c in range(clients)]
            res = [r for f in futs for r in f.result()]
        return res, time.perf_counter() - t0

    def poisson(self, rate: float, n: int, pick: Any, seed: int = 0) -> tuple[list[dict[str, float]], float]:
        """n requests at exponential inter-arrival times (open loop: nobody waits for an answer to send)."""
        rng = random.Random(seed)
        results: list[dict[str, float]] = []
        lock = threading.Lock()
        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(64) as pool:
            futs = []
            for j in range(n):
                futs.append(pool.submit(self.one, *pick(0, j)))
                time.sleep(rng.expovariate(rate))
            for f in futs:
                with lock:
                    results.append(f.result())
        return results, time.perf_counter() - t0


def summarize(res: list[dict[str, float]], wall: float, slo_ttft: float, slo_itl: float) -> dict[str, float]:
    good = [r for r in res if r["ttft"] <= slo_ttft and r["itl"] <= slo_itl]
    return {
        "n": len(res),
        "tok_s": sum(r["tokens"] for r in res) / wall,
        "ttft_p50": statistics.median(r["ttft"] for r in res),
        "ttft_p99": pct([r["ttft"] for r in res], 0.99),
        "itl_p50": statistics.median(r["itl"] for r in res),
        "itl_p99": pct([r["itl"] for r in res], 0.99),
        "e2e_p50": statistics.median(r["e2e"] for r in res),
        "goodput": len(good) / len(res),
        "good_tok_s": sum(r["tokens"] for r in good) / wall,
    }
