"""Serving benchmark: batching gain and the cost of per-row LoRA mixes, measured in one run.

Writes synthetic skills (random LoRA blocks, router keys from real task inputs) into a fresh store,
starts `skillpool serve`, and streams the same prompts through the openai client in several
scenarios. Prints tokens/s, TTFT and end-to-end latency percentiles, and ratios between scenarios
(absolute numbers are machine-dependent; the ratios are the result).

    .venv/bin/python load_tests/bench_serving.py [--requests 32] [--concurrency 16] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from load_tests.common import rows, user_text  # noqa: E402

# Generation tasks: answers run to the token budget, so decode (where batching pays) is measured,
# not just the prefill of long classification prompts.
GROUP = "superni"
TASKS = (
    "task1729_personachat_generate_next",
    "task639_multi_woz_user_utterance_generation",
    "task1590_diplomacy_text_generation",
    "task748_glucose_reverse_cause_event_detection",
)


def make_skills(data_dir: Path, rank: int) -> None:
    """Random-but-plausible skills: PEFT LoRA with small random B, keys from each task's inputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from skillpool.adapters_store.base_model import resolve_base_model
    from skillpool.adapters_store.store import SkillDraft, SkillStore
    from skillpool.router import Router
    from skillpool.router.embedder import SentenceEmbedder
    from skillpool.trainer.lora_train import save_adapter

    base = resolve_base_model()
    store, router = SkillStore(data_dir), Router(SentenceEmbedder())
    for i, task in enumerate(TASKS):
        model = AutoModelForCausalLM.from_pretrained(str(base.path))
        pm = get_peft_model(
            model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
        )
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.01)
        texts = [user_text(r) for r in rows(GROUP, task, "train", 200)]
        store.write(
            SkillDraft(
                name=task,
                write_adapter=lambda f, pm=pm: save_adapter(pm, f, base.model_id),
                router_tensors=router.prepare_keys(texts),
                meta={"base_model": {"id": base.model_id, "fingerprint": base.fingerprint}, "eval": None},
                replay=[],
                probe=[],
            )
        )


def run(client, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict[str, float]:  # type: ignore[no-untyped-def]
    def one(text: str) -> tuple[float, float, int, int]:
        t0 = time.perf_counter()
        ttft, ntok, nprompt = None, 0, 0
        stream = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            temperature=0,
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if ttft is None and chunk.choices and chunk.choices[0].delta.content:
                ttft = time.perf_counter() - t0
            if chunk.usage:
                ntok, nprompt = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
        return ttft or 0.0, time.perf_counter() - t0, ntok, nprompt

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as pool:
        res = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    ttfts, e2e = sorted(r[0] for r in res), sorted(r[1] for r in res)
    pct = lambda xs, q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {
        "tok_s": sum(r[2] for r in res) / wall,
        "prompt_tok_s": sum(r[3] for r in res) / wall,
        "req_s": len(prompts) / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": pct(ttfts, 0.99),
        "e2e_p50": statistics.median(e2e),
        "e2e_p99": pct(e2e, 0.99),
    }


def main() -> int:
    from openai import OpenAI

    from skillpool.server.process import ServerProcess

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rank", type=int, default=8)
    args = ap.parse_args()
    data_dir = Path(tempfile.mkdtemp(prefix="skillpool-bench-")) / "data"
    print("writing synthetic skills ...", flush=True)
    make_skills(data_dir, args.rank)
    # Prompts from all four tasks: with model=auto each row of a batch gets its own skill mix.
    per = max(1, args.requests // len(TASKS))
    prompts = [user_text(r) for t in TASKS for r in rows(GROUP, t, "test", per)][: args.requests]
    with ServerProcess(data_dir, ["--batch-window-ms", "20", "--max-batch-size", str(args.concurrency)]) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        run(client, "SmolLM2-135M-Instruct", prompts[:2], 1, 4)  # warm-up
        results = {
            "base, sequential": run(client, "SmolLM2-135M-Instruct", prompts, 1, args.max_tokens),
            "base, concurrent": run(client, "SmolLM2-135M-Instruct", prompts, args.concurrency, args.max_tokens),
            "auto (per-row mixes), concurrent": run(client, "auto", prompts, args.concurrency, args.max_tokens),
            "forced one skill, concurrent": run(client, TASKS[0], prompts, args.concurrency, args.max_tokens),
        }
    print(
        f"\n{args.requests} requests from 4 SuperNI generation tasks, {args.max_tokens} max tokens, concurrency {args.concurrency}, LoRA rank {args.rank} on q,k,v,o"
    )
    print(
        f"{'scenario':36s} {'tok/s':>8s} {'prompt tok/s':>12s} {'req/s':>7s} {'ttft p50':>9s} {'ttft p99':>9s} {'e2e p50':>8s} {'e2e p99':>8s}"
    )
    for name, r in results.items():
        print(
            f"{name:36s} {r['tok_s']:8.1f} {r['prompt_tok_s']:12.1f} {r['req_s']:7.2f} {r['ttft_p50']:9.3f} {r['ttft_p99']:9.3f} {r['e2e_p50']:8.3f} {r['e2e_p99']:8.3f}"
        )
    b_seq, b_con = results["base, sequential"], results["base, concurrent"]
    print(f"\nbatching gain (base concurrent / sequential tok/s): {b_con['tok_s'] / b_seq['tok_s']:.2f}x")
    print(
        f"per-row mix cost (auto / base, concurrent tok/s):    {results['auto (per-row mixes), concurrent']['tok_s'] / b_con['tok_s']:.2f}x"
    )
    print(
        f"single-skill cost (forced / base, concurrent tok/s): {results['forced one skill, concurrent']['tok_s'] / b_con['tok_s']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
