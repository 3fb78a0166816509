"""Synthetic models and skills for the tests and the benchmarks: a config-only LLaMA folder (vLLM's dummy load format
fills it with random weights), random LoRA skills on every layer's q,k,v,o as PEFT folders or as skills of a store
(with router keys from given texts: `task_skills`), and tiny skills whose router keys lie on a smooth curve by rank
(`directions`, `curve_skills`: rank neighbours near, as the router's mixed skills are near)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor

    from skillpool.lora.adapter import LoRAAdapter
    from skillpool.router import Router

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# Llama-2-7B's layers: the benchmarks' GPU shape (each adds the vocabulary it tokenizes with)
LLAMA2_7B = dict(
    hidden_size=4096,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    max_position_embeddings=4096,
)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
# A router's keys for the i-th skill written into a store
Keys = Callable[["Router", int], dict[str, "Tensor"]]


def dummy_model(folder: Path, shape: Mapping[str, Any], dtype: str, base_config: Path | None = None) -> Path:
    """config.json of a LLaMA of `shape` (hidden_size, num_hidden_layers, ...) and SmolLM2's tokenizer, no weights.

    The vocabulary size, BOS and EOS come from the base model's config unless `shape` sets them. No
    generation_config.json, so no server takes sampling defaults from one. `base_config`: a folder with SmolLM2's
    config.json and tokenizer files (default: the packaged model)."""
    from skillpool.runtime.base_model import resolve_base_model

    src = base_config or resolve_base_model().path
    base = json.loads((src / "config.json").read_text())
    config: dict[str, Any] = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        torch_dtype=dtype,
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
        vocab_size=base["vocab_size"],
        tie_word_embeddings=False,
    )
    config.update(shape)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, folder / name)
    return folder


def attention_shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """(in, out) features of every layer's q,k,v,o projection of a LLaMA-style config, by module path."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head = config.get("head_dim") or hidden // heads
    q, kv = heads * head, config["num_key_value_heads"] * head
    sizes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
    return {
        f"model.layers.{layer}.self_attn.{m}": sizes[m] for layer in range(config["num_hidden_layers"]) for m in TARGETS
    }


def random_skills(
    config: Mapping[str, Any], n: int, rank: int, seed: int = 0, alpha: float | None = None
) -> Iterator[tuple[str, LoRAAdapter]]:
    """n random rank-`rank` LoRAs on every layer's q,k,v,o (A and B ~ N(0, 0.02²), scaling alpha / rank; alpha
    defaults to rank), named skill-0000, skill-0001, ...; made one at a time, so a large pool never sits in memory."""
    import torch

    from skillpool.lora.adapter import LoRAAdapter, LoRAFactors

    shapes = attention_shapes(config)
    scaling = (alpha if alpha is not None else rank) / rank
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        blocks = {
            m: LoRAFactors(
                torch.randn(rank, d_in, generator=g) * 0.02, torch.randn(d_out, rank, generator=g) * 0.02, scaling
            )
            for m, (d_in, d_out) in shapes.items()
        }
        yield f"skill-{i:04d}", LoRAAdapter(blocks)


def save_peft(skills: Iterable[tuple[str, LoRAAdapter]], folder: Path, base_model_id: str) -> list[Path]:
    """Each skill as a PEFT folder folder/NAME (what vLLM's --lora-modules and skillpool's uploads read)."""
    from skillpool.lora.adapter import save_peft_adapter

    paths = []
    for name, adapter in skills:
        save_peft_adapter(adapter, folder / name, base_model_id, _alpha(adapter), TARGETS)
        paths.append(folder / name)
    return paths


def write_store(
    data_dir: Path,
    skills: Iterable[tuple[str, LoRAAdapter]],
    model: Path | None = None,
    keys: Keys | None = None,
    embedder_device: str | None = "cpu",
) -> list[str]:
    """The skills written into the skill store of a server's data dir, on `model` (default: the packaged one), with
    router keys from `keys` (default: random unit embeddings; requests that force a skill by name need no more)."""
    import numpy as np

    from skillpool.adapters_store.store import SkillDraft, SkillStore
    from skillpool.lora.adapter import save_peft_adapter
    from skillpool.router import Router
    from skillpool.router.embedder import SentenceEmbedder
    from skillpool.runtime.base_model import resolve_base_model

    base = resolve_base_model(model)
    store, router = SkillStore(data_dir), Router(SentenceEmbedder(device=embedder_device))
    rng = np.random.default_rng(0)

    def random_keys(router: Router, i: int) -> dict[str, Tensor]:
        emb = rng.normal(size=(32, router.embedder.dim)).astype(np.float32)
        return router.prepare_keys_from_embeddings(emb / np.linalg.norm(emb, axis=1, keepdims=True))

    names = []
    for i, (name, adapter) in enumerate(skills):
        store.write(
            SkillDraft(
                name=name,
                write_adapter=lambda f, a=adapter: save_peft_adapter(a, f, base.model_id, _alpha(a), TARGETS),
                router_tensors=(keys or random_keys)(router, i),
                meta={"base_model": {"id": base.model_id, "fingerprint": base.fingerprint}, "eval": None},
                replay=[],
                probe=[],
            )
        )
        names.append(name)
    return names


def _alpha(adapter: LoRAAdapter) -> float:
    """PEFT's lora_alpha for an adapter whose blocks share one rank and scaling."""
    block = next(iter(adapter.modules.values()))
    return block.scaling * block.rank


def task_skills(data_dir: Path, n: int, rank: int, texts: list[list[str]], seed: int = 0) -> list[str]:
    """n skills on the packaged model: random rank-r LoRAs on q,k,v,o (alpha 2r); skill i gets the router keys of
    `texts[i % len(texts)]` (one task's user texts) with a little noise."""
    import torch

    from skillpool.runtime.base_model import resolve_base_model

    config = json.loads((resolve_base_model().path / "config.json").read_text())
    prepared: list[dict[str, torch.Tensor]] = []
    g = torch.Generator().manual_seed(seed)

    def keys(router: Router, i: int) -> dict[str, torch.Tensor]:
        if not prepared:  # with the store's router, once
            prepared.extend(router.prepare_keys(t) for t in texts)
        tensors = {k: v.clone() for k, v in prepared[i % len(texts)].items()}
        for k in ("dtkr_keys", "centroid_keys"):
            tensors[k] = tensors[k] + 0.01 * torch.randn(tensors[k].shape, generator=g)
        return tensors

    skills = random_skills(config, n, rank, seed, alpha=2.0 * rank)
    return write_store(data_dir, skills, keys=keys, embedder_device=None)


def directions(skills: int, dim: int = 32, seed: int = 0) -> np.ndarray:
    """Unit vectors on a smooth curve (rank i at angles w_j * i, dim / 2 frequencies): neighbours by rank are near,
    as skills that the router mixes are near in its embedding space."""
    rng = np.random.default_rng(seed)
    freq = 2 * np.pi * (0.2 + 0.8 * rng.random(dim // 2)) / 100
    angle = np.arange(skills, dtype=np.float64)[:, None] * freq[None, :]
    return (np.concatenate([np.cos(angle), np.sin(angle)], axis=1) / np.sqrt(dim // 2)).astype(np.float32)


def curve_skills(data_dir: Path, n: int) -> None:
    """n tiny one-block adapters as store versions skill-0000... (what a store fetch reads), with router centroid
    keys by rank (`directions`)."""
    import torch

    from skillpool.adapters_store.store import SkillDraft, SkillStore
    from skillpool.lora.adapter import LoRAAdapter, LoRAFactors, save_peft_adapter
    from skillpool.router.types import CENTROID

    store, module = SkillStore(data_dir), "model.layers.0.self_attn.q_proj"
    vectors = torch.from_numpy(directions(n))
    for i in range(n):
        adapter = LoRAAdapter({module: LoRAFactors(torch.randn(2, 64) * 0.02, torch.randn(64, 2) * 0.02, 1.0)})

        def write(folder: Path, a: LoRAAdapter = adapter) -> None:
            save_peft_adapter(a, folder, "tiny", 2.0, ["q_proj"])

        store.write(SkillDraft(f"skill-{i:04d}", write, {CENTROID: vectors[i : i + 1].clone()}, {}, [], []))
