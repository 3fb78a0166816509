"""SAPT routing with the real SmolLM2 token-embedding table and real benchmark inputs."""

from __future__ import annotations

import pytest
import torch

from skillpool.router import Router, RouterSettings, SAPTSettings, TokenPooler
from skillpool.router.formats import FormatModel
from skillpool.router.sapt import SAPTState
from tests.conftest import read_task

TASKS = ("agnews", "sst-2", "boolqa")


@pytest.fixture(scope="module")
def pooler(smollm) -> TokenPooler:  # type: ignore[no-untyped-def]
    return TokenPooler.from_checkpoint(smollm.path)


@pytest.fixture(scope="module")
def pooled(pooler):  # type: ignore[no-untyped-def]
    out = {}
    for t in TASKS:
        out[t] = {
            split: pooler([e["route_text"] for e in read_task("long_sequence", t, split, n)])
            for split, n in (("train", 80), ("test", 30))
        }
    return out


def _learn_all(pooled, settings: SAPTSettings) -> SAPTState:  # type: ignore[no-untyped-def]
    state = SAPTState(pooled[TASKS[0]]["train"].shape[1], settings)
    for t in TASKS:
        x = pooled[t]["train"]
        replay = {n: pooled[n]["train"][:4] for n in state.names}  # 4 stored samples per earlier task
        state = state.learn(t, x[8:], x[:8], replay)
    return state


@pytest.mark.parametrize("pool", ["mean", "max"])
def test_pooler_pools_only_the_real_tokens(pooler, pool: str) -> None:  # type: ignore[no-untyped-def]
    p = TokenPooler(pooler.weight, pooler.tokenizer, pool=pool)
    short, long = "Is the sky blue?", "A much longer request " * 20
    tokens = p.weight[torch.tensor(p.tokenizer(short, add_special_tokens=False)["input_ids"])]
    [alone] = p([short])
    assert torch.equal(alone, tokens.amax(0) if pool == "max" else tokens.mean(0))
    assert torch.equal(p([short, long])[0], alone)  # a longer neighbour (padding) changes nothing
    with pytest.raises(ValueError, match="pool"):
        TokenPooler(pooler.weight, pooler.tokenizer, pool="sum")


def test_attention_routes_each_task_to_its_block(pooled) -> None:  # type: ignore[no-untyped-def]
    state = _learn_all(pooled, SAPTSettings())
    assert state.names == list(TASKS)
    acc = [float((state.attention(pooled[t]["test"]).argmax(-1) == i).float().mean()) for i, t in enumerate(TASKS)]
    assert min(acc) >= 0.7 and sum(acc) / len(acc) >= 0.85, acc  # chance is 1/3; only 4 replay inputs per task


def test_attentive_reflection_keeps_earlier_attention(pooled) -> None:  # type: ignore[no-untyped-def]
    """With λ = 0 nothing holds the first task's attention in place while later tasks move the projector."""
    drift = {}
    for lam in (0.0, 2.0):
        state = _learn_all(pooled, SAPTSettings(arm_lambda=lam))
        first = TASKS[0]
        target = torch.tensor([state.mean_attention[first].get(n, 0.0) for n in state.names])
        now = state.attention(pooled[first]["train"][:8])
        drift[lam] = float(
            torch.nn.functional.kl_div(now.clamp_min(1e-9).log(), target.expand_as(now), reduction="batchmean")
        )
    assert drift[2.0] < drift[0.0], drift


def test_state_round_trips_through_skill_tensors(pooled) -> None:  # type: ignore[no-untyped-def]
    state = _learn_all(pooled, SAPTSettings(steps=20))
    stored = [(n, state.skill_tensors(n)) for n in state.names]
    again = SAPTState.from_skills(state.dim, state.settings, stored, state.mean_attention)
    x = pooled["sst-2"]["test"]
    assert torch.allclose(again.attention(x), state.attention(x), atol=1e-6)
    assert again.mean_attention == state.mean_attention


def test_router_in_sapt_mode(embedder, pooler) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="token embeddings"):
        Router(embedder, RouterSettings(mode="sapt"))
    router = Router(embedder, RouterSettings(mode="sapt"), pooler)
    replay: dict[str, list[str]] = {}
    formats: dict[str, FormatModel | None] = {}
    for t in TASKS:
        texts = [e["route_text"] for e in read_task("long_sequence", t, "train", 80)]
        tensors = router.prepare_keys(texts)
        sapt, attention = router.prepare_sapt(t, texts[8:], texts[:8], replay)
        router.add_skill(t, {**tensors, **sapt}, attention)
        replay[t], formats[t] = texts[:4], FormatModel.from_tensors(tensors)
    for t in TASKS:
        texts = [e["route_text"] for e in read_task("long_sequence", t, "test", 30)]
        decisions = router.route(texts)
        assert sum(bool(d.route) and d.route[0][0] == t for d in decisions) >= 21, t
        assert all(abs(sum(w for _, w in d.route) - 1) < 1e-5 for d in decisions if d.route)
        for d, grams in zip(
            decisions, router.features(texts).grams or []
        ):  # the format gate's rejects get no attention
            assert all(formats[s] is not None and formats[s].accepts([grams])[0] for s, _ in d.route)
    unrelated = router.route(["Write a haiku about autumn leaves.", "What is 17 times 23?"])
    assert all(d.reason == "below_threshold" for d in unrelated)
