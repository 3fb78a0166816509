"""GPU check of skill-affinity placement on Ray Serve: `skillpool serve --replicas 4 --engine vllm` on one GPU (a
quarter each), driven twice at the same offered load through the openai client over HTTP: requests keyed by their
mix's heaviest skill (affinity, the default) and unkeyed (Ray's power-of-two router, the control).

The model is Llama-2-7B's shape with random weights (vLLM's dummy load format; the folder holds config.json and
SmolLM2's tokenizer); --skills random rank-8 LoRAs on q,k,v,o, each replica keeping --max-loras of them in GPU
slots and --max-cpu-loras in host memory. The mixes are load_tests/bench_placement's trace (Zipf-popular first
skill, 1-3 skills): Poisson arrivals at --rate, --requests of them, --max-tokens each (ignore_eos). Reported per
mode: TTFT p50/p99, output tokens/s, adapter loads per 1,000 requests (the engines' own count, summed over the
replicas). Targets, affinity over unkeyed: TTFT p99 <= 0.8x, adapter loads <= 0.5x, tokens/s >= 1.0x.

--rehearse runs the same code on the CPU: the hf engine, a tiny random LLaMA, 2 replicas, few requests, so a broken
check shows before a GPU is spent on it. The last line printed is one JSON object (also OUT/cluster-check.json).

    .venv/bin/python -m load_tests.gpu.gpu_cluster_check --out gpu-cluster
    .venv/bin/python -m load_tests.gpu.gpu_cluster_check --rehearse --out /tmp/cluster-rehearsal
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from load_tests.gpu.served import Served
from load_tests.placement import bench_placement as bp
from tests.synthetic import LLAMA2_7B, dummy_model, random_skills, write_store

WEIGHTS = {1: (1.0,), 2: (0.6, 0.4), 3: (0.5, 0.3, 0.2)}
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512,
)  # fmt: skip


@dataclass(frozen=True)
class Setup(Served):
    engine: str
    replicas: int
    rate: float  # requests per second, the same for both modes
    max_tokens: int
    max_loras: int
    max_cpu_loras: int
    replica_gpus: float | None
    gpu_memory_utilization: float | None
    threads: int | None


GPU = Setup(LLAMA2_7B, "bfloat16", 64, 8, 2000, "vllm", 4, 16.0, 64, 4, 16, 0.25, 0.2, None)
REHEARSAL = Setup(TINY, "float32", 12, 4, 40, "hf", 2, 2.0, 8, 4, 4, None, None, 1)


def make_model(folder: Path, setup: Setup) -> Path:
    """The model folder: config and tokenizer (vLLM fills dummy weights); the hf engine gets real random weights."""
    dummy_model(folder, setup.shape, setup.dtype)
    if setup.engine == "hf":
        import torch
        from transformers import AutoConfig, LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(AutoConfig.from_pretrained(str(folder))).save_pretrained(str(folder))
    return folder


def models(setup: Setup, seed: int = 0) -> list[str]:
    """Each request's `model`: a forced mix from bench_placement's trace, heaviest skill first."""
    trace = bp.make_trace(setup.requests, max(setup.skills, bp.NEIGHBOURS + 1), seed)
    out = []
    for mix in trace.mixes:
        pairs = [(f"skill-{s % setup.skills:04d}", w) for s, w in zip(mix, WEIGHTS[len(mix)])]
        merged: dict[str, float] = {}
        for name, w in pairs:  # skills folded onto a smaller pool may repeat: their weights add up
            merged[name] = merged.get(name, 0.0) + w
        out.append(",".join(f"{n}={w:g}" for n, w in merged.items()))
    return out


def run_mode(setup: Setup, cfg: Any, keyed: bool, port: int, picks: list[str]) -> dict[str, float]:
    import httpx
    import ray
    from openai import OpenAI

    from load_tests.common.load import Load, summarize
    from skillpool.server.cluster.deployments import ClusterSpec
    from skillpool.server.cluster.hub import hub_handle
    from skillpool.server.cluster.launch import deploy, undeploy

    spec = ClusterSpec(cfg, setup.replicas, threads=setup.threads, keyed=keyed)
    deploy(spec, "127.0.0.1", port)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 600
        while httpx.get(url + "/healthz", timeout=10).status_code != 200:
            if time.time() > deadline:
                raise SystemExit("the cluster never became healthy")
            time.sleep(1)
        load = Load(OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600), setup.max_tokens)
        text = "Write a short story about the river, the city and the market in the morning light."
        results, wall = load.poisson(setup.rate, len(picks), lambda _c, j: (picks[j], f"{j}: {text}"))
        row = summarize(results, wall, slo_ttft=float("inf"), slo_itl=float("inf"))
        replicas = ray.get(hub_handle(spec.hub_name).replicas.remote())
        loads = sum(int(v["stats"].get("adapter_loads", 0)) for v in replicas.values())
        row["adapter_loads_per_1k"] = 1000 * loads / len(picks)
        row["replicas_seen"] = len(replicas)
        return {k: round(v, 4) for k, v in row.items()}
    finally:
        undeploy(spec, local=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rehearse", action="store_true", help="the CPU rehearsal: hf engine, tiny model, 2 replicas")
    ap.add_argument("--requests", type=int)
    ap.add_argument("--rate", type=float, help="offered requests per second (both modes)")
    ap.add_argument("--skills", type=int)
    ap.add_argument("--out", type=Path, help="folder for cluster-check.json")
    ap.add_argument("--port", type=int, help="the HTTP port (default: a free one)")
    args = ap.parse_args(argv)
    setup = REHEARSAL if args.rehearse else GPU
    setup = replace(
        setup,
        requests=args.requests or setup.requests,
        rate=args.rate or setup.rate,
        skills=args.skills or setup.skills,
    )
    from skillpool.server.cluster.deployments import REPLICA_ENV

    for k, v in REPLICA_ENV.items():
        os.environ.setdefault(k, v)
    import ray

    from skillpool.evaluation.process import free_port
    from skillpool.server.config import ServerConfig

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model", setup)
        data = Path(tmp) / "data"
        config = json.loads((model / "config.json").read_text())
        write_store(data, random_skills(config, setup.skills, setup.rank, alpha=2.0 * setup.rank), model=model)
        cfg = ServerConfig.of(
            data_dir=data,
            model=model,
            engine=setup.engine,
            device="cuda" if setup.engine == "vllm" else "cpu",
            max_loras=setup.max_loras,
            max_cpu_loras=setup.max_cpu_loras,
            max_loaded_skills=setup.max_loras if setup.engine == "hf" else None,
            replica_gpus=setup.replica_gpus,
            gpu_memory_utilization=setup.gpu_memory_utilization,
            vllm_load_format="dummy" if setup.engine == "vllm" else None,
            max_model_len=2048 if setup.engine == "vllm" else None,
        )
        picks = models(setup)
        ray.init(num_cpus=2 if args.rehearse else None, include_dashboard=False, namespace="skillpool")
        try:
            port = args.port or free_port()
            rows = {mode: run_mode(setup, cfg, mode == "affinity", port, picks) for mode in ("affinity", "unkeyed")}
        finally:
            from ray import serve

            serve.shutdown()
            ray.shutdown()
    aff, ctl = rows["affinity"], rows["unkeyed"]
    ratios = {
        "ttft_p99": round(aff["ttft_p99"] / ctl["ttft_p99"], 3),
        "adapter_loads_per_1k": round(aff["adapter_loads_per_1k"] / max(1e-9, ctl["adapter_loads_per_1k"]), 3),
        "tok_s": round(aff["tok_s"] / ctl["tok_s"], 3),
    }
    checks = {
        "ttft_p99 <= 0.8x": ratios["ttft_p99"] <= 0.8,
        "adapter loads <= 0.5x": ratios["adapter_loads_per_1k"] <= 0.5,
        "tokens/s >= 1.0x": ratios["tok_s"] >= 1.0,
    }
    print(f"{setup.replicas} {setup.engine} replicas, {setup.skills} skills, {setup.requests} requests at "
          f"{setup.rate} req/s; {time.perf_counter() - t0:.0f} s")  # fmt: skip
    print("| mode | TTFT p50 (s) | TTFT p99 (s) | tokens/s | adapter loads / 1,000 requests |")
    print("|---|---|---|---|---|")
    for mode, r in rows.items():
        print(
            f"| {mode} | {r['ttft_p50']:.3f} | {r['ttft_p99']:.3f} | {r['tok_s']:.1f} | {r['adapter_loads_per_1k']:.0f} |"
        )
    for text, ok in checks.items():
        print(f"{'holds' if ok else 'MISSES'}: affinity over unkeyed {text}")
    result = {"setup": setup.__dict__, "rehearsal": args.rehearse, **rows, "ratios": ratios, "checks": checks}
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "cluster-check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
