"""The one mixed-LoRA layer, for serving and for SAPT training: y = W x + Σ_i w_i · s_i · B_i A_i x per batch row.

Every target Linear of a model is swapped for a `MixedLoRALinear` that adds the plan's delta while a plan is
set. A plan is the factored mix of one module for one batch: the rows' blocks' A's stacked into one down
projection, each block's intermediate scaled by w_i · s_i, the B's stacked into one up projection. Summing
the products B_i A_i this way is exact; averaging A's and B's separately would add cross terms B_i A_j.

Two plans fill that shape (PEFT's `_mixed_batch_forward` and LoRAX's per-row adapter indices are the models):
- `RowBlocks` (serving: batch_plans.py, filled by bank.py's `LoRABank`), in one of two layouts,
  whichever costs less for the batch: per row, each row's own k blocks gathered by slot index (b * k blocks,
  two bmm's per module); or shared, the union of the batch's skills gathered once (U blocks, two plain matrix
  products, each row's weights zero outside its own blocks). The weights scale the rank-sized intermediate
  either way, and packed siblings share one down projection (q,k,v as vLLM packs QKV).
- `WeightedBlocks` (training: training_mix.py's `weighted_mix`): every row uses the same blocks, so they stay
  shared and un-gathered, and the per-row weights are applied on each forward because they carry the
  gradient back to the router; trainable blocks are used as given (Parameters), so the new block learns
  through the mix.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor, nn

from .adapter import UnsupportedAdapter


class Plan(Protocol):
    def add_delta(self, x: Tensor, y: Tensor) -> Tensor:
        """`y`, the base Linear's output for `x`, plus the plan's LoRA delta for `x`."""
        ...


class MixedLoRALinear(nn.Module):
    """A frozen Linear plus, while a plan is set, each batch row's own weighted LoRA blocks."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base
        self.plan: Plan | None = None

    @property
    def weight(self) -> Tensor:  # transformers inspects .weight (dtype/device) on some paths
        return self.base.weight

    def forward(self, x: Tensor) -> Tensor:
        y = self.base.forward(x)  # not self.base(x): a second module call per Linear; a packed base packs its own
        return y if self.plan is None else self.plan.add_delta(x, y)


def install(model: nn.Module, path: str) -> tuple[MixedLoRALinear, bool]:
    """The mixed layer at `path`, swapped in for the Linear there unless one is there already (then False)."""
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    base = getattr(parent, attr)
    if isinstance(base, MixedLoRALinear):
        return base, False
    if not isinstance(base, nn.Linear):
        raise UnsupportedAdapter(f"{path} is {type(base).__name__}, not a Linear layer")
    layer = MixedLoRALinear(base)
    setattr(parent, attr, layer)
    return layer, True
