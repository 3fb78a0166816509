"""LoRA factors, PEFT adapter files, and the exact per-row mix  y = W x + Σ_i w_i · s_i · B_i A_i x.

The mix is applied in factored form: the selected A's are stacked into one rank-Σr down-projection,
each block's intermediate is scaled by w_i · s_i for the rows that use it (zero elsewhere), then the
stacked B's project back up. Summing products B_i A_i this way is exact; averaging A's and B's
separately would add cross terms B_i A_j.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.nn import functional as F

Mix = Sequence[tuple[str, float]]  # [(skill, weight), ...]

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
) -> None:
    """Write `adapter` as plain PEFT files (adapter_config.json + adapter_model.safetensors).

    PEFT stores one r and lora_alpha for the whole adapter, so every block must have the same rank and
    scaling alpha / r; anything else would load back (here or in PEFT) with a different delta.
    """
    from peft import LoraConfig

    ranks = {f.rank for f in adapter.modules.values()}
    if len(ranks) != 1:
        raise ValueError(f"PEFT files hold one rank per adapter, got ranks {sorted(ranks)}")
    (rank,) = ranks
    for path, f in adapter.modules.items():
        if not math.isclose(f.scaling, alpha / rank, rel_tol=1e-6):
            raise ValueError(f"{path}: scaling {f.scaling} differs from alpha / r = {alpha} / {rank}")
        if not any(path == t or path.endswith("." + t) for t in target_modules):
            raise ValueError(f"{path} is not matched by target_modules {list(target_modules)}: PEFT would not load it")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # annotated int; PEFT scales by a float alpha just the same
        lora_dropout=dropout,
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


class MixedLoRALinear(nn.Module):
    """A frozen Linear plus a per-batch stack of LoRA blocks with per-row block weights."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.A_cat: Tensor | None = None  # (R, in)
        self.B_cat: Tensor | None = None  # (out, R)
        self.row_scale: Tensor | None = None  # (batch, R): w_i · s_i on block i's columns, else 0

    @property
    def weight(self) -> Tensor:  # transformers inspects .weight (dtype/device) on some paths
        return self.base.weight

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        if self.A_cat is None or self.row_scale is None or self.B_cat is None:
            return y
        h = F.linear(x, self.A_cat)  # (b, t, R)
        scale = self.row_scale.to(h.dtype)
        h = h * (scale[:, None, :] if h.dim() == 3 else scale)
        return y + F.linear(h, self.B_cat)


class LoRABank:
    """Holds every loaded skill's factors for one base model and applies per-row mixes to it.

    `install` swaps the target Linears of the model for MixedLoRALinear once; `mixed(mixes)` then
    sets, for the duration of one batched forward/generate, each row's weighted blocks.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.layers: dict[str, MixedLoRALinear] = {}
        self.adapters: dict[str, LoRAAdapter] = {}
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    def _ensure_wrapped(self, path: str) -> MixedLoRALinear:
        if path in self.layers:
            return self.layers[path]
        parent_path, _, attr = path.rpartition(".")
        parent = self.model.get_submodule(parent_path)
        base = getattr(parent, attr)
        if isinstance(base, MixedLoRALinear):
            layer = base
        elif isinstance(base, nn.Linear):
            layer = MixedLoRALinear(base)
            setattr(parent, attr, layer)
        else:
            raise UnsupportedAdapter(f"{path} is {type(base).__name__}, not a Linear layer")
        self.layers[path] = layer
        return layer

    def add(self, name: str, adapter: LoRAAdapter) -> None:
        """Register (or replace) a skill's blocks; safe to call while no batch is running."""
        for path, f in adapter.modules.items():
            layer = self._ensure_wrapped(path)
            if f.A.shape[1] != layer.base.in_features or f.B.shape[0] != layer.base.out_features:
                raise UnsupportedAdapter(f"adapter {name!r} does not fit {path}: shapes differ from the base model")
        self.adapters[name] = LoRAAdapter(
            modules={
                p: LoRAFactors(f.A.to(self.device, self.dtype), f.B.to(self.device, self.dtype), f.scaling)
                for p, f in adapter.modules.items()
            }
        )

    def remove(self, name: str) -> None:
        self.adapters.pop(name, None)

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    @contextmanager
    def mixed(self, mixes: Sequence[Mix]) -> Iterator[None]:
        """Within the block, row b of any batch forward uses mix `mixes[b]` (empty = base model)."""
        used = sorted({s for mix in mixes for s, w in mix if w != 0.0})
        unknown = [s for s in used if s not in self.adapters]
        if unknown:
            raise KeyError(f"unknown skills in mix: {unknown}")
        try:
            for path, layer in self.layers.items():
                blocks = [(s, self.adapters[s].modules[path]) for s in used if path in self.adapters[s].modules]
                if not blocks:
                    continue
                layer.A_cat = torch.cat([f.A for _, f in blocks], dim=0)
                layer.B_cat = torch.cat([f.B for _, f in blocks], dim=1)
                scale = torch.zeros(len(mixes), layer.A_cat.shape[0], device=self.device, dtype=torch.float32)
                for b, mix in enumerate(mixes):
                    weights = dict(mix)
                    col = 0
                    for s, f in blocks:
                        if s in weights:
                            scale[b, col : col + f.rank] = weights[s] * f.scaling
                        col += f.rank
                layer.row_scale = scale
            yield
        finally:
            for layer in self.layers.values():
                layer.A_cat = layer.B_cat = layer.row_scale = None
