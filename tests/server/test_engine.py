"""The hf engine on a tiny random LLaMA: continuous batching is exact, each row keeps its own mix,
parameters and budget, and one request's trouble stays its own."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from skillpool.lora.adapter import LoRAAdapter
from skillpool.lora.mix import Mix
from skillpool.server.engines import EngineBusy, EngineEvent, EngineRequest, SamplingParams
from skillpool.server.engines.hf import HFEngine
from tests.conftest import until
from tests.lora.test_adapter import random_adapter

_ids = itertools.count()


def adapter(tiny_base, rank: int, alpha: float, seed: int) -> LoRAAdapter:  # type: ignore[no-untyped-def]
    """A random adapter shaped from a pristine copy (an engine's model has its Linears wrapped)."""
    return random_adapter(AutoModelForCausalLM.from_pretrained(str(tiny_base.path)), rank, alpha, seed)


def make_engine(tiny_base, **kw) -> HFEngine:  # type: ignore[no-untyped-def]
    eng = HFEngine(tiny_base.path, device="cpu", **kw)
    for name, (rank, alpha, seed) in {"one": (4, 8, 1), "two": (8, 8, 2), "three": (4, 4, 3)}.items():
        a = adapter(tiny_base, rank, alpha, seed)
        eng.add_skill(name, lambda a=a: a)
    return eng


@pytest.fixture(scope="module")
def engine(tiny_base) -> HFEngine:  # type: ignore[no-untyped-def]
    return make_engine(tiny_base)


class Run:
    """One submitted request and its events, in order, with a global sequence number each."""

    clock = itertools.count()

    def __init__(self, engine: HFEngine, prompt: str, mix=(), **kw) -> None:  # type: ignore[no-untyped-def]
        self.events: list[tuple[int, EngineEvent]] = []
        self.done = threading.Event()
        params = SamplingParams(
            max_tokens=kw.get("max_tokens", 12),
            temperature=kw.get("temperature", 0.0),
            top_p=kw.get("top_p", 1.0),
            seed=kw.get("seed"),
            stop=tuple(kw.get("stop", ())),
            constraint=kw.get("constraint"),
        )
        self.id = f"r{next(_ids)}"
        ids = kw.get("prompt_ids") or engine.encode_chat([{"role": "user", "content": prompt}])
        engine.submit(EngineRequest(self.id, ids, params, Mix.of(mix)), self._sink)

    def _sink(self, ev: EngineEvent) -> None:
        self.events.append((next(self.clock), ev))
        if ev.finish_reason is not None:
            self.done.set()

    def result(self, timeout: float = 60) -> tuple[str, str, int]:
        assert self.done.wait(timeout), "request did not finish"
        evs = [e for _, e in self.events]
        assert all(e.finish_reason is None for e in evs[:-1])
        last = evs[-1]
        assert last.finish_reason is not None
        return "".join(e.text for e in evs), last.finish_reason, last.tokens


def run(engine: HFEngine, prompts: list[str], mixes=None, **kw) -> list[tuple[str, str, int]]:  # type: ignore[no-untyped-def]
    runs = [Run(engine, p, (mixes or [()] * len(prompts))[i], **kw) for i, p in enumerate(prompts)]
    return [r.result() for r in runs]


PROMPTS = ["Hello there", "What is the topic of this news article about football?", "x"]
MIXES = [(("one", 1.0),), (), (("one", 0.4), ("two", 0.6))]


def test_batched_greedy_equals_one_at_a_time(engine: HFEngine) -> None:
    batched = run(engine, PROMPTS, MIXES)
    for i, p in enumerate(PROMPTS):
        assert run(engine, [p], [MIXES[i]])[0] == batched[i]


def staggered(engine: HFEngine, specs: list[tuple[str, Any, int]]) -> list[Any]:
    """Each (prompt, mix, max_tokens) sent a few decode steps after the one before; their answers, in order."""
    runs: list[Run] = []
    for p, m, n in specs:
        runs.append(Run(engine, p, m, max_tokens=n))
        while len(runs[0].events) < 2 * len(runs) and not runs[0].done.is_set():
            time.sleep(0.002)  # let the batch run a few steps before the next one joins
    return [r.result() for r in runs]


def test_rows_joining_and_leaving_mid_decode_give_the_same_greedy_tokens(engine: HFEngine) -> None:
    """Requests arrive while others decode and leave at different lengths: every row's answer equals its solo run."""
    specs = [
        ("A long answer, please", (("two", 1.0),), 40),
        ("Hello there", (), 6),
        ("What is the topic of this news article about football?", (("one", 0.3), ("three", 0.7)), 25),
        ("x", (("one", 0.2), ("two", 0.3), ("three", 0.5)), 12),
    ]
    solo = [run(engine, [p], [m], max_tokens=n)[0] for p, m, n in specs]
    assert staggered(engine, specs) == solo


def test_a_request_arriving_mid_decode_gets_its_first_token_before_the_running_one_ends(engine: HFEngine) -> None:
    long = Run(engine, "Tell me a long story", max_tokens=150)
    while len(long.events) < 3:
        time.sleep(0.002)
    short = Run(engine, "Hi", max_tokens=3)
    short.result()
    long.result()
    assert long.events[-1][1].tokens == 150  # it really was still decoding
    first_short = short.events[0][0]
    assert first_short < long.events[-1][0]
    assert short.events[-1][0] < long.events[-1][0]  # and finished while the long one went on


def test_chunked_prefill_equals_whole_prefill(tiny_base) -> None:  # type: ignore[no-untyped-def]
    small = make_engine(tiny_base, max_num_seqs=2, max_batched_tokens=8)
    big = make_engine(tiny_base)
    try:
        prompt = "What is the topic of this news article about football? Answer with one word, please."
        assert len(small.encode_chat([{"role": "user", "content": prompt}])) > 3 * 8  # several chunks
        for mix in [(), (("one", 0.5), ("two", 0.5))]:
            assert run(small, [prompt, "Hi"], [mix, ()]) == run(big, [prompt, "Hi"], [mix, ()])
    finally:
        small.close()
        big.close()


def test_mix_changes_the_output(engine: HFEngine) -> None:
    base, one = run(engine, PROMPTS[:1]), run(engine, PROMPTS[:1], [(("one", 1.0),)])
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


def test_abort_frees_the_slot(tiny_base) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(tiny_base, max_num_seqs=1)
    try:
        first = Run(eng, "Tell me a long story", max_tokens=400)
        while not first.events:
            time.sleep(0.002)
        second = Run(eng, "Hi", max_tokens=4)  # waits: the only slot is taken
        decoded = len(first.events)
        until(lambda: len(first.events) >= decoded + 3)  # the engine read its inbox since, and stepped on without it
        assert not second.events and eng.stats()["waiting"] == 1
        eng.abort(first.id)
        assert first.result()[1] == "abort"
        assert second.result()[1] == "length"
        assert first.events[-1][1].tokens < 400
        deadline = time.time() + 5
        while eng.stats()["running"] and time.time() < deadline:
            time.sleep(0.01)
        stats = eng.stats()
        assert {k: stats[k] for k in ("running", "waiting", "known_skills", "aborted")} == {
            "running": 0,
            "waiting": 0,
            "known_skills": 3,
            "aborted": 1,
        }
    finally:
        eng.close()


def test_a_bad_row_fails_alone(engine: HFEngine) -> None:
    good = Run(engine, "Hello there", (("one", 1.0),), max_tokens=8)
    bad = Run(engine, "Hello there", (("retired", 1.0),), max_tokens=8)
    text, finish, _ = bad.result()
    assert finish == "error" and "retired" in (bad.events[-1][1].error or "") and bad.events[-1][1].not_found
    assert good.result() == run(engine, ["Hello there"], [(("one", 1.0),)], max_tokens=8)[0]


def test_a_full_waiting_queue_raises_busy(tiny_base) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(tiny_base, max_num_seqs=1, max_waiting=2)
    try:
        runs = [Run(eng, "Tell me a long story", max_tokens=300)]
        while not runs[0].events:
            time.sleep(0.002)
        runs += [Run(eng, "Hi", max_tokens=2), Run(eng, "Hi", max_tokens=2)]
        with pytest.raises(EngineBusy):
            Run(eng, "Hi", max_tokens=2)
        eng.abort(runs[0].id)
        assert [r.result()[1] for r in runs] == ["abort", "length", "length"]
        Run(eng, "Hi", max_tokens=2).result()  # room again
    finally:
        eng.close()


def test_only_max_loaded_skills_are_resident_and_answers_do_not_change(tiny_base, engine: HFEngine) -> None:  # type: ignore[no-untyped-def]
    lru = make_engine(tiny_base, max_loaded_skills=2)
    try:
        mixes = [(("one", 1.0),), (("two", 1.0),), (("three", 1.0),), (("one", 0.5), ("three", 0.5))]
        for mix in mixes * 2:
            assert run(lru, ["Hello there"], [mix]) == run(engine, ["Hello there"], [mix])
            assert lru.stats()["resident_skills"] <= 2
        assert lru.stats()["known_skills"] == 3
    finally:
        lru.close()


def test_a_replaced_skill_serves_its_new_version_to_new_requests(tiny_base) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(tiny_base)
    try:
        before = run(eng, ["Hello there"], [(("one", 1.0),)])
        running = Run(eng, "Tell me a long story", (("one", 1.0),), max_tokens=60)
        solo_old = run(eng, ["Tell me a long story"], [(("one", 1.0),)], max_tokens=60)[0]
        new = adapter(tiny_base, 4, 8, seed=11)
        eng.add_skill("one", lambda: new)
        after = run(eng, ["Hello there"], [(("one", 1.0),)])
        assert after != before
        assert running.result() == solo_old  # the row admitted before the swap kept the old weights
        deadline = time.time() + 5
        while eng.stats()["resident_skills"] != 1 and time.time() < deadline:
            time.sleep(0.01)
        assert eng.stats()["resident_skills"] == 1  # the old version left once that row finished
        eng.remove_skill("one")
        assert run(eng, ["Hello there"], [(("one", 1.0),)])[0][1] == "error"
    finally:
        eng.close()


def test_sampling_params_reject_what_would_break_a_batch() -> None:
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=4, seed=2**64)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


def test_forward_stays_float32_on_cpu(engine: HFEngine) -> None:
    assert next(engine.model.parameters()).dtype == torch.float32


def test_requests_wait_for_a_skill_slot_instead_of_failing(tiny_base, engine: HFEngine) -> None:  # type: ignore[no-untyped-def]
    lru = make_engine(tiny_base, max_loaded_skills=2)
    try:
        mixes = [(("one", 1.0),), (("two", 1.0),), (("three", 1.0),), (("one", 0.5), ("two", 0.5))]
        runs = [Run(lru, "Hello there", m, max_tokens=10) for m in mixes]  # more skills at once than slots
        assert [r.result() for r in runs] == [run(engine, ["Hello there"], [m], max_tokens=10)[0] for m in mixes]
        too_big = Run(lru, "Hi", (("one", 0.3), ("two", 0.3), ("three", 0.4)))
        assert too_big.result()[1] == "error" and "max_loaded_skills" in (too_big.events[-1][1].error or "")
    finally:
        lru.close()


def test_prefill_buckets_keep_padding_small() -> None:
    from skillpool.server.engines.rows import Row, similar_lengths

    def seq(n: int) -> Row:
        return Row(EngineRequest(f"b{n}", [1] * n, SamplingParams(max_tokens=1)), lambda ev: None, None, None)  # type: ignore[arg-type]

    buckets = similar_lengths([seq(n) for n in (44, 442, 440, 50, 150, 46)])
    assert [[len(s.req.prompt_ids) for s in b] for b in buckets] == [[44, 46, 50], [150], [440, 442]]


def test_the_kv_cache_goes_by_the_name_the_installed_forward_takes(engine: HFEngine) -> None:
    """transformers 5.24 renamed forward's past_key_values to cache and drops the old name in 5.40; older
    releases know only past_key_values. Every engine test above ran its forwards with the chosen name."""
    import inspect

    from skillpool.server.engines.kv import cache_keyword

    declared = inspect.signature(engine.model.forward).parameters
    assert engine.cache_kw in declared and engine.cache_kw == ("cache" if "cache" in declared else "past_key_values")

    class OldForward(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):  # type: ignore[no-untyped-def]
            return input_ids

    assert cache_keyword(OldForward()) == "past_key_values"


def collect_choices(engine: HFEngine, prompt: str, **kw) -> dict[int, list[EngineEvent]]:  # type: ignore[no-untyped-def]
    """A request's events by choice, once every choice has ended."""
    done, events = threading.Event(), []
    params = SamplingParams(**{"max_tokens": 12, "temperature": 0.0, **kw})
    left = set(range(params.n))

    def sink(ev: EngineEvent) -> None:
        events.append(ev)
        if ev.finish_reason is not None:
            left.discard(ev.index)
            if not left or ev.finish_reason == "error":
                done.set()

    ids = engine.encode_chat([{"role": "user", "content": prompt}])
    engine.submit(EngineRequest(f"c{next(_ids)}", ids, params), sink)
    assert done.wait(60), "request did not finish"
    out: dict[int, list[EngineEvent]] = {}
    for ev in events:
        out.setdefault(ev.index, []).append(ev)
    return out


def answer(evs: list[EngineEvent]) -> tuple[str, str | None, int]:
    return "".join(e.text for e in evs), evs[-1].finish_reason, evs[-1].tokens


def test_n_choices_prefill_the_prompt_once_and_each_samples_with_its_own_seed(engine: HFEngine) -> None:
    prefills = []
    forward = engine.model.forward

    def counting(*args, **kw):  # type: ignore[no-untyped-def]
        ids = kw.get("input_ids")
        if ids is not None and ids.shape[1] > 1:
            prefills.append(ids.shape)
        return forward(*args, **kw)

    engine.model.forward = counting  # type: ignore[method-assign]
    try:
        choices = collect_choices(engine, "Tell me a story", n=4, temperature=1.2, seed=40, max_tokens=10)
    finally:
        del engine.model.forward
    assert len(prefills) == 1 and prefills[0][0] == 1  # one prompt row, prefilled once for the four choices
    assert sorted(choices) == [0, 1, 2, 3]
    texts = [answer(choices[i]) for i in range(4)]
    assert len({t for t, _, _ in texts}) == 4  # four different samples
    for i in range(4):  # choice i is what a request of one choice with seed 40 + i answers
        assert texts[i] == answer(
            collect_choices(engine, "Tell me a story", temperature=1.2, seed=40 + i, max_tokens=10)[0]
        )
    greedy = collect_choices(engine, "Tell me a story", n=3)
    assert len({answer(greedy[i]) for i in range(3)}) == 1


def test_logprobs_come_with_their_tokens_and_the_greedy_token_leads_its_alternatives(engine: HFEngine) -> None:
    [evs] = collect_choices(engine, "Hello there", logprobs=5, max_tokens=8).values()
    lps = [lp for e in evs for lp in e.logprobs]
    assert len(lps) == evs[-1].tokens == 8
    for lp in lps:
        assert lp.logprob <= 0 and len(lp.top) == 5 and lp.top[0][0] == lp.token
        assert lp.logprob == pytest.approx(lp.top[0][1])
    assert engine.tokenizer.decode([lp.token for lp in lps]) == answer(evs)[0]
    [plain] = collect_choices(engine, "Hello there", max_tokens=8).values()
    assert answer(plain) == answer(evs) and all(not e.logprobs for e in plain)


def test_a_frequency_penalty_changes_a_repetitive_answer(engine: HFEngine) -> None:
    def repeats(text_evs: list[EngineEvent]) -> int:
        tokens = [lp.token for e in text_evs for lp in e.logprobs]
        return max(tokens.count(t) for t in set(tokens))

    [free] = collect_choices(engine, "x", logprobs=0, max_tokens=40).values()
    [held] = collect_choices(
        engine, "x", logprobs=0, max_tokens=40, frequency_penalty=2.0, presence_penalty=1.0
    ).values()
    assert repeats(free) > 2  # the tiny random model repeats itself
    assert repeats(held) < repeats(free) and answer(held) != answer(free)
    [rep] = collect_choices(engine, "x", logprobs=0, max_tokens=40, repetition_penalty=3.0).values()
    assert repeats(rep) < repeats(free)


def test_min_tokens_and_logit_bias_steer_the_end(engine: HFEngine) -> None:
    eos = engine.tokenizer.eos_token_id
    [ended] = collect_choices(engine, "Hi", logit_bias=((eos, 100.0),), logprobs=0).values()
    assert answer(ended) == ("", "stop", 0)
    assert [lp.token for e in ended for lp in e.logprobs] == [eos]  # not counted, but its logprob goes out
    [held] = collect_choices(engine, "Hi", logit_bias=((eos, 100.0),), min_tokens=3).values()
    assert answer(held)[1:] == ("stop", 3)
    [first] = collect_choices(engine, "Hi", max_tokens=1, logprobs=0).values()
    best = first[-1].logprobs[0].token
    [moved] = collect_choices(engine, "Hi", max_tokens=1, logprobs=0, logit_bias=((best, -100.0),)).values()
    assert moved[-1].logprobs[0].token != best


def test_prompt_logprobs_skip_the_prefix_cache_and_match_a_fresh_prefill(engine: HFEngine) -> None:
    prompt = "What is the topic of this news article about football? " * 3
    [warm] = collect_choices(engine, prompt, max_tokens=2).values()  # its blocks are now cached
    [a] = collect_choices(engine, prompt, max_tokens=2, prompt_logprobs=1).values()
    pl = a[0].prompt_logprobs
    ids = engine.encode_chat([{"role": "user", "content": prompt}])
    assert pl is not None and [lp.token for lp in pl] == ids[1:]
    assert all(len(lp.top) == 1 and lp.logprob <= lp.top[0][1] + 1e-6 for lp in pl)
    assert answer(a) == answer(warm)


def test_aborting_a_request_of_n_choices_ends_them_all(tiny_base) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(tiny_base, max_num_seqs=4)
    try:
        events: list[EngineEvent] = []
        ids = eng.encode_chat([{"role": "user", "content": "Tell me a long story"}])
        eng.submit(EngineRequest("many", ids, SamplingParams(max_tokens=400, n=3, ignore_eos=True)), events.append)
        while len(events) < 6:
            time.sleep(0.002)
        eng.abort("many")
        deadline = time.time() + 10
        while len([e for e in events if e.finish_reason]) < 3 and time.time() < deadline:
            time.sleep(0.01)
        assert sorted(e.index for e in events if e.finish_reason == "abort") == [0, 1, 2]
        while eng.stats()["running"] and time.time() < deadline:
            time.sleep(0.01)
        assert eng.stats()["running"] == 0 and eng.stats()["aborted"] == 1  # one request
    finally:
        eng.close()
