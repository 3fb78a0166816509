"""SkillSlots, the resident skills behind exact mixes on vLLM: a skill is written and loaded once, shared by every
mix, evicted only when idle, those used once before those used again (segmented LRU); a request waits when every slot is held, a mix wider than the
slots is refused, and a retired version fails waiting requests (KeyError → 404) and leaves once unused."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from skillpool.adapters_store.objects import StoreUnavailable
from skillpool.lora.adapter import LoRAAdapter, LoRAFactors
from skillpool.server.engines.vllm_mix.slots import Resident, SkillSlots


def adapter(seed: int) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    f = LoRAFactors(A=torch.randn(2, 8, generator=g), B=torch.randn(8, 2, generator=g), scaling=2.0)
    return LoRAAdapter(modules={"model.layers.0.self_attn.q_proj": f})


class World:
    """The live versions and what was loaded into / unloaded from 'vLLM'."""

    def __init__(self, tmp: Path, slots: int) -> None:
        self.live = {k: (lambda k=k: adapter(int(k[-1]))) for k in ("a#1", "b#2", "c#3", "d#4")}
        self.loaded: list[str] = []
        self.unloaded: list[str] = []
        self.slots = SkillSlots(tmp, "base", self.loader, slots, self.load, self.unload, first_id=10)

    def loader(self, key: str) -> Callable[[], LoRAAdapter]:
        if key not in self.live:
            raise KeyError(f"skill version {key} was retired")
        return self.live[key]

    async def load(self, r: Resident) -> None:
        assert (r.folder / "adapter_config.json").exists()  # written before vLLM reads it
        self.loaded.append(r.key)

    async def unload(self, r: Resident) -> None:
        self.unloaded.append(r.key)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_skills_load_once_and_idle_ones_leave_least_recently_used(tmp_path: Path) -> None:
    w = World(tmp_path, slots=2)

    async def scenario() -> None:
        for keys in (["a#1", "b#2"], ["a#1"], ["b#2", "a#1"]):
            await w.slots.release((await w.slots.acquire(keys)).values())
        held = await w.slots.acquire(["c#3"])  # a#1 was used last, so b#2 is the one to go
        assert list(held) == ["c#3"] and held["c#3"].lora_id == 12
        await asyncio.sleep(0)

    run(scenario())
    assert sorted(w.loaded) == ["a#1", "b#2", "c#3"] and w.unloaded == ["b#2"]  # each loaded once


def test_a_skill_used_again_stays_while_skills_used_once_come_and_go(tmp_path: Path) -> None:
    w = World(tmp_path, slots=3)
    w.live |= {f"t{i}#{5 + i}": (lambda i=i: adapter(5 + i)) for i in range(4)}

    async def scenario() -> None:
        for keys in (["a#1"], ["a#1"], ["t0#5"], ["t1#6"], ["t2#7"], ["t3#8"]):
            await w.slots.release((await w.slots.acquire(keys)).values())
            await asyncio.sleep(0)

    run(scenario())
    assert "a#1" not in w.unloaded and w.unloaded == ["t0#5", "t1#6"]  # plain LRU: a#1 would leave at t2


def test_a_request_waits_while_every_slot_is_held(tmp_path: Path) -> None:
    w = World(tmp_path, slots=2)

    async def scenario() -> None:
        held = await w.slots.acquire(["a#1", "b#2"])
        waiting = asyncio.ensure_future(w.slots.acquire(["c#3"]))
        await asyncio.sleep(0.05)  # it must not get a slot: no event says so, so it gets the loop for a while
        assert not waiting.done() and w.unloaded == []
        await w.slots.release([held["a#1"]])
        assert list(await waiting) == ["c#3"]
        await asyncio.sleep(0)

    run(scenario())
    assert w.unloaded == ["a#1"] and sorted(w.loaded) == ["a#1", "b#2", "c#3"]


def test_a_mix_wider_than_the_slots_is_refused(tmp_path: Path) -> None:
    w = World(tmp_path, slots=2)
    with pytest.raises(ValueError, match="3 skills"):
        run(w.slots.acquire(["a#1", "b#2", "c#3"]))
    assert w.loaded == []


def test_retiring_fails_waiting_requests_and_unloads_after_the_last_running_one(tmp_path: Path) -> None:
    w = World(tmp_path, slots=2)

    async def scenario() -> None:
        running = await w.slots.acquire(["a#1", "b#2"])
        waiting = asyncio.ensure_future(w.slots.acquire(["a#1", "c#3"]))
        await asyncio.sleep(0.05)  # let it reach its wait for a slot (none frees)
        del w.live["a#1"]
        await w.slots.retire("a#1")
        with pytest.raises(KeyError, match="a#1"):
            await waiting
        assert w.unloaded == []  # the running request keeps its skill
        await w.slots.release(running.values())
        await asyncio.sleep(0)
        assert w.unloaded == ["a#1"] and not (tmp_path / "a#1").exists()
        with pytest.raises(KeyError):
            await w.slots.acquire(["a#1"])

    run(scenario())


def test_a_skill_that_fails_to_load_fails_its_request_and_can_be_tried_again(tmp_path: Path) -> None:
    w = World(tmp_path, slots=2)
    w.live["d#4"] = lambda: LoRAAdapter(modules={})  # nothing to write: concat_mix refuses it

    async def scenario() -> None:
        with pytest.raises(ValueError):
            await w.slots.acquire(["a#1", "d#4"])
        assert len(w.slots) == 0 and w.slots.held() == 0  # d#4's read failed before a slot was touched
        w.live["d#4"] = lambda: adapter(4)
        await w.slots.release((await w.slots.acquire(["a#1", "d#4"])).values())

    run(scenario())
    assert sorted(w.loaded) == ["a#1", "d#4"]


def test_a_skill_whose_read_fails_evicts_no_resident(tmp_path: Path) -> None:
    """A store that fails a cold skill's read (it is down) leaves the residents in their slots, however often."""
    w = World(tmp_path, slots=2)

    def down() -> LoRAAdapter:
        raise StoreUnavailable("the adapter store is unreachable")

    w.live["d#4"] = down

    async def scenario() -> None:
        await w.slots.release((await w.slots.acquire(["a#1", "b#2"])).values())
        for keys in (["d#4"], ["a#1", "d#4"], ["d#4", "b#2"], ["d#4"]):
            with pytest.raises(StoreUnavailable):
                await w.slots.acquire(keys)
            assert len(w.slots) == 2 and w.slots.held() == 0
        await w.slots.release((await w.slots.acquire(["a#1", "b#2"])).values())
        await asyncio.sleep(0)

    run(scenario())
    assert sorted(w.loaded) == ["a#1", "b#2"] and w.unloaded == []  # loaded once, never let go


@pytest.mark.parametrize("module", ["lm_head", "model.embed_tokens"])
def test_a_skill_adapting_a_layer_the_hooks_cannot_weight_is_refused(tmp_path: Path, module: str) -> None:
    w = World(tmp_path, slots=2)
    f = adapter(4).modules["model.layers.0.self_attn.q_proj"]
    w.live["d#4"] = lambda: LoRAAdapter(modules={"model.layers.0.self_attn.q_proj": f, module: f})
    with pytest.raises(ValueError, match=f"adapts {module}, which exact mixes on vLLM cannot weight"):
        run(w.slots.acquire(["d#4"]))
    assert w.loaded == [] and not (tmp_path / "d#4").exists()  # nothing written, nothing handed to vLLM


def test_an_earlier_process_s_folder_for_the_same_key_is_never_served(tmp_path: Path) -> None:
    """Version keys restart at name#1 in every process: a folder left by the last one holds other weights."""
    stale = tmp_path / "a#1"
    stale.mkdir()
    (stale / "adapter_config.json").write_text("{}")  # what an earlier process wrote for another a#1
    w = World(tmp_path, slots=2)

    async def scenario() -> None:
        held = await w.slots.acquire(["a#1"])
        config = (held["a#1"].folder / "adapter_config.json").read_text()
        assert config != "{}" and (held["a#1"].folder / "adapter_model.safetensors").exists()
        await w.slots.release(held.values())

    run(scenario())
