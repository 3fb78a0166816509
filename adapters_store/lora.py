"""LoRA factors, PEFT adapter files, and the exact per-row mix  y = W x + Σ_i w_i · s_i · B_i A_i x.

The mix is applied in factored form: the selected A's are stacked into one rank-Σr down-projection,
each block's intermediate is scaled by w_i · s_i for the rows that use it (zero elsewhere), then the
stacked B's project back up. Summing products B_i A_i this way is exact; averaging A's and B's
separately would add cross terms B_i A_j.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

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
    """A frozen Linear plus, while a mix is active, each batch row's own weighted LoRA blocks."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.plan: RowBlocks | None = None

    @property
    def weight(self) -> Tensor:  # transformers inspects .weight (dtype/device) on some paths
        return self.base.weight

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        return y if self.plan is None else y + self.plan.delta(x)


@dataclass(frozen=True)
class RowBlocks:
    """One module's blocks for one batch: row b uses slots idx[b] with scales w·s (0 pads a short mix).

    The LoRAX/Punica way: each row multiplies only by its own k blocks, gathered once per batch from the
    module's stack of resident blocks, so the cost grows with a row's own rank, not with the union of the
    batch's skills (16 rows with distinct k=3 mixes would otherwise stack 48 blocks for every row).
    """

    A: Tensor  # (batch, k * r_max, in): row b's blocks' A, stacked (zero rows pad a short mix or rank)
    B: Tensor  # (batch, out, k * r_max): row b's blocks' B, each block's columns scaled by w_i · s_i

    @classmethod
    def gather(cls, A: Tensor, B: Tensor, idx: Tensor, scale: Tensor) -> RowBlocks:
        """From a module's stacks (slots, r, in) / (slots, out, r), rows' slots idx (b, k), scales (b, k * r)."""
        b, k = idx.shape
        r = A.shape[1]
        a = A[idx].reshape(b, k * r, A.shape[2])
        bb = B[idx].permute(0, 2, 1, 3).reshape(b, B.shape[1], k * r) * scale.to(B.dtype)[:, None, :]
        return cls(a, bb)

    def delta(self, x: Tensor) -> Tensor:
        x3 = x if x.dim() == 3 else x[:, None, :]
        out = torch.bmm(torch.bmm(x3, self.A.transpose(1, 2)), self.B.transpose(1, 2))
        return out if x.dim() == 3 else out[:, 0, :]


class _ModuleStack:
    """Every resident skill's block for one module, in slots (in place: adding a skill copies only its own)."""

    def __init__(self, layer: MixedLoRALinear, device: torch.device, dtype: torch.dtype) -> None:
        self.layer, self.device, self.dtype = layer, device, dtype
        self.A = torch.zeros(0, 0, layer.base.in_features, device=device, dtype=dtype)
        self.B = torch.zeros(0, layer.base.out_features, 0, device=device, dtype=dtype)
        self.scaling = torch.zeros(0, device=device, dtype=torch.float32)

    def _grow(self, slots: int, rank: int) -> None:
        n, r = self.A.shape[0], self.A.shape[1]
        if slots <= n and rank <= r:
            return
        n2, r2 = max(n, slots, 2 * n), max(r, rank)
        A = torch.zeros(n2, r2, self.A.shape[2], device=self.device, dtype=self.dtype)
        B = torch.zeros(n2, self.B.shape[1], r2, device=self.device, dtype=self.dtype)
        A[:n, :r], B[:n, :, :r] = self.A, self.B
        scaling = torch.zeros(n2, device=self.device, dtype=torch.float32)
        scaling[:n] = self.scaling
        self.A, self.B, self.scaling = A, B, scaling

    def put(self, slot: int, f: LoRAFactors | None) -> None:
        self._grow(slot + 1, f.rank if f is not None else 0)
        self.A[slot].zero_()
        self.B[slot].zero_()
        self.scaling[slot] = 0.0
        if f is not None:
            self.A[slot, : f.rank] = f.A.to(self.device, self.dtype)
            self.B[slot, :, : f.rank] = f.B.to(self.device, self.dtype)
            self.scaling[slot] = f.scaling


class LoRABank:
    """Holds the resident skills' factors for one base model and applies per-row mixes to it.

    Target Linears of the model are swapped for MixedLoRALinear once, on first use; each skill owns a
    slot in every module's stack. `mixed(mixes)` (or `activate`/`deactivate`) sets, for the batched
    forwards in between, each row's weighted blocks.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.stacks: dict[str, _ModuleStack] = {}
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slots: dict[str, int] = {}
        self._free: list[int] = []
        # Gathered blocks per batch composition: a decode batch keeps its rows for several steps, and prefill
        # alternates with it, so the last few are kept (the version changes whenever a skill is added or removed).
        self._version = 0
        self._plans: OrderedDict[tuple[int, tuple[tuple[tuple[str, float], ...], ...]], list[RowBlocks]] = OrderedDict()
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    def _stack(self, path: str) -> _ModuleStack:
        if path in self.stacks:
            return self.stacks[path]
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
        stack = self.stacks[path] = _ModuleStack(layer, self.device, self.dtype)
        stack._grow(len(self.slots) + len(self._free), 0)
        return stack

    def add(self, name: str, adapter: LoRAAdapter) -> None:
        """Register (or replace) a skill's blocks; call it while no batch is running."""
        for path, f in adapter.modules.items():
            base = self._stack(path).layer.base
            if f.A.shape[1] != base.in_features or f.B.shape[0] != base.out_features:
                raise UnsupportedAdapter(f"adapter {name!r} does not fit {path}: shapes differ from the base model")
        slot = self.slots.get(name)
        if slot is None:
            slot = self._free.pop() if self._free else len(self.slots)
        for path, stack in self.stacks.items():
            stack.put(slot, adapter.modules.get(path))
        self.slots[name] = slot
        self.adapters[name] = adapter
        self._version += 1
        self._plans.clear()

    def remove(self, name: str) -> None:
        slot = self.slots.pop(name, None)
        self.adapters.pop(name, None)
        if slot is not None:
            for stack in self.stacks.values():
                stack.put(slot, None)
            self._free.append(slot)
            self._version += 1
            self._plans.clear()

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    def __len__(self) -> int:
        return len(self.adapters)

    def activate(self, mixes: Sequence[Mix]) -> None:
        """Row b of every batched forward from now on uses `mixes[b]` (empty = base model)."""
        unknown = sorted({s for mix in mixes for s, w in mix if w != 0.0 and s not in self.slots})
        if unknown:
            raise KeyError(f"unknown skills in mix: {unknown}")
        k = max((len(m) for m in mixes), default=0)
        if k == 0 or not self.stacks:
            self.deactivate()
            return
        key = (self._version, tuple(tuple((s, float(w)) for s, w in m) for m in mixes))
        plans = self._plans.get(key)
        if plans is None:
            plans = self._plans[key] = self._gather(mixes, k)
            while len(self._plans) > 4:
                self._plans.popitem(last=False)
        self._plans.move_to_end(key)
        for stack, plan in zip(self.stacks.values(), plans):
            stack.layer.plan = plan

    def _gather(self, mixes: Sequence[Mix], k: int) -> list[RowBlocks]:
        idx = torch.zeros(len(mixes), k, dtype=torch.long)
        weight = torch.zeros(len(mixes), k, dtype=torch.float32)
        for b, mix in enumerate(mixes):
            for j, (s, w) in enumerate(mix):
                if w != 0.0:
                    idx[b, j], weight[b, j] = self.slots[s], w
        idx = idx.to(self.device)
        weight = weight.to(self.device)
        plans = []
        for stack in self.stacks.values():
            r = stack.A.shape[1]
            scale = (weight * stack.scaling[idx])[:, :, None].expand(-1, -1, r).reshape(len(mixes), k * r)
            plans.append(RowBlocks.gather(stack.A, stack.B, idx, scale))
        return plans

    def deactivate(self) -> None:
        for stack in self.stacks.values():
            stack.layer.plan = None

    @contextmanager
    def mixed(self, mixes: Sequence[Mix]) -> Iterator[None]:
        """Within the block, row b of any batch forward uses mix `mixes[b]` (empty = base model)."""
        self.activate(mixes)
        try:
            yield
        finally:
            self.deactivate()
