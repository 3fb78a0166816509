"""The hf engine on a tiny random LLaMA: batching is exact, each row keeps its own mix and parameters."""

from __future__ import annotations

import pytest
import torch

from skillpool.server.engine_hf import GenEvent, GenRequest, HFEngine
from tests.adapters_store.test_lora import random_adapter


@pytest.fixture(scope="module")
def engine(tiny_base) -> HFEngine:  # type: ignore[no-untyped-def]
    eng = HFEngine(tiny_base.path, device="cpu")
    eng.add_adapter("one", random_adapter(eng.model, 4, 8, seed=1))
    eng.add_adapter("two", random_adapter(eng.model, 8, 8, seed=2))
    return eng


def run(engine: HFEngine, prompts: list[str], mixes=None, **kw) -> list[tuple[str, str, int]]:  # type: ignore[no-untyped-def]
    results: list[list[GenEvent]] = [[] for _ in prompts]
    reqs = [
        GenRequest(
            prompt_ids=engine.encode_chat([{"role": "user", "content": p}]),
            mix=(mixes or [[] for _ in prompts])[i],
            max_tokens=kw.get("max_tokens", 12),
            temperature=kw.get("temperature", 0.0),
            top_p=kw.get("top_p", 1.0),
            seed=kw.get("seed"),
            stop=kw.get("stop", ()),
            on_event=results[i].append,
        )
        for i, p in enumerate(prompts)
    ]
    engine.generate(reqs)
    out = []
    for evs in results:
        assert evs and evs[-1].finish_reason is not None
        assert all(e.finish_reason is None for e in evs[:-1])
        out.append(("".join(e.text for e in evs), evs[-1].finish_reason, evs[-1].tokens))
    return out


PROMPTS = ["Hello there", "What is the topic of this news article about football?", "x"]


def test_batched_greedy_equals_one_at_a_time(engine: HFEngine) -> None:
    mixes = [[("one", 1.0)], [], [("one", 0.4), ("two", 0.6)]]
    batched = run(engine, PROMPTS, mixes)
    for i, p in enumerate(PROMPTS):
        assert run(engine, [p], [mixes[i]])[0] == batched[i]


def test_mix_changes_the_output(engine: HFEngine) -> None:
    base, one = run(engine, PROMPTS[:1]), run(engine, PROMPTS[:1], [[("one", 1.0)]])
    assert base[0][0] != one[0][0]


def test_max_tokens_gives_length(engine: HFEngine) -> None:
    [(text, finish, ntok)] = run(engine, ["Hi"], max_tokens=5)
    assert finish == "length" and ntok == 5 and text


def test_stop_string_truncates_and_finishes(engine: HFEngine) -> None:
    [(text, _, _)] = run(engine, ["Hi"], max_tokens=20)
    stop = text[3:6]
    assert len(stop) == 3
    [(stopped, finish, _)] = run(engine, ["Hi"], max_tokens=20, stop=[stop])
    assert finish == "stop" and stop not in stopped and text.startswith(stopped)


def test_seeded_sampling_is_reproducible_and_differs_from_greedy(engine: HFEngine) -> None:
    a = run(engine, PROMPTS, temperature=1.5, seed=7, max_tokens=16)
    b = run(engine, PROMPTS, temperature=1.5, seed=7, max_tokens=16)
    c = run(engine, PROMPTS, temperature=1.5, seed=8, max_tokens=16)
    assert a == b and a != c
    assert a != run(engine, PROMPTS, max_tokens=16)


def test_top_p_tiny_is_greedy(engine: HFEngine) -> None:
    assert run(engine, PROMPTS, temperature=1.0, top_p=1e-6, seed=3) == run(engine, PROMPTS)


def test_cancelled_row_stops_early(engine: HFEngine) -> None:
    events: list[GenEvent] = []
    req = GenRequest(
        prompt_ids=engine.encode_chat([{"role": "user", "content": "Hi"}]),
        mix=[],
        max_tokens=50,
        temperature=0.0,
        on_event=events.append,
    )
    req.cancelled.set()
    engine.generate([req])
    assert events[-1].finish_reason == "cancelled"


def test_forward_stays_float32_on_cpu(engine: HFEngine) -> None:
    assert next(engine.model.parameters()).dtype == torch.float32
