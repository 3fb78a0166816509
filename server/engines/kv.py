"""The decode batch's KV cache: rows join (merged in, left-padded) and leave (selected out) between steps.

Every layer holds keys/values of shape (rows, heads, T, head_dim) in a transformers DynamicCache;
`mask` (rows, T) marks each row's real positions. Rows are left-padded to the longest, so one decode
step appends one column for all rows. Columns that no row uses any more are trimmed when rows leave.
The layers keep spare columns (`SPARE`): a decode step writes its column in place, where DynamicLayer
would concatenate, i.e. copy the whole cache of every layer at every step (its cost: docs/serving.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

SPARE = 64  # columns a layer can grow by before it reallocates (rows join or leave every few steps anyway)


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are views of buffers with spare columns, appended to in place."""

    def __init__(self, keys: Tensor, values: Tensor, spare: int = SPARE) -> None:
        super().__init__()
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True
        self._n = 0
        self._k, self._v = self._alloc(keys, keys.shape[-2], spare), self._alloc(values, values.shape[-2], spare)
        self._append(keys, values)

    @staticmethod
    def _alloc(like: Tensor, columns: int, spare: int = SPARE) -> Tensor:
        b, h, _, d = like.shape
        return like.new_empty((b, h, columns + spare, d))

    def _append(self, keys: Tensor, values: Tensor) -> None:
        n, m = self._n, keys.shape[-2]
        if n + m > self._k.shape[-2]:  # out of spare columns: reallocate with new spare ones
            k, v = self._alloc(self._k, n + m), self._alloc(self._v, n + m)
            k[:, :, :n], v[:, :, :n] = self._k[:, :, :n], self._v[:, :, :n]
            self._k, self._v = k, v
        self._k[:, :, n : n + m], self._v[:, :, n : n + m] = keys, values
        self._n = n + m
        self.keys, self.values = self._k[:, :, : self._n], self._v[:, :, : self._n]

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        self._append(key_states, value_states)
        return self._k[:, :, : self._n], self._v[:, :, : self._n]


def growing_cache(layers: Sequence[tuple[Tensor, Tensor]], spare: int = SPARE) -> DynamicCache:
    """A DynamicCache holding these keys/values per layer, with room to grow in place."""
    cache = DynamicCache()
    cache.layers = [GrowingLayer(k, v, spare) for k, v in layers]
    return cache


class KVBatch:
    def __init__(self, cache: DynamicCache, mask: Tensor) -> None:
        self.cache, self.mask = cache, mask

    @staticmethod
    def stack(rows: Sequence[Sequence[tuple[Tensor, Tensor]]], spare: int) -> KVBatch:
        """Rows' own KV (per layer (1, heads, length, head_dim); an empty list for a row without any),
        left-padded to the longest, with `spare` columns to grow into. Padding is zeros: masked scores must
        stay finite."""
        lengths = [layers[0][0].shape[2] if layers else 0 for layers in rows]
        width, ref = max(lengths), next(layers for layers in rows if layers)
        mask = torch.zeros((len(rows), width), dtype=torch.long, device=ref[0][0].device)
        for i, n in enumerate(lengths):
            mask[i, width - n :] = 1
        tensors = []
        for layer, (k0, _) in enumerate(ref):
            k = k0.new_zeros((len(rows), k0.shape[1], width, k0.shape[3]))
            v = torch.zeros_like(k)
            for i, (layers, n) in enumerate(zip(rows, lengths)):
                if n:
                    k[i, :, width - n :], v[i, :, width - n :] = layers[layer][0][0], layers[layer][1][0]
            tensors.append((k, v))
        return KVBatch(growing_cache(tensors, spare), mask)

    def row(self, i: int) -> list[tuple[Tensor, Tensor]]:
        """Row i's keys/values at its real positions only, in order: (1, heads, length, head_dim) per layer."""
        cols = self.mask[i].nonzero().squeeze(1)
        return [(k[i : i + 1].index_select(2, cols), v[i : i + 1].index_select(2, cols)) for k, v in self._tensors()]

    def _tensors(self) -> list[tuple[Tensor, Tensor]]:
        out = []
        for layer in self.cache.layers:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, Tensor) or not isinstance(values, Tensor):
                raise TypeError(f"{type(layer).__name__} is not a full-attention KV layer")
            out.append((keys, values))
        return out

    def _set(self, tensors: Sequence[tuple[Tensor, Tensor]], mask: Tensor) -> KVBatch:
        return KVBatch(growing_cache(tensors), mask)

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
