"""Serving's plans for one batch: each row's weighted blocks per module (`RowBlocks`), in the per-row or the
shared layout, whichever `shared_is_cheaper` says; packed siblings share one down projection (`SharedShrink`).
The mixed layer they plug into is mixed_layer.py; `LoRABank` (bank.py) builds them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

# vLLM's packed modules: siblings that read the same input, so their LoRA down-projections can share one bmm.
PACKED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SharedShrink:
    """Sibling modules' stacked A's and scales for one batch: the first sibling called computes every sibling's
    scaled intermediate in one product and one multiply, the others slice theirs from it (decode runs 6 ops per
    layer fewer for q,k,v: on a CPU a decode step's LoRA cost is mostly the count of small ops).

    Reuse is guarded by the input itself, not by call order: the cached product is used only for the very
    tensor it was computed from (same object, and not modified in place since where torch tracks that:
    inference-mode tensors keep no version counter), so a model that feeds siblings different inputs gets
    its own product each time and stays exact.
    """

    def __init__(self, A: Tensor, scale: Tensor) -> None:
        self.A = A  # (batch, Σ k * r_max, in) over the siblings, or (Σ U * r_max, in) shared by every row
        self.scale = scale  # (batch, 1, Σ k * r_max or Σ U * r_max)
        self._x: Tensor | None = None
        self._version = -1
        self._h: Tensor | None = None

    def __call__(self, x: Tensor, x3: Tensor) -> Tensor:
        version = -1 if x.is_inference() else x._version  # inference tensors keep no version counter
        if self._h is None or self._x is not x or self._version != version:
            h = torch.matmul(x3.to(self.A.dtype), self.A.transpose(-1, -2)) * self.scale
            self._h, self._x, self._version = h, x, version
        return self._h

    def clear(self) -> None:
        """Drop the cached input and product (they would otherwise live until the next batch)."""
        self._x = self._h = None


@dataclass(frozen=True)
class RowBlocks:
    """Serving plan for one module and batch: row b uses slots idx[b] with scales w·s (0 pads a short mix).

    `A`/`Bt` are either per row, (batch, k * r_max, in/out), or shared by every row, (U * r_max, in/out) for the
    U skills of the batch with `scale` zero outside a row's own blocks. Shared blocks suit decode over a small
    pool (16 rows of k=3 mixes over 10 skills: 10 blocks instead of 48): fewer bytes read per step, and a
    row joining or leaving changes only the scales, where per-row blocks copy b * k blocks of every module
    again (cost in docs/serving.md; the layouts' step time, with and without that churn:
    load_tests/serving/bench_mix_layout.py). Prefill of different mixes,
    where the multiply-adds are, stays per row.

    The LoRAX/Punica way: each row multiplies only by its own k blocks, gathered once per batch from the
    module's stack of resident blocks, so the cost grows with a row's own rank, not with the union of the
    batch's skills (16 rows with distinct k=3 mixes would otherwise stack 48 blocks for every row). A gather
    is one contiguous index_select per factor (the stacks keep A as (r, in) and B transposed as (r, out)),
    and the weights scale the rank-sized intermediate, so a new batch composition copies blocks and nothing
    else: far cheaper per module than fancy-indexing, permuting and scaling B (docs/serving.md).
    """

    A: Tensor  # (batch, k * r_max, in): row b's blocks' A, stacked (zero rows pad a short mix or rank); or (U * r_max, in)
    Bt: Tensor  # (batch, k * r_max, out): row b's blocks' B, transposed, stacked the same way; or (U * r_max, out)
    scale: Tensor  # (batch, 1, k * r_max or U * r_max): each block's w_i · s_i over its rank columns
    shared: SharedShrink | None = None  # with `cols`: this module's scaled intermediate is columns cols of shared's
    cols: slice = field(default_factory=lambda: slice(None))

    @classmethod
    def gather(cls, A: Tensor, Bt: Tensor, idx: Tensor, scale: Tensor, out: tuple[Tensor, Tensor]) -> RowBlocks:
        """From a module's stacks (slots, r, in) / (slots, r, out), rows' slots idx (b, k), scales (b, k * r),
        into `out` (b * k blocks of A and of Bt, reused memory: see `_Buffers`)."""
        b, k = idx.shape
        flat = idx.reshape(-1)
        return cls(
            torch.index_select(A, 0, flat, out=out[0]).view(b, k * A.shape[1], A.shape[2]),
            torch.index_select(Bt, 0, flat, out=out[1]).view(b, k * Bt.shape[1], Bt.shape[2]),
            scale.to(Bt.dtype)[:, None, :],
        )

    def add_delta(self, x: Tensor, y: Tensor) -> Tensor:
        x3, y3 = (x, y) if x.dim() == 3 else (x[:, None, :], y[:, None, :])
        # matmul: a bmm for per-row blocks, one plain matrix product over every row's tokens for shared ones
        if self.shared is None:
            h = torch.matmul(x3.to(self.A.dtype), self.A.transpose(-1, -2)) * self.scale
        else:
            h = self.shared(x, x3)[:, :, self.cols]
        if y.dtype != self.Bt.dtype:  # float32 blocks under a bfloat16 model (bank.py): y += delta, rounded once
            delta = torch.matmul(h, self.Bt)
            return y3.add_(delta).view(y.shape)  # y is the base Linear's fresh output: nothing else holds it
        # the up projection and the add in one op (addmm / baddbmm), as for the base Linear's bias
        if self.Bt.dim() == 2:
            out = torch.addmm(y3.reshape(-1, y3.shape[-1]), h.reshape(-1, h.shape[-1]), self.Bt)
        else:
            out = torch.baddbmm(y3, h, self.Bt)
        return out.view(y.shape)


READ_COST = 8  # reading a block element vs one multiply-add with it: a rough figure, not tuned per device


def shared_is_cheaper(rows: int, k: int, union: int, tokens: int) -> bool:
    """Whether `rows` mixes of up to k blocks each, over `union` distinct skills, run with fewer costs on shared
    union blocks (read U blocks, every row multiplies all U) than on per-row blocks (read rows * k, each row
    multiplies its k), `tokens` positions per row. A single row never is: its union is its own blocks. It
    leaves out the per-row layout's gather on every new composition, which only favours shared more."""
    per_row = rows * k * (READ_COST + tokens)
    shared = union * (READ_COST + rows * tokens)
    return shared < per_row


def with_shared(siblings: Sequence[str], own: dict[str, RowBlocks], A: Tensor | None, dim: int) -> dict[str, RowBlocks]:
    """Siblings' plans reading their scaled intermediates as consecutive column ranges of one shared down
    projection `A` (their A's concatenated along `dim`, the rank dim); without one, the plans as they are."""
    if A is None:
        return dict(own)
    shared = SharedShrink(A, torch.cat([own[p].scale for p in siblings], dim=-1))
    plans, start = {}, 0
    for path in siblings:
        cols = slice(start, start + own[path].A.shape[dim])
        start = cols.stop
        plans[path] = RowBlocks(own[path].A, own[path].Bt, own[path].scale, shared, cols)
    return plans
