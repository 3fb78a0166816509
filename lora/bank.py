"""Serving's bank: the resident skills' blocks of one base model, in slots, and each batch's per-row mixes
applied through the mixed layer (mixed_layer.py) as `RowBlocks` plans (batch_plans.py)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from .adapter import LoRAAdapter, LoRAFactors, UnsupportedAdapter
from .batch_plans import PACKED, RowBlocks, shared_is_cheaper, with_shared
from .mixed_layer import MixedLoRALinear, install

# One batch row's (skill, weight) pairs: a served Mix's `ranked` pairs, or raw weights (training passes a
# router's unnormalized ones); a zero weight adds nothing.
RowWeights = Iterable[tuple[str, float]]


class _ModuleStack:
    """Every resident skill's block for one module, in slots (in place: adding a skill copies only its own)."""

    def __init__(self, layer: MixedLoRALinear, device: torch.device, dtype: torch.dtype) -> None:
        self.layer, self.device, self.dtype = layer, device, dtype
        self.A = torch.zeros(0, 0, layer.base.in_features, device=device, dtype=dtype)
        self.Bt = torch.zeros(0, 0, layer.base.out_features, device=device, dtype=dtype)  # B transposed: (r, out)
        self.scaling = torch.zeros(0, device=device, dtype=torch.float32)

    def _grow(self, slots: int, rank: int) -> None:
        n, r = self.A.shape[0], self.A.shape[1]
        if slots <= n and rank <= r:
            return
        n2, r2 = max(n, slots, 2 * n), max(r, rank)
        A = torch.zeros(n2, r2, self.A.shape[2], device=self.device, dtype=self.dtype)
        Bt = torch.zeros(n2, r2, self.Bt.shape[2], device=self.device, dtype=self.dtype)
        A[:n, :r], Bt[:n, :r] = self.A, self.Bt
        scaling = torch.zeros(n2, device=self.device, dtype=torch.float32)
        scaling[:n] = self.scaling
        self.A, self.Bt, self.scaling = A, Bt, scaling

    def put(self, slot: int, f: LoRAFactors | None) -> None:
        self._grow(slot + 1, f.rank if f is not None else 0)
        self.A[slot].zero_()
        self.Bt[slot].zero_()
        self.scaling[slot] = 0.0
        if f is not None:
            self.A[slot, : f.rank] = f.A.to(self.device, self.dtype)
            self.Bt[slot, : f.rank] = f.B.T.to(self.device, self.dtype)
            self.scaling[slot] = f.scaling


class _Buffers:
    """Gather targets of one cached batch composition, reused by the composition that later takes its
    place: writing a new composition's blocks into freshly allocated memory costs a page fault per page,
    which made a gather many times slower than the copy itself (docs/serving.md)."""

    def __init__(self) -> None:
        self.tensors: dict[tuple[str, str], Tensor] = {}

    def get(self, key: tuple[str, str], shape: tuple[int, ...], like: Tensor) -> Tensor:
        """A contiguous (shape) view of the buffer for `key`, grown (doubling its first dim) when too small."""
        buf = self.tensors.get(key)
        if buf is None or buf.shape[1:] != shape[1:] or buf.shape[0] < shape[0] or buf.dtype != like.dtype:
            rows = max(shape[0], 2 * buf.shape[0]) if buf is not None and buf.shape[1:] == shape[1:] else shape[0]
            buf = self.tensors[key] = torch.empty((rows, *shape[1:]), dtype=like.dtype, device=like.device)
        return buf[: shape[0]]


class LoRABank:
    """Holds the resident skills' factors for one base model and applies per-row mixes to it.

    Target Linears of the model are swapped for MixedLoRALinear once, on first use; each skill owns a
    slot in every module's stack. `mixed(mixes)` (or `activate`/`deactivate`) sets, for the batched
    forwards in between, each row's weighted blocks.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype | None = None) -> None:
        """`dtype`: the blocks' (default the model's); float32 blocks under a bfloat16 model on a CPU compute the
        mix in float32, where oneDNN's bfloat16 products of rank-sized matrices cost several times more."""
        self.model = model
        self.stacks: dict[str, _ModuleStack] = {}
        self.adapters: dict[str, LoRAAdapter] = {}
        self.slots: dict[str, int] = {}
        self._free: list[int] = []
        # Gathered blocks per batch composition: a decode batch keeps its rows for several steps, and prefill
        # alternates with it, so the last few are kept (the version changes whenever a skill is added or removed).
        self._version = 0
        self._plans: OrderedDict[
            tuple[int, bool, tuple[tuple[tuple[str, float], ...], ...]], tuple[list[RowBlocks], _Buffers]
        ]
        self._plans = OrderedDict()
        self._spare: list[_Buffers] = []  # buffers of plans dropped: the next compositions write into them
        # The blocks of the last batch skill sets (union of slots) for shared plans, per module: (U*r, in/out).
        # Keyed by module path, and "<first sibling>#shared" for packed siblings' concatenated A's.
        self._unions: OrderedDict[tuple[int, tuple[int, ...]], dict[str, tuple[Tensor, Tensor, tuple[float, ...]]]] = (
            OrderedDict()
        )
        p = next(model.parameters())
        self.device, self.dtype = p.device, dtype or p.dtype

    def _stack(self, path: str) -> _ModuleStack:
        if path in self.stacks:
            return self.stacks[path]
        layer, _ = install(self.model, path)
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
        self._drop_plans()

    def remove(self, name: str) -> None:
        slot = self.slots.pop(name, None)
        self.adapters.pop(name, None)
        if slot is not None:
            for stack in self.stacks.values():
                stack.put(slot, None)
            self._free.append(slot)
            self._version += 1
            self._drop_plans()

    def __contains__(self, name: str) -> bool:
        return name in self.adapters

    def __len__(self) -> int:
        return len(self.adapters)

    def activate(self, rows: Sequence[RowWeights], tokens: int = 1) -> None:
        """Row b of every batched forward from now on uses `rows[b]` (empty = base model); `tokens` is how
        many positions a row will run at once (1 in decode: the default), which picks the cheaper layout."""
        mixes = [tuple(r) for r in rows]  # a row may be a one-pass iterable; it is read several times here
        unknown = sorted({s for mix in mixes for s, w in mix if w != 0.0 and s not in self.slots})
        if unknown:
            raise KeyError(f"unknown skills in mix: {unknown}")
        k = max((len(m) for m in mixes), default=0)
        union = tuple(sorted({self.slots[s] for m in mixes for s, w in m if w != 0.0}))
        if not union or not self.stacks:  # every row is the base model
            self.deactivate()
            return
        shared = shared_is_cheaper(len(mixes), k, len(union), tokens)
        key = (self._version, shared, tuple(tuple((s, float(w)) for s, w in m) for m in mixes))
        cached = self._plans.get(key)
        if cached is None:
            while len(self._plans) >= 4:  # the oldest composition is not active: its buffers are free
                self._spare.append(self._plans.popitem(last=False)[1][1])
            bufs = self._spare.pop() if self._spare else _Buffers()
            idx, weight = self._indices(mixes, k)
            plans = self._shared(idx, weight, union) if shared else self._gather(idx, weight, bufs)
            cached = self._plans[key] = (plans, bufs)
        self._plans.move_to_end(key)
        plans = cached[0]
        for stack, plan in zip(self.stacks.values(), plans):
            stack.layer.plan = plan

    def _drop_plans(self) -> None:
        self._spare.extend(bufs for _, bufs in self._plans.values())
        self._plans.clear()
        self._unions.clear()

    def _indices(self, mixes: Sequence[tuple[tuple[str, float], ...]], k: int) -> tuple[Tensor, Tensor]:
        """Each row's slots (b, k) and weights (b, k); a short mix is padded with slot 0 at weight 0."""
        idx = torch.zeros(len(mixes), k, dtype=torch.long)
        weight = torch.zeros(len(mixes), k, dtype=torch.float32)
        for b, mix in enumerate(mixes):
            for j, (s, w) in enumerate(mix):
                if w != 0.0:
                    idx[b, j], weight[b, j] = self.slots[s], w
        return idx.to(self.device), weight.to(self.device)

    def _gather(self, idx: Tensor, weight: Tensor, bufs: _Buffers) -> list[RowBlocks]:
        """Per-row plans: each row's own k blocks, gathered into `bufs`."""
        b, k = idx.shape
        plans: dict[str, RowBlocks] = {}
        for siblings in self._siblings():
            own = {}
            for path in siblings:
                stack = self.stacks[path]
                r = stack.A.shape[1]
                scale = (weight * stack.scaling[idx])[:, :, None].expand(-1, -1, r).reshape(b, k * r)
                out = (
                    bufs.get((path, "A"), (b * k, *stack.A.shape[1:]), stack.A),
                    bufs.get((path, "Bt"), (b * k, *stack.Bt.shape[1:]), stack.Bt),
                )
                own[path] = RowBlocks.gather(stack.A, stack.Bt, idx, scale, out)
            A = None
            if len(siblings) > 1:
                parts = [own[p].A for p in siblings]
                shape = (b, sum(a.shape[1] for a in parts), parts[0].shape[2])
                A = torch.cat(parts, dim=1, out=bufs.get((siblings[0], "shared"), shape, parts[0]))
            plans.update(with_shared(siblings, own, A, dim=1))
        return [plans[p] for p in self.stacks]

    def _shared(self, idx: Tensor, weight: Tensor, union: tuple[int, ...]) -> list[RowBlocks]:
        """Plans whose blocks are the union's, shared by every row: gathered once per union (a joining or
        leaving row with the same skills only changes the scales), each row scaled by its own weights."""
        b, _ = idx.shape
        key = (self._version, union)
        sel = torch.tensor(union, dtype=torch.long, device=self.device)
        blocks = self._unions.get(key)
        if blocks is None:
            if len(self._unions) >= 2:
                self._unions.popitem(last=False)
            blocks = {}
            for path, stack in self.stacks.items():
                A, Bt = stack.A.index_select(0, sel), stack.Bt.index_select(0, sel)
                scaling = tuple(stack.scaling.index_select(0, sel).tolist())
                blocks[path] = (A.reshape(-1, A.shape[2]), Bt.reshape(-1, Bt.shape[2]), scaling)
            for siblings in self._siblings():  # packed siblings' A's, concatenated once per union too
                if len(siblings) > 1:
                    cat = torch.cat([blocks[p][0] for p in siblings], dim=0)
                    blocks[siblings[0] + "#shared"] = (cat, cat, ())
            self._unions[key] = blocks
        self._unions.move_to_end(key)
        where = torch.zeros(max(union) + 1, dtype=torch.long, device=self.device)
        where[sel] = torch.arange(len(union), device=self.device)
        # (b, U): each row's weight per union skill, padding adding 0 at place 0; a module's scales are these
        # times its blocks' s_i, one tensor per distinct (s_i, rank): modules of one LoRA config share it
        w = torch.zeros(b, len(union), dtype=torch.float32, device=self.device).scatter_add_(1, where[idx], weight)
        scales: dict[tuple[tuple[float, ...], int, torch.dtype], Tensor] = {}
        plans: dict[str, RowBlocks] = {}
        for siblings in self._siblings():
            own = {}
            for path in siblings:
                A, Bt, scaling = blocks[path]
                r = A.shape[0] // len(union)
                skey = (scaling, r, Bt.dtype)
                if skey not in scales:
                    s_i = torch.tensor(scaling, dtype=torch.float32, device=self.device)
                    scales[skey] = (w * s_i).repeat_interleave(r, dim=1).to(Bt.dtype)[:, None, :]
                own[path] = RowBlocks(A, Bt, scales[skey])
            packed = blocks[siblings[0] + "#shared"][0] if len(siblings) > 1 else None
            plans.update(with_shared(siblings, own, packed, dim=0))
        return [plans[p] for p in self.stacks]

    def _siblings(self) -> list[list[str]]:
        """The resident module paths, packed siblings (q,k,v of one layer; gate,up) grouped, the rest alone."""
        groups: dict[tuple[str, int], list[str]] = {}
        for path in self.stacks:
            parent, _, name = path.rpartition(".")
            pack = next((i for i, names in enumerate(PACKED) if name in names), -1)
            key = (parent, pack) if pack >= 0 else (path, -1)
            groups.setdefault(key, []).append(path)
        return list(groups.values())

    def deactivate(self) -> None:
        for stack in self.stacks.values():
            if isinstance(stack.layer.plan, RowBlocks) and stack.layer.plan.shared is not None:
                stack.layer.plan.shared.clear()
            stack.layer.plan = None

    @contextmanager
    def mixed(self, rows: Sequence[RowWeights], tokens: int = 1) -> Iterator[None]:
        """Within the block, row b of any batch forward uses `rows[b]` (empty = base model); `tokens`:
        the positions per row of the forwards (see `activate`)."""
        self.activate(rows, tokens)
        try:
            yield
        finally:
            self.deactivate()
