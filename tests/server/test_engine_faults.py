"""The hf engine contains faults: a row whose numbers are not finite, or whose step raises, fails alone; a loop
that dies anyway fails every queued request at once and refuses new ones (liveness turns red)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from skillpool.lora.adapter import LoRAAdapter
from skillpool.server.engines import EngineDead, EngineRequest, SamplingParams
from skillpool.server.engines.hf import HFEngine
from tests.server.test_engine import Run, adapter, make_engine, run


@pytest.fixture()
def fresh(tiny_base) -> Iterator[HFEngine]:  # type: ignore[no-untyped-def]
    eng = make_engine(tiny_base)
    yield eng
    eng.close()


def error_of(r: Run) -> str:
    text, finish, _ = r.result()
    assert finish == "error", (text, finish)
    return r.events[-1][1].error or ""


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_row_with_non_finite_logits_fails_alone(tiny_base, fresh: HFEngine, temperature: float) -> None:  # type: ignore[no-untyped-def]
    good_one = adapter(tiny_base, 4, 8, 7)
    path, f = next(iter(good_one.modules.items()))
    broken = LoRAAdapter({**good_one.modules, path: replace(f, B=torch.full_like(f.B, math.nan))})  # NaN weights
    fresh.add_skill("broken", lambda: broken)
    expected = run(fresh, ["Hello there", "A longer prompt than that"], [(("two", 1.0),), ()], max_tokens=10)
    good = [
        Run(fresh, "Hello there", (("two", 1.0),), max_tokens=10),
        Run(fresh, "A longer prompt than that", max_tokens=10),
    ]
    bad = Run(fresh, "Hello there", (("broken", 0.5), ("one", 0.5)), max_tokens=10, temperature=temperature, seed=3)
    assert "non-finite" in error_of(bad)
    assert [g.result() for g in good] == expected
    assert fresh.healthy() and run(fresh, ["Hi"], max_tokens=3)[0][1] == "length"


def test_a_temperature_too_small_to_divide_by_is_greedy(fresh: HFEngine) -> None:
    greedy = run(fresh, ["Hello there"], max_tokens=10)
    assert run(fresh, ["Hello there"], max_tokens=10, temperature=1e-300, seed=5) == greedy


def test_an_exception_inside_a_step_fails_its_rows_not_the_loop(fresh: HFEngine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Fault injection: the first token of one request raises inside the step (as a detokenizer bug would)."""
    push = HFEngine._push

    def faulty(self: HFEngine, s, token):  # type: ignore[no-untyped-def]
        if list(s.req.prompt_ids) == poison and s.out == 0:
            raise RuntimeError("injected fault")
        return push(self, s, token)

    poison = fresh.encode_chat([{"role": "user", "content": "poison"}])
    monkeypatch.setattr(HFEngine, "_push", faulty)
    bad = Run(fresh, "poison", max_tokens=6)
    assert "injected fault" in error_of(bad)
    assert fresh.healthy()
    assert run(fresh, ["Hello there"], max_tokens=6)[0][1] == "length"  # the loop still serves


def test_a_dead_loop_fails_queued_requests_at_once_and_refuses_new_ones(tiny_base) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(tiny_base, max_num_seqs=1)
    try:
        runs = [Run(eng, "Tell me a long story", max_tokens=200) for _ in range(3)]  # one runs, two wait
        while not runs[0].events:
            pass

        def crash() -> bool:
            raise RuntimeError("injected: the loop itself fails")

        eng._apply_all = crash  # type: ignore[method-assign]  # fault injection into the loop, not a step
        for r in runs:
            assert "engine stopped" in error_of(r)
        assert not eng.healthy()
        with pytest.raises(EngineDead):
            eng.submit(EngineRequest("late", [1, 2, 3], SamplingParams(max_tokens=2)), lambda ev: None)
    finally:
        eng.close()


def test_a_closed_engine_refuses_requests_instead_of_queueing_them(tiny_base) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(tiny_base)
    eng.close()
    with pytest.raises(EngineDead):
        eng.submit(EngineRequest("late", [1, 2, 3], SamplingParams(max_tokens=2)), lambda ev: None)
