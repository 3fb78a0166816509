"""The decode batch's KV cache: rows join (merged in, left-padded) and leave (selected out) between steps.

Every layer holds keys/values of shape (rows, heads, T, head_dim) in a transformers DynamicCache;
`mask` (rows, T) marks each row's real positions. Rows are left-padded to the longest, so one decode
step appends one column for all rows. Columns that no row uses any more are trimmed when rows leave.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import DynamicCache


class KVBatch:
    def __init__(self, cache: DynamicCache, mask: Tensor) -> None:
        self.cache, self.mask = cache, mask

    def _tensors(self) -> list[tuple[Tensor, Tensor]]:
        out = []
        for layer in self.cache.layers:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, Tensor) or not isinstance(values, Tensor):
                raise TypeError(f"{type(layer).__name__} is not a full-attention KV layer")
            out.append((keys, values))
        return out

    def _set(self, tensors: Sequence[tuple[Tensor, Tensor]], mask: Tensor) -> KVBatch:
        return KVBatch(DynamicCache(ddp_cache_data=list(tensors)), mask)

    def select(self, rows: Sequence[int]) -> KVBatch:
        """These rows only, with the leading columns none of them uses trimmed."""
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else mask.shape[1]
        return self._set(
            [(k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:]) for k, v in self._tensors()],
            mask[:, start:],
        )

    def merge(self, other: KVBatch) -> KVBatch:
        """This batch's rows, then the other's, left-padded to a common length."""
        t = max(self.mask.shape[1], other.mask.shape[1])

        def pad(x: Tensor, dim: int) -> Tensor:
            missing = t - x.shape[dim]
            if missing == 0:
                return x
            shape = list(x.shape)
            shape[dim] = missing
            return torch.cat([x.new_zeros(shape), x], dim=dim)

        tensors = [
            (torch.cat([pad(k1, 2), pad(k2, 2)]), torch.cat([pad(v1, 2), pad(v2, 2)]))
            for (k1, v1), (k2, v2) in zip(self._tensors(), other._tensors())
        ]
        return self._set(tensors, torch.cat([pad(self.mask, 1), pad(other.mask, 1)]))

    def step_inputs(self) -> tuple[DynamicCache, Tensor]:
        """The cache to run the next decode step on, and its attention mask (one new column)."""
        ones = torch.ones((self.mask.shape[0], 1), dtype=self.mask.dtype, device=self.mask.device)
        return self.cache, torch.cat([self.mask, ones], dim=1)

    def stepped(self, mask: Tensor) -> None:
        """The step ran: the cache grew by one column in place."""
        self.mask = mask
