"""The vLLM engine's mix plans and adapter-folder cache (no vLLM needed): grid keys, rank caps, refcounts, LRU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from skillpool.lora.adapter import (
    PEFT_CONFIG,
    LoRAAdapter,
    LoRAFactors,
    load_peft_adapter,
    mix_delta,
    save_peft_adapter,
)
from skillpool.lora.bank import LoRABank
from skillpool.lora.concat import concat_mix, zero_adapter
from skillpool.server.engines.vllm_adapters import (
    MixAdapter,
    MixCache,
    MixPlan,
    plan_mix,
    round_to_grid,
    write_concat,
)
from tests.lora.test_adapter import TARGETS, random_adapter, tiny_llama
from tests.lora.test_concat import three_skills


def adapter(seed: int, rank: int = 2) -> LoRAAdapter:
    g = torch.Generator().manual_seed(seed)
    return LoRAAdapter(
        {
            "model.layers.0.self_attn.q_proj": LoRAFactors(
                torch.randn(rank, 8, generator=g), torch.randn(8, rank, generator=g), 0.5
            )
        }
    )


def test_grid_rounding_shares_keys_and_keeps_the_total() -> None:
    a = round_to_grid([("x", 0.5), ("y", 0.3), ("z", 0.2)])
    b = round_to_grid([("z", 0.21), ("x", 0.49), ("y", 0.3)])
    assert a == b and sum(n for _, n in a) == 16
    assert round_to_grid([("x", 1 / 3), ("y", 1 / 3), ("z", 1 / 3)]) == (("x", 6), ("y", 5), ("z", 5))
    assert round_to_grid([("x", 0.98), ("y", 0.02)]) == (("x", 16),)  # a dominant skill goes as itself
    assert round_to_grid([("x", 0.0)]) == () and round_to_grid([]) == ()
    assert sum(n for _, n in round_to_grid([("x", 0.3), ("y", 0.2)])) == 8  # a half-weight mix stays half


def test_plan_caps_rank_by_dropping_the_smallest_weight() -> None:
    ranks = {"a": 8, "b": 8, "c": 8}
    p = plan_mix([("a", 0.5), ("b", 0.3), ("c", 0.2)], ranks, max_rank=16)
    assert p.capped and p.key == (("a", 10), ("b", 6))  # 0.5 / 0.8 = 0.625, 0.3 / 0.8 = 0.375
    q = plan_mix([("a", 0.5), ("b", 0.3), ("c", 0.2)], ranks, max_rank=32)
    assert not q.capped and len(q.key) == 3
    dom = plan_mix([("a", 0.92), ("b", 0.08)], ranks, max_rank=32)
    assert dom.key == (("a", 16),) and not dom.capped  # a dominant skill goes as itself
    assert plan_mix([("a", 0.85), ("b", 0.15)], ranks, max_rank=32).key == (("a", 14), ("b", 2))
    with pytest.raises(ValueError, match="above max_lora_rank"):
        plan_mix([("a", 1.0)], {"a": 64}, max_rank=16)


def make_cache(tmp_path: Path, keep: int = 1) -> tuple[MixCache, dict[str, LoRAAdapter], list[MixAdapter], list[str]]:
    skills = {"a#1": adapter(1), "b#2": adapter(2), "c#3": adapter(3)}
    loads: list[str] = []

    def loaders(key: str):  # type: ignore[no-untyped-def]
        def load() -> LoRAAdapter:
            loads.append(key)
            return skills[key]

        return load

    evicted: list[MixAdapter] = []
    cache = MixCache(tmp_path / "mixes", "tiny", loaders, keep=keep, on_evict=evicted.append)
    return cache, skills, evicted, loads


def test_cache_builds_exact_folders_once_and_shares_them(tmp_path: Path) -> None:
    cache, skills, _, loads = make_cache(tmp_path)
    plan = MixPlan((("a#1", 8), ("b#2", 8)))
    one, two = cache.acquire(plan), cache.acquire(plan)
    assert one is two and one.refs == 2 and loads == ["a#1", "b#2"] and one.rank == 4
    path = "model.layers.0.self_attn.q_proj"
    got = load_peft_adapter(one.folder).modules[path].delta()
    torch.testing.assert_close(got, mix_delta([(skills["a#1"].modules[path], 0.5), (skills["b#2"].modules[path], 0.5)]))


def test_refcounts_keep_held_adapters_and_lru_evicts_idle_ones(tmp_path: Path) -> None:
    cache, _, evicted, _ = make_cache(tmp_path, keep=1)
    p1, p2, p3 = MixPlan((("a#1", 16),)), MixPlan((("b#2", 16),)), MixPlan((("a#1", 8), ("c#3", 8)))
    e1, e2, e3 = cache.acquire(p1), cache.acquire(p2), cache.acquire(p3)
    cache.release(p1)
    cache.release(p2)  # two idle, keep=1: the least recently released (p1) goes
    assert evicted == [e1] and not e1.folder.exists() and e2.folder.exists() and e3.folder.exists()
    cache.release(p3)  # now p2 is the oldest idle one
    assert evicted == [e1, e2] and len(cache) == 1 and cache.held == 0
    with pytest.raises(RuntimeError):
        cache.release(p1)  # nobody holds it


def test_ids_and_names_are_never_reused(tmp_path: Path) -> None:
    cache, _, _, _ = make_cache(tmp_path, keep=0)
    plan = MixPlan((("a#1", 16),))
    seen = set()
    for _ in range(3):  # the same content, evicted in between: a new id each time (vLLM caches by id)
        e = cache.acquire(plan)
        seen.add((e.lora_id, e.name))
        cache.release(plan)
    assert len(seen) == 3 and len({i for i, _ in seen}) == 3


def test_a_retired_skill_version_drops_its_idle_adapters(tmp_path: Path) -> None:
    cache, _, evicted, _ = make_cache(tmp_path, keep=8)
    held, idle = MixPlan((("a#1", 8), ("b#2", 8))), MixPlan((("a#1", 16),))
    cache.acquire(held)
    cache.acquire(idle)
    cache.release(idle)
    cache.drop_skill("a#1")
    assert [e.name for e in evicted] == ["mix-2"] and len(cache) == 1  # the held one finishes its requests
    with pytest.raises(ValueError):
        cache.acquire(MixPlan(()))


def test_folder_reloads_with_plain_peft_and_matches_our_mix_layer(tmp_path: Path) -> None:
    from peft import PeftModel

    model, mix = three_skills()
    write_concat(concat_mix(mix), tmp_path / "mix", "tiny")
    cfg = json.loads((tmp_path / "mix" / PEFT_CONFIG).read_text())
    assert cfg["r"] == cfg["lora_alpha"] == 14 and cfg["use_rslora"] is False
    x = torch.randint(0, 97, (2, 9))

    bank = LoRABank(model)  # our own per-row mix layer, on the original three skills
    for i, (a, _) in enumerate(mix):
        bank.add(f"s{i}", a)
    with torch.no_grad(), bank.mixed([[(f"s{i}", w) for i, (_, w) in enumerate(mix)]] * 2):
        ours = model(x).logits
    bank.deactivate()
    with torch.no_grad():
        base = model(x).logits

    # PEFT on a fresh copy of the same base weights
    fresh = tiny_llama()
    peft = PeftModel.from_pretrained(fresh, str(tmp_path / "mix")).eval()
    with torch.no_grad():
        theirs = peft(x).logits
    assert (ours - base).abs().max() > 1e-2  # the mix changes the output, so the comparison means something
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)


def test_rslora_source_still_gives_the_exact_delta(tmp_path: Path) -> None:
    """PEFT's add_weighted_adapter("cat") copies use_rslora from the first adapter and rescales; we must not."""
    model = tiny_llama()
    src = random_adapter(model, rank=4, alpha=8, seed=5)
    save_peft_adapter(src, tmp_path / "plain", "tiny", alpha=8, target_modules=TARGETS)
    cfg_path = tmp_path / "plain" / PEFT_CONFIG
    cfg = json.loads(cfg_path.read_text())
    cfg["use_rslora"] = True  # the same tensors, now scaled alpha / sqrt(r) = 4 instead of alpha / r = 2
    cfg_path.write_text(json.dumps(cfg))
    rs = load_peft_adapter(tmp_path / "plain")
    other = random_adapter(model, rank=2, alpha=2, seed=6)
    mix = [(rs, 0.75), (other, 0.25)]
    write_concat(concat_mix(mix), tmp_path / "mix", "tiny")
    back = load_peft_adapter(tmp_path / "mix")
    written = json.loads((tmp_path / "mix" / PEFT_CONFIG).read_text())
    assert written["use_rslora"] is False and written["r"] == written["lora_alpha"] == 6
    for path, f in back.modules.items():
        assert f.scaling == 1.0
        want = 0.75 * 4.0 * (src.modules[path].B @ src.modules[path].A) + 0.25 * other.modules[path].delta()
        torch.testing.assert_close(f.delta(), want, rtol=1e-5, atol=1e-6)


def test_the_zero_adapter_folder_loads_with_zero_delta(tmp_path: Path) -> None:
    z = zero_adapter(random_adapter(tiny_llama(), rank=2, alpha=2, seed=7))
    write_concat(z, tmp_path / "zero", "tiny")
    for f in load_peft_adapter(tmp_path / "zero").modules.values():
        assert f.rank == 1 and not f.delta().any()


def test_a_write_that_fills_the_disk_leaves_no_folder_and_keeps_a_whole_one(tmp_path: Path) -> None:
    from tests.disk import fill, small_tmpfs, temp_leftovers

    model = tiny_llama()
    cat = concat_mix([(random_adapter(model, rank=4, alpha=8, seed=1), 1.0)])
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        write_concat(cat, disk / "kept", "tiny")  # a whole folder, then rewritten in place (the zero adapter is)
        write_concat(concat_mix([(random_adapter(model, rank=2, alpha=2, seed=2), 1.0)]), disk / "kept", "tiny")
        kept = load_peft_adapter(disk / "kept")
        assert {f.rank for f in kept.modules.values()} == {2}
        ballast = fill(disk)
        with pytest.raises(OSError):
            write_concat(cat, disk / "new", "tiny")
        with pytest.raises(OSError):
            write_concat(cat, disk / "kept", "tiny")
        assert not (disk / "new").exists() and temp_leftovers(disk) == []  # nothing half-written to load later
        again = load_peft_adapter(disk / "kept")  # the earlier folder is untouched
        assert all(torch.equal(again.modules[p].B, f.B) for p, f in kept.modules.items())
        ballast.unlink()
        write_concat(cat, disk / "new", "tiny")  # with room again, the same write succeeds
        assert {f.rank for f in load_peft_adapter(disk / "new").modules.values()} == {4}
