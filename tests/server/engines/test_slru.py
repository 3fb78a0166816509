"""The order resident adapters leave in (server/engines/slru.py), and the hf engine's residency that uses it."""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import pytest

from skillpool.lora.mix import Mix
from skillpool.server.engines.residency import SkillResidency
from skillpool.server.engines.slru import SegmentedLRU


def test_a_skill_used_again_outlives_newer_skills_used_once() -> None:
    order: SegmentedLRU[str] = SegmentedLRU(10)
    for key in ("hot", "hot", *(f"tail{i}" for i in range(20))):
        order.touch(key)
    assert order.protected() == ["hot"]
    assert list(order)[:3] == ["tail0", "tail1", "tail2"] and list(order)[-1] == "hot"
    assert order.first() == "tail0"


def test_the_protected_segment_keeps_its_share_and_demotes_its_least_recent() -> None:
    order: SegmentedLRU[int] = SegmentedLRU(10)  # a probation share of 0.1: one slot; nine protected
    for key in range(12):
        order.touch(key)
        order.touch(key)
    assert len(order.protected()) == order.protected_max == 9
    assert order.protected() == list(range(3, 12))
    assert list(order)[:3] == [0, 1, 2]  # demoted back to probation, least recent first
    order.touch(0)  # a use on probation promotes it again; the protected least recent (3) goes back
    assert order.protected()[-1] == 0 and 3 not in order.protected() and 3 in order


def test_without_a_capacity_it_is_plain_lru() -> None:
    order: SegmentedLRU[int] = SegmentedLRU(None)
    reference: OrderedDict[int, None] = OrderedDict()
    rng = random.Random(0)
    for _ in range(500):
        key = rng.randrange(30)
        order.touch(key)
        reference[key] = None
        reference.move_to_end(key)
        if rng.random() < 0.1:
            gone = rng.randrange(30)
            order.discard(gone)
            reference.pop(gone, None)
    assert list(order) == list(reference) and order.protected() == []


def test_discard_and_first_on_an_empty_order() -> None:
    order: SegmentedLRU[int] = SegmentedLRU(4)
    assert order.first() is None and len(order) == 0
    order.touch(0)  # a falsy key is still a key
    assert order.first() == 0 and 0 in order
    order.discard(0)
    order.discard(7)  # absent: nothing happens
    assert order.first() is None and 0 not in order


@pytest.mark.parametrize("capacity, probation", [(0, 0.1), (4, 0.0), (4, 1.5), (4, float("nan"))])
def test_bad_settings_are_refused(capacity: int, probation: float) -> None:
    with pytest.raises(ValueError):
        SegmentedLRU(capacity, probation)


class Bank(dict[str, Any]):
    """The LoRABank's membership calls, holding the loaded adapters by key."""

    def add(self, key: str, adapter: Any) -> None:
        self[key] = adapter

    def remove(self, key: str) -> None:
        del self[key]


def version(res: SkillResidency, name: str) -> str:
    key = res.resolve(Mix.of({name: 1.0})).top
    assert key is not None
    return key


def test_the_engine_keeps_a_reused_skill_through_a_pass_over_the_tail() -> None:
    bank = Bank()
    res = SkillResidency(bank, max_loaded=4)  # type: ignore[arg-type]  # the bank's membership is all it uses
    names = ["hot", *(f"tail{i}" for i in range(8))]
    for name in names:
        res.add(name, lambda n=name: f"weights of {n}", set())
    hot = version(res, "hot")
    assert res.ensure([hot], {hot}) and res.ensure([hot], {hot})
    for name in names[1:]:
        key = version(res, name)
        assert res.ensure([key], {key})
        assert hot in bank and len(bank) <= 4  # plain LRU would have let it go after four of the tail
    assert res.loads == 9 and res.hits == 1 and bank[hot] == "weights of hot"


def test_a_request_that_waits_counts_its_hits_once_it_is_admitted() -> None:
    bank = Bank()
    res = SkillResidency(bank, max_loaded=2)  # type: ignore[arg-type]
    for name in ("a", "b", "c"):
        res.add(name, lambda n=name: n, set())
    ka, kb, kc = (version(res, n) for n in ("a", "b", "c"))
    assert res.ensure([ka], {ka}) and res.ensure([kb], {kb})
    assert not res.ensure([ka, kc], {ka, kb, kc})  # b runs and a is needed: no slot for c, so the request waits
    assert res.hits == 0 and kc not in bank
    assert res.ensure([ka, kc], {ka, kc})  # b has finished: it leaves
    assert res.hits == 1 and sorted(bank) == sorted([ka, kc])
