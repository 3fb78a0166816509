"""LoRA factors, PEFT adapter files, and the dense reference of a mix  Σ_i w_i · s_i · B_i A_i.

Applying mixes to a model: the one mixed layer (mixed_layer.py), serving's LoRABank (bank.py, with its
batch plans in batch_plans.py) and training's weighted_mix (training_mix.py); the Mix value itself is mix.py.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRAFactors:
    """One module's LoRA block: delta W = scaling · B @ A."""

    A: Tensor  # (r, in_features)
    B: Tensor  # (out_features, r)
    scaling: float

    @property
    def rank(self) -> int:
        return int(self.A.shape[0])

    def delta(self) -> Tensor:
        return self.scaling * (self.B.float() @ self.A.float())


@dataclass(frozen=True)
class LoRAAdapter:
    """A skill's LoRA blocks keyed by module path in the base model (e.g. model.layers.0.self_attn.q_proj)."""

    modules: dict[str, LoRAFactors]


class UnsupportedAdapter(ValueError):
    pass


class AdapterRejected(ValueError):
    """An adapter brought from outside that cannot serve as a skill: `code` says which check refused it, the message
    names the file, field, tensor or module (lora/peft_archive.py, lora/peft_checks.py)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def load_peft_adapter(folder: str | Path) -> LoRAAdapter:
    """Read a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors); nothing else is read."""
    folder = Path(folder)
    cfg = json.loads((folder / PEFT_CONFIG).read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise UnsupportedAdapter(f"only LoRA adapters are supported, got {cfg.get('peft_type')}")
    if cfg.get("use_dora"):
        raise UnsupportedAdapter("DoRA adapters are not supported")
    alpha_default = float(cfg.get("lora_alpha", cfg.get("r", 8)))
    alpha_pattern: dict[str, float] = cfg.get("alpha_pattern") or {}
    rslora = bool(cfg.get("use_rslora"))
    tensors = load_file(str(folder / PEFT_WEIGHTS))
    a_keys = [k for k in tensors if k.endswith(".lora_A.weight")]
    modules: dict[str, LoRAFactors] = {}
    for a_key in a_keys:
        path = a_key[: -len(".lora_A.weight")]
        path = path.removeprefix("base_model.model.")
        A = tensors[a_key]
        B = tensors[a_key.replace(".lora_A.", ".lora_B.")]
        r = A.shape[0]
        alpha = next((float(v) for k, v in alpha_pattern.items() if path.endswith(k)), alpha_default)
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        modules[path] = LoRAFactors(A=A, B=B, scaling=scaling)
    if not modules:
        raise UnsupportedAdapter(f"{folder} holds no LoRA weights")
    return LoRAAdapter(modules=modules)


def save_peft_adapter(
    adapter: LoRAAdapter,
    folder: Path,
    base_model_id: str,
    alpha: float,
    target_modules: Sequence[str],
    dropout: float = 0.0,
    use_rslora: bool = False,
) -> None:
    """Write `adapter` as plain PEFT files (adapter_config.json + adapter_model.safetensors).

    PEFT stores one r and lora_alpha for the whole adapter, so every block must have the same rank and
    scaling alpha / r (alpha / sqrt(r) with `use_rslora`); anything else would load back (here or in PEFT) with a
    different delta.
    """
    from peft import LoraConfig

    ranks = {f.rank for f in adapter.modules.values()}
    if len(ranks) != 1:
        raise ValueError(f"PEFT files hold one rank per adapter, got ranks {sorted(ranks)}")
    (rank,) = ranks
    scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
    for path, f in adapter.modules.items():
        if not math.isclose(f.scaling, scaling, rel_tol=1e-6):
            raise ValueError(
                f"{path}: scaling {f.scaling} differs from the config's {scaling} (alpha {alpha}, r {rank})"
            )
        if not any(path == t or path.endswith("." + t) for t in target_modules):
            raise ValueError(f"{path} is not matched by target_modules {list(target_modules)}: PEFT would not load it")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # annotated int; PEFT scales by a float alpha just the same
        lora_dropout=dropout,
        use_rslora=use_rslora,
        target_modules=list(target_modules),
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_model_id,
        inference_mode=True,
    )
    config.save_pretrained(str(folder))
    tensors: dict[str, Tensor] = {}
    for path, f in adapter.modules.items():
        tensors[f"base_model.model.{path}.lora_A.weight"] = f.A.detach().cpu().contiguous()
        tensors[f"base_model.model.{path}.lora_B.weight"] = f.B.detach().cpu().contiguous()
    save_file(tensors, str(folder / PEFT_WEIGHTS), metadata={"format": "pt"})


def mix_delta(mix: Sequence[tuple[LoRAFactors, float]]) -> Tensor:
    """Dense Σ w_i · s_i · B_i A_i for one module: the reference the factored path must equal."""
    return sum((w * f.delta() for f, w in mix), start=torch.zeros(()))
