"""The one mixed-LoRA layer, for serving and for SAPT training: y = W x + Σ_i w_i · s_i · B_i A_i x per batch row.

Every target Linear of a model is swapped for a `MixedLoRALinear` that adds the plan's delta while a plan is
set. A plan is the factored mix of one module for one batch: the rows' blocks' A's stacked into one down
projection, each block's intermediate scaled by w_i · s_i, the B's stacked into one up projection. Summing
the products B_i A_i this way is exact; averaging A's and B's separately would add cross terms B_i A_j.

Two plans fill that shape (PEFT's `_mixed_batch_forward` and LoRAX's per-row adapter indices are the models):
- `RowBlocks` (serving, `LoRABank`), in one of two layouts, whichever costs less for the batch: per row,
  each row's own k blocks gathered by slot index (b * k blocks, two bmm's per module); or shared, the union
  of the batch's skills gathered once (U blocks, two plain matrix products, each row's weights zero outside
  its own blocks). The weights scale the rank-sized intermediate either way, and packed siblings share one
  down projection (q,k,v as vLLM packs QKV).
- `WeightedBlocks` (training, `weighted_mix`): every row uses the same blocks, so they stay shared and
  un-gathered, and the per-row weights are applied on each forward because they carry the gradient back to
  the router; trainable blocks are used as given (Parameters), so the new block learns through the mix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .lora import LoRAAdapter, LoRAFactors, Mix, UnsupportedAdapter


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
        y = F.linear(x, self.base.weight, self.base.bias)  # not self.base(x): a second module call per Linear
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
            self._h, self._x, self._version = torch.matmul(x3, self.A.transpose(-1, -2)) * self.scale, x, version
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
    again (18 ms per composition on SmolLM2 here, with one every ~2 decode steps at 16 clients; the layouts'
    step time, with and without that churn: load_tests/bench_mix_layout.py). Prefill of different mixes,
    where the multiply-adds are, stays per row.

    The LoRAX/Punica way: each row multiplies only by its own k blocks, gathered once per batch from the
    module's stack of resident blocks, so the cost grows with a row's own rank, not with the union of the
    batch's skills (16 rows with distinct k=3 mixes would otherwise stack 48 blocks for every row). A gather
    is one contiguous index_select per factor (the stacks keep A as (r, in) and B transposed as (r, out)),
    and the weights scale the rank-sized intermediate, so a new batch composition copies blocks and nothing
    else: 15x cheaper per module than fancy-indexing, permuting and scaling B (decode shapes, 2 threads).
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
            h = torch.matmul(x3, self.A.transpose(-1, -2)) * self.scale
        else:
            h = self.shared(x, x3)[:, :, self.cols]
        # the up projection and the add in one op (addmm / baddbmm), as for the base Linear's bias
        if self.Bt.dim() == 2:
            out = torch.addmm(y3.reshape(-1, y3.shape[-1]), h.reshape(-1, h.shape[-1]), self.Bt)
        else:
            out = torch.baddbmm(y3, h, self.Bt)
        return out.view(y.shape)


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
        h = F.linear(F.dropout(x, self.dropout, self.layer.training).to(A.dtype), A)
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


READ_COST = 8  # reading a block element vs one multiply-add with it: a rough figure, not tuned per device


def shared_is_cheaper(rows: int, k: int, union: int, tokens: int) -> bool:
    """Whether `rows` mixes of up to k blocks each, over `union` distinct skills, run with fewer costs on shared
    union blocks (read U blocks, every row multiplies all U) than on per-row blocks (read rows * k, each row
    multiplies its k), `tokens` positions per row. A single row never is: its union is its own blocks. It
    leaves out the per-row layout's gather on every new composition, which only favours shared more."""
    per_row = rows * k * (READ_COST + tokens)
    shared = union * (READ_COST + rows * tokens)
    return shared < per_row


def _with_shared(
    siblings: Sequence[str], own: dict[str, RowBlocks], A: Tensor | None, dim: int
) -> dict[str, RowBlocks]:
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
    which made a 16-row gather ~15x slower than the copy itself (450 vs 27 us per index_select here)."""

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

    def __init__(self, model: nn.Module) -> None:
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
        self.device, self.dtype = p.device, p.dtype

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

    def activate(self, mixes: Sequence[Mix], tokens: int = 1) -> None:
        """Row b of every batched forward from now on uses `mixes[b]` (empty = base model); `tokens` is how
        many positions a row will run at once (1 in decode: the default), which picks the cheaper layout."""
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

    def _indices(self, mixes: Sequence[Mix], k: int) -> tuple[Tensor, Tensor]:
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
            plans.update(_with_shared(siblings, own, A, dim=1))
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
            plans.update(_with_shared(siblings, own, packed, dim=0))
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
    def mixed(self, mixes: Sequence[Mix], tokens: int = 1) -> Iterator[None]:
        """Within the block, row b of any batch forward uses mix `mixes[b]` (empty = base model); `tokens`:
        the positions per row of the forwards (see `activate`)."""
        self.activate(mixes, tokens)
        try:
            yield
        finally:
            self.deactivate()
