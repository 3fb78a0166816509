"""Resident skills for exact mixes on vLLM: each skill version is one pinned LoRA slot, shared by every mix.

A request acquires all its skills before it is handed to vLLM: resident ones gain a reference, missing ones are
written once (a scaling-1 PEFT folder, s_i folded into B: read from the adapter store before any resident is
touched, so a store that fails the read evicts nothing) and loaded with `add_lora` + `pin_lora`, evicting idle
residents in segmented-LRU order (../slru.py: those used once before those used again). When every slot is held by running requests, it waits (FIFO on a condition)
rather than overfill vLLM's `max_loras`. A retired version serves no new or waiting request (KeyError → 404),
and leaves vLLM once its last running request ends. Everything here runs on the engine's event loop.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import shutil
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from skillpool.lora.concat import concat_mix

from ..protocol import AdapterLoader
from ..slru import SegmentedLRU
from ..vllm_adapters import write_concat
from .tables import MIX_KEY

log = logging.getLogger(__name__)

UNWEIGHTED = frozenset({"lm_head", "embed_tokens"})  # LoRA targets vLLM runs outside add_lora_linear


@dataclass
class Resident:
    key: str  # skill version key, name#generation
    lora_id: int  # never reused: vLLM keys its adapter and prefix caches on it
    folder: Path
    refs: int = 0
    ready: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    @property
    def name(self) -> str:
        return f"skill-{self.key}-{self.lora_id}"


class SkillSlots:
    def __init__(
        self,
        folder: Path,
        base_model_id: str,
        loader: Callable[[str], AdapterLoader],
        slots: int,
        load: Callable[[Resident], Awaitable[None]],
        unload: Callable[[Resident], Awaitable[None]],
        first_id: int = 1,
    ) -> None:
        self.folder, self.base_model_id, self.slots = folder, base_model_id, slots
        shutil.rmtree(folder, ignore_errors=True)  # an earlier process's folders: its name#gen keys named other weights
        self._loader, self._load, self._unload = loader, load, unload
        self._ids = itertools.count(first_id)
        self._residents: dict[str, Resident] = {}
        self._order: SegmentedLRU[str] = SegmentedLRU(slots)  # resident keys, the next to leave first
        self._retired: set[str] = set()
        self._changed: asyncio.Condition | None = None
        self._loading: set[asyncio.Future[None]] = set()
        self._fetching: dict[str, asyncio.Future[None]] = {}  # folders being written from the store, by key
        self._leaving: set[asyncio.Future[None]] = set()  # unloads a new load waits for: vLLM's slots stay <= max

    def __len__(self) -> int:
        return len(self._residents)

    def held(self) -> int:
        return sum(r.refs > 0 for r in self._residents.values())

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:  # made on the engine loop, the first time one is needed
            self._changed = asyncio.Condition()
        return self._changed

    async def acquire(self, keys: Sequence[str]) -> dict[str, Resident]:
        """Hold every key's resident (loading it if needed); raise KeyError once a key is retired."""
        wanted = list(dict.fromkeys(keys))
        if len(wanted) > self.slots:
            raise ValueError(f"a mix of {len(wanted)} skills needs more than this engine's {self.slots} LoRA slots")
        await self._fetch(wanted)
        async with self.changed:
            while True:
                self._check_live(wanted)
                missing = [k for k in wanted if k not in self._residents]
                idle = [self._residents[k] for k in self._order if self._residents[k].refs == 0 and k not in wanted]
                if len(self._residents) - len(idle) + len(missing) <= self.slots:
                    break
                await self.changed.wait()  # every slot is held by running requests: wait for a release
            for old in idle[: max(0, len(self._residents) + len(missing) - self.slots)]:
                self._evict(old)
            held: dict[str, Resident] = {}
            for k in wanted:
                if k not in self._residents:
                    new = self._residents[k] = Resident(k, next(self._ids), self.folder / k)
                    self._track(self._bring_in(new), self._loading)
                self._order.touch(k)
                self._residents[k].refs += 1
                held[k] = self._residents[k]
        try:
            for r in held.values():
                await asyncio.shield(r.ready)
        except BaseException:
            await self.release(held.values())
            raise
        return held

    async def release(self, held: Iterable[Resident]) -> None:
        async with self.changed:
            for r in list(held):
                r.refs -= 1
                if r.refs == 0 and r.key in self._retired and self._residents.get(r.key) is r:
                    self._evict(r)
            self.changed.notify_all()

    async def retire(self, key: str) -> None:
        """The version is gone: waiting requests fail with KeyError, running ones finish, then it leaves vLLM."""
        async with self.changed:
            self._retired.add(key)
            r = self._residents.get(key)
            if r is not None and r.refs == 0:
                self._evict(r)
            elif r is None and key not in self._fetching:  # written for a request that never got a slot
                shutil.rmtree(self.folder / key, ignore_errors=True)
            self.changed.notify_all()

    async def request(
        self, resolved: Sequence[tuple[str, float]]
    ) -> tuple[Any, dict[str, Any] | None, str | None, list[Resident]]:
        """(primary LoRARequest, extra_args, cache_salt, held residents) for a resolved mix, heaviest first;
        the base model: no LoRA at all."""
        from vllm.lora.request import LoRARequest

        if not resolved:
            return None, None, None, []
        held = await self.acquire([k for k, _ in resolved])
        first = held[resolved[0][0]]
        pairs = [[held[k].lora_id, float(w)] for k, w in resolved]
        salt = "skillpool:" + ",".join(f"{k}={w!r}" for k, w in sorted(resolved))  # canonical: the pairs' order
        return LoRARequest(first.name, first.lora_id, str(first.folder)), {MIX_KEY: pairs}, salt, list(held.values())

    def _check_live(self, keys: Sequence[str]) -> None:
        for k in keys:
            if k in self._retired:
                raise KeyError(f"skill version {k} was retired")
            self._loader(k)  # KeyError once retired

    async def _fetch(self, keys: Sequence[str]) -> None:
        """Write the folders of the keys not resident (once however many requests want one at a time), before a
        slot is freed for them: what the store cannot give fails this request and leaves the residents be."""
        self._check_live(keys)
        for key in keys:
            if key in self._residents:
                continue
            task = self._fetching.get(key)
            if task is None:
                task = self._fetching[key] = asyncio.ensure_future(asyncio.to_thread(self._write, key))
                task.add_done_callback(functools.partial(self._fetched, key))
            await asyncio.shield(task)

    def _fetched(self, key: str, _: asyncio.Future[None]) -> None:
        self._fetching.pop(key, None)

    async def _bring_in(self, r: Resident) -> None:
        try:
            await asyncio.to_thread(self._write, r.key)  # written by _fetch already, unless removed since
            await asyncio.gather(*self._leaving, return_exceptions=True)
            await self._load(r)
            r.ready.set_result(None)
        except Exception as e:  # this version cannot load: its requests fail, a later try starts afresh
            log.warning("could not load skill %s into vLLM: %s", r.key, e)
            r.ready.set_exception(e)
            if self._residents.get(r.key) is r:
                del self._residents[r.key]
                self._order.discard(r.key)

    def _write(self, key: str) -> None:
        folder = self.folder / key
        if folder.exists():
            return
        adapter = self._loader(key)()
        # the hooks weight vLLM's LoRA linears per token; its embedding and logits layers take one adapter a row
        unweighted = sorted(p for p in adapter.modules if p.rsplit(".", 1)[-1] in UNWEIGHTED)
        if unweighted:
            raise ValueError(f"skill {key} adapts {unweighted[0]}, which exact mixes on vLLM cannot weight")
        write_concat(concat_mix([(adapter, 1.0)]), folder, self.base_model_id)

    def _evict(self, r: Resident) -> None:
        del self._residents[r.key]
        self._order.discard(r.key)

        async def out() -> None:
            try:
                await asyncio.shield(r.ready)
                await self._unload(r)
            except Exception as e:  # never loaded, or vLLM is shutting down: nothing to free
                log.debug("unload %s: %s", r.key, e)
            if r.key in self._retired:
                shutil.rmtree(r.folder, ignore_errors=True)

        self._track(out(), self._leaving)

    @staticmethod
    def _track(coro: Coroutine[Any, Any, None], tasks: set[asyncio.Future[None]]) -> None:
        """Run it on the loop and keep a reference until it ends (the loop holds only weak ones)."""
        task = asyncio.ensure_future(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)
