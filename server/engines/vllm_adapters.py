"""Mix adapters for engines that take one LoRA per request (vLLM): plans, content keys and a folder cache.

A routing decision [(skill, w)] becomes a `MixPlan`: weights rounded to a 1/16 grid (so near-equal mixes share
one adapter), a skill holding >= 90% of the weight alone (the design: keep distinct adapters in flight few),
skills beyond the engine's rank budget dropped (smallest weight first, the rest renormalized,
`capped` says so). Each distinct plan is one concatenated LoRA folder (lora/concat.py) with its own
LoRA id and name, held while requests use it and evicted least-recently-used after. Ids and names are never
reused: vLLM keys its adapter and prefix caches on them, so a reused id would serve stale weights.
"""

from __future__ import annotations

import itertools
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from skillpool.adapters_store.diskio import temp_path
from skillpool.lora.adapter import LoRAAdapter, save_peft_adapter
from skillpool.lora.concat import adapter_rank, concat_mix

from .protocol import AdapterLoader

GRID = 16  # weights are multiples of 1/16


def round_to_grid(mix: Sequence[tuple[str, float]], grid: int = GRID) -> tuple[tuple[str, int], ...]:
    """Weights as multiples of 1/grid whose sum is the original sum rounded (largest remainders win ties)."""
    live = [(s, float(w)) for s, w in mix if w > 0.0]
    if not live:
        return ()
    total = max(1, round(sum(w for _, w in live) * grid))
    scaled = [(s, w * total / sum(w for _, w in live)) for s, w in live]
    units = {s: int(x) for s, x in scaled}
    order = sorted(scaled, key=lambda sx: (-(sx[1] - int(sx[1])), sx[0]))
    for s, _ in order[: total - sum(units.values())]:
        units[s] += 1
    return tuple(sorted((s, n) for s, n in units.items() if n > 0))


@dataclass(frozen=True)
class MixPlan:
    """What one request runs with: `key` identifies the adapter's content (skill version keys, grid units)."""

    key: tuple[tuple[str, int], ...]
    capped: bool = False  # skills were dropped to fit max_lora_rank

    @property
    def weights(self) -> tuple[tuple[str, float], ...]:
        return tuple((s, n / GRID) for s, n in self.key)


DOMINANT = 0.9  # a skill with this share of a mix's weight goes alone: fewer distinct adapters in flight


def plan_mix(
    mix: Sequence[tuple[str, float]], ranks: dict[str, int], max_rank: int, dominant: float = DOMINANT
) -> MixPlan:
    """The grid-rounded plan for `mix` (skills as version keys), capped to `max_rank` total LoRA rank; a
    dominant skill (>= `dominant` of the weight) goes as itself, carrying the mix's whole weight."""
    live = sorted(((s, float(w)) for s, w in mix if w > 0.0), key=lambda sw: (-sw[1], sw[0]))
    for s, _ in live:
        if ranks[s] > max_rank:
            raise ValueError(f"skill {s.split('#')[0]!r} has LoRA rank {ranks[s]}, above max_lora_rank {max_rank}")
    capped = False
    while sum(ranks[s] for s, _ in live) > max_rank:
        total = sum(w for _, w in live)
        live.pop()  # the smallest weight
        kept = sum(w for _, w in live)
        live = [(s, w * total / kept) for s, w in live]  # renormalized to the same total
        capped = True
    total = sum(w for _, w in live)
    if live and live[0][1] >= dominant * total:
        live = [(live[0][0], total)]
    return MixPlan(round_to_grid(live), capped)


@dataclass
class MixAdapter:
    """One built adapter folder: vLLM's LoRARequest is (name, lora_id, folder)."""

    name: str
    lora_id: int
    folder: Path
    rank: int
    refs: int = 0


@dataclass
class MixCache:
    """Adapter folders per plan key under `root`: refcounted while requests use them, LRU-evicted after.

    `loaders` maps a skill version key to a function that reads its adapter (the engine's registry);
    `keep` unused folders stay on disk for reuse; `on_evict` tells the engine an id is gone for good."""

    root: Path
    base_model_id: str
    loaders: Callable[[str], AdapterLoader]
    keep: int = 32
    on_evict: Callable[[MixAdapter], None] | None = None
    first_id: int = 1
    _entries: dict[tuple[tuple[str, int], ...], MixAdapter] = field(default_factory=dict)
    _idle: OrderedDict[tuple[tuple[str, int], ...], None] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._ids = itertools.count(self.first_id)
        self.builds = 0  # adapters written for vLLM to load (first use of a plan, or again after eviction)
        shutil.rmtree(self.root, ignore_errors=True)  # folders of an earlier process: ids are per process
        self.root.mkdir(parents=True, exist_ok=True)

    def acquire(self, plan: MixPlan) -> MixAdapter:
        """The adapter for `plan`, built on first use (blocking: loads skills, writes files); hold it until release."""
        if not plan.key:
            raise ValueError("the base model needs no mix adapter")
        with self._lock:
            entry = self._entries.get(plan.key)
            if entry is None:
                entry = self._build(plan)
                self._entries[plan.key] = entry
            entry.refs += 1
            self._idle.pop(plan.key, None)
            return entry

    def release(self, plan: MixPlan) -> None:
        with self._lock:
            entry = self._entries.get(plan.key)
            if entry is None or entry.refs == 0:
                raise RuntimeError(f"release of a mix adapter nobody holds: {plan.key}")
            entry.refs -= 1
            if entry.refs == 0:
                self._idle[plan.key] = None
                self._evict_beyond(self.keep)

    def drop_skill(self, version_key: str) -> None:
        """A skill version was retired: its idle adapters go now (held ones finish their requests first)."""
        with self._lock:
            for key in [k for k in self._idle if any(s == version_key for s, _ in k)]:
                self._evict(key)

    def _evict_beyond(self, keep: int) -> None:
        while len(self._idle) > keep:
            self._evict(next(iter(self._idle)))

    def _evict(self, key: tuple[tuple[str, int], ...]) -> None:
        self._idle.pop(key, None)
        entry = self._entries.pop(key)
        shutil.rmtree(entry.folder, ignore_errors=True)
        if self.on_evict is not None:
            self.on_evict(entry)

    def _build(self, plan: MixPlan) -> MixAdapter:
        lora_id = next(self._ids)
        adapters: list[tuple[LoRAAdapter, float]] = [(self.loaders(s)(), w) for s, w in plan.weights]
        mixed = concat_mix(adapters)
        folder = self.root / f"mix-{lora_id}"
        write_concat(mixed, folder, self.base_model_id)
        self.builds += 1
        return MixAdapter(f"mix-{lora_id}", lora_id, folder, sum(adapter_rank(a) for a, _ in adapters))

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def held(self) -> int:
        return sum(1 for e in self._entries.values() if e.refs > 0)


def target_names(adapter: LoRAAdapter) -> list[str]:
    """PEFT target_modules for these paths: their last names (q_proj, ...), which match every layer's module."""
    return sorted({p.rsplit(".", 1)[-1] for p in adapter.modules})


def write_concat(adapter: LoRAAdapter, folder: Path, base_model_id: str) -> None:
    """Save a scaling-1 adapter (from concat_mix or zero_adapter) as a PEFT folder: r = lora_alpha = R, no rsLoRA."""
    ranks = {f.rank for f in adapter.modules.values()}
    if len(ranks) != 1 or any(f.scaling != 1.0 for f in adapter.modules.values()):
        raise ValueError("write_concat takes one rank and scaling 1 (what concat_mix builds)")
    (rank,) = ranks
    # written beside and renamed in: a folder that exists is whole (vLLM's slots reuse one by its name)
    tmp = temp_path(folder)
    try:
        save_peft_adapter(adapter, tmp, base_model_id, alpha=float(rank), target_modules=target_names(adapter))
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
