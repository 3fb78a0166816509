"""Training's mix: `weighted_mix` puts the mixed layer (mixed_layer.py) on a model with blocks shared by every
row and per-row weights that carry the gradient back to the router (SAPT); the new block learns through it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .adapter import LoRAAdapter, LoRAFactors
from .dropout import dropout as lora_dropout
from .mixed_layer import MixedLoRALinear, Plan, install


class WeightedBlocks:
    """Training plan for one module: blocks (index i, factors) shared by all rows, mixed by `weights[b, i]`.

    `weights` (batch or 1, blocks) is set per batch by `WeightedMix.set_weights`, which also puts the plan on
    its layer (and takes it off again with None). Dropout (on the LoRA input, as PEFT applies it) follows the
    layer's train/eval mode.
    """

    def __init__(self, layer: MixedLoRALinear, blocks: Sequence[tuple[int, LoRAFactors]], dropout: float) -> None:
        self.layer, self.dropout = layer, dropout
        self.As = [f.A for _, f in blocks]
        self.Bs = [f.B for _, f in blocks]
        device = layer.base.weight.device
        # column j of the stacked rank belongs to block cols[j], scaled by that block's s
        self.cols = torch.cat([torch.full((f.rank,), i) for i, f in blocks]).to(device)
        self.col_scale = torch.cat([torch.full((f.rank,), f.scaling) for _, f in blocks]).to(device)
        self.weights: Tensor | None = None

    def add_delta(self, x: Tensor, y: Tensor) -> Tensor:
        return y + self.delta(x)

    def delta(self, x: Tensor) -> Tensor:
        # stacked on every forward: the trainable block's Parameters change between steps
        A, B = torch.cat(self.As), torch.cat(self.Bs, dim=1)
        assert self.weights is not None  # set_weights puts the plan on its layer only with weights
        scale = self.weights[:, self.cols] * self.col_scale  # (batch, Σr)
        h = F.linear(lora_dropout(x, self.dropout, self.layer.training).to(A.dtype), A)
        h = h * (scale[:, None, :] if h.dim() == 3 else scale)
        return F.linear(h, B).to(x.dtype)


class WeightedMix:
    """The training plans of a model while `weighted_mix` holds; `set_weights` sets every row's block weights."""

    def __init__(self, plans: dict[str, WeightedBlocks]) -> None:
        self.plans = plans

    def set_weights(self, weights: Tensor | None) -> None:
        """Row b mixes block i with weights[b, i] from now on; None: the plain base model again (and the last
        batch's graph loses its reference here)."""
        for plan in self.plans.values():
            plan.weights = None if weights is None else weights.to(plan.layer.base.weight.device)
            plan.layer.plan = None if weights is None else plan


@contextmanager
def weighted_mix(
    model: nn.Module, blocks: Sequence[LoRAAdapter], paths: Iterable[str] = (), dropout: float = 0.0
) -> Iterator[WeightedMix]:
    """Within the block, the Linears at `paths` and at every block's module paths apply the mix of `blocks`
    (block i = blocks[i]; a block lacking a module adds nothing there); on exit the model is as it came (the
    Linears it had back, or a served model's mixed layers with their plans as they were)."""
    wanted = sorted({*paths, *(p for b in blocks for p in b.modules)})
    installed: list[tuple[str, MixedLoRALinear, bool, Plan | None]] = []
    plans: dict[str, WeightedBlocks] = {}
    try:
        for path in wanted:
            layer, created = install(model, path)
            installed.append((path, layer, created, layer.plan))
            own = [(i, b.modules[path]) for i, b in enumerate(blocks) if path in b.modules]
            if own:  # a path no block has keeps the plain base output
                plans[path] = WeightedBlocks(layer, own, dropout)
            layer.plan = None  # until set_weights
        yield WeightedMix(plans)
    finally:
        for path, layer, created, before in installed:
            layer.plan = before
            if created:
                parent_path, _, attr = path.rpartition(".")
                setattr(model.get_submodule(parent_path), attr, layer.base)
