"""The mix-LoRA operation every backend implements: for each token t and output slice s,
`y[t, s] += Σ_j w[t, j] · B_s[idx[t, j]] (A_s[idx[t, j]] x[t])`, with idx −1 (and weight 0) as padding.

Shapes follow vLLM's stacked LoRA buffers: `lora_a[s]` is [slots, 1, rank, in], `lora_b[s]` is
[slots, 1, out_s, rank] (ranks zero-padded to the stack's rank, scalings already folded into B),
`idx` is [T, K] int, `w` is [T, K] float32, `y` is [T, Σ out_s] and is updated in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

Stack = Sequence[torch.Tensor]  # one of vLLM's stacked LoRA buffers per output slice
Slices = Sequence[int]  # each output slice's width


@dataclass(frozen=True, eq=False)
class MixOperands:
    """One layer's operands of the mix-LoRA operation (shapes above), checked to agree when built."""

    y: torch.Tensor
    x: torch.Tensor
    lora_a: Stack
    lora_b: Stack
    idx: torch.Tensor
    w: torch.Tensor
    output_slices: Slices

    def __post_init__(self) -> None:
        y, x, idx, w, slices = self.y, self.x, self.idx, self.w, self.output_slices
        if idx.shape != w.shape or idx.dim() != 2 or idx.shape[0] != x.shape[0] or y.shape[0] != x.shape[0]:
            raise ValueError(f"mix shapes disagree: x {tuple(x.shape)}, idx {tuple(idx.shape)}, w {tuple(w.shape)}")
        if y.shape[1] != sum(slices):
            raise ValueError(f"y has {y.shape[1]} columns, the slices {tuple(slices)} need {sum(slices)}")


def mix_lora_reference(m: MixOperands) -> None:
    """Token by token in float64: slow and obviously right, the yardstick for the fast paths."""
    y, x, idx, w = m.y, m.x, m.idx, m.w
    acc = torch.zeros(y.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].to(torch.float64)
        off = 0
        for s, out in enumerate(m.output_slices):
            for j in range(idx.shape[1]):
                slot = int(idx[t, j])
                if slot < 0:
                    continue
                a = m.lora_a[s][slot, 0].to(torch.float64)
                b = m.lora_b[s][slot, 0].to(torch.float64)
                acc[t, off : off + out] += float(w[t, j]) * (b @ (a @ xt))
            off += out
    y.add_(acc.to(y.dtype))


def dense_weights(idx: torch.Tensor, w: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[T, len(slots)] weights: token t's weight on each listed slot (0 outside its mix; repeats add up)."""
    match = (idx.unsqueeze(-1) == slots.view(1, 1, -1)).to(torch.float32)  # [T, K, U]
    return (match * w.to(torch.float32).unsqueeze(-1)).sum(dim=1)


def mix_lora_torch(m: MixOperands) -> None:
    """The batch's union of slots as two GEMMs per slice (no per-token weight gather): base tokens get an exact +0."""
    y, idx = m.y, m.idx
    used = idx[idx >= 0]
    if used.numel() == 0:
        return
    slots = torch.unique(used)
    weights = dense_weights(idx, m.w, slots)  # [T, U]
    xf = m.x.to(torch.float32)
    off = 0
    for s, out in enumerate(m.output_slices):
        a = m.lora_a[s].index_select(0, slots.to(torch.long))[:, 0].to(torch.float32)  # [U, R, in]
        b = m.lora_b[s].index_select(0, slots.to(torch.long))[:, 0].to(torch.float32)  # [U, out, R]
        u, r, _ = a.shape
        h = (xf @ a.reshape(u * r, -1).T).view(-1, u, r) * weights.unsqueeze(-1)  # [T, U, R]
        delta = h.reshape(-1, u * r) @ b.permute(0, 2, 1).reshape(u * r, out)  # [T, out]
        y[:, off : off + out] += delta.to(y.dtype)
        off += out


def vllm_add_lora_linear(
    self: Any,
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a_stacked: Stack,
    lora_b_stacked: Stack,
    scale: float,
    output_slices: Slices,
    *,
    buffer: Any = None,
    **kwargs: Any,
) -> None:
    """vLLM's `add_lora_linear`, parameter for parameter (plugin.HOOKS checks vLLM's against it): both mix punica
    wrappers take it as their method, and add each token's mix in their `mix_linear`."""
    self.mix_linear(y, x, lora_a_stacked, lora_b_stacked, scale, output_slices, buffer=buffer, **kwargs)
