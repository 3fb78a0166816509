"""LoRA dropout from four 16-bit uniforms per random 64-bit word, for training on a CPU.

torch's CPU dropout draws one Bernoulli per element from one generator in one thread: at batch 8 × 130 tokens × 576
features that is ~4 ms a call, and a step of SmolLM2 with LoRA on q, k, v and o makes 120 such calls, a fifth of
the step (docs/benchmarks.md#the-engine-on-a-cpu). Drawing 64-bit words and splitting each into four 16-bit uniforms takes a
quarter of the draws; the comparison and the scaling run vectorized. An element is dropped with probability
round(p · 65536) / 65536 (within 2⁻¹⁷ of p) and kept ones are scaled by the inverse of the keep rate, so the
expectation is the input's, as with `F.dropout`. Masks come from torch's generator: `torch.manual_seed` repeats
them, and checkpointing's recompute (which restores the generator's state) sees the same ones. Elsewhere than on
a CPU, `F.dropout` (fused on a GPU) runs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

LEVELS = 1 << 16  # the uniforms' resolution


def dropout(x: Tensor, p: float, training: bool = True) -> Tensor:
    """`F.dropout(x, p, training)` in distribution, with a quarter of the random draws on a CPU."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    drop = round(p * LEVELS)
    if x.device.type != "cpu" or drop in (0, LEVELS) or not x.is_floating_point():
        return F.dropout(x, p, training)
    n = x.numel()
    words = torch.empty((n + 3) // 4, dtype=torch.int64, device=x.device).random_(-(1 << 63), None)
    uniform = words.view(torch.int16)[:n].view(x.shape)  # each in [-32768, 32767], equally likely
    keep = uniform >= drop - LEVELS // 2
    return x * keep.to(x.dtype).mul_(LEVELS / (LEVELS - drop))


class Dropout(nn.Dropout):
    """`nn.Dropout` by `dropout` above: a drop-in for PEFT's LoRA dropout modules."""

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)


def use_fast_dropout(model: nn.Module) -> int:
    """Replace every plain `nn.Dropout` held in a PEFT LoRA layer's `lora_dropout` with `Dropout` (same p);
    returns how many were replaced."""
    count = 0
    for module in model.modules():
        table = getattr(module, "lora_dropout", None)
        if not isinstance(table, nn.ModuleDict):
            continue
        for name, layer in table.items():
            if type(layer) is nn.Dropout:
                table[name] = Dropout(layer.p)
                count += 1
    return count
