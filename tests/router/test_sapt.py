"""SAPT routing with the real SmolLM2 token-embedding table and real benchmark inputs."""

from __future__ import annotations

import pytest
import torch

from skillpool.router import Router, RouterSettings, SAPTSettings, TokenPooler
from skillpool.router.formats import FormatModel
from skillpool.router.sapt import FeatureStats, SAPTState
from tests.datasets import read_task

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
    assert again.features.keys() == state.features.keys() == set(TASKS)
    for n, f in state.features.items():
        g = again.features[n]
        assert torch.equal(g.mean, f.mean) and torch.equal(g.factor, f.factor) and g.rest == pytest.approx(f.rest)
    # skills stored before generative replay have no Gaussian: left out, not an error
    old = [(n, {k: v for k, v in t.items() if not k.startswith("sapt_feat_")}) for n, t in stored]
    assert SAPTState.from_skills(state.dim, state.settings, old, state.mean_attention).features == {}


def test_feature_stats_fit_the_inputs_gaussian() -> None:
    g = torch.Generator().manual_seed(0)
    d, r, n = 20, 3, 4000
    mean, basis = torch.randn(d, generator=g), torch.randn(d, r, generator=g) * 2
    x = mean + torch.randn(n, r, generator=g) @ basis.T + 0.3 * torch.randn(n, d, generator=g)
    stats = FeatureStats.fit(x, rank=r)
    assert stats.factor.shape == (d, r)
    want = torch.cov(x.T)
    got = stats.factor @ stats.factor.T + stats.rest**2 * torch.eye(d)
    assert torch.allclose(stats.mean, x.mean(0), atol=1e-5)
    assert (got - want).norm() < 0.05 * want.norm()  # the low-rank part and the isotropic rest
    draws = stats.sample(n, torch.Generator().manual_seed(1))
    assert (torch.cov(draws.T) - want).norm() < 0.1 * want.norm()
    assert (draws.mean(0) - stats.mean).norm() < 4 * (want.trace() / n).sqrt()  # 4 standard errors
    one = FeatureStats.fit(x[:1], rank=r)  # a single input: a point, not an error
    assert one.factor.shape == (d, 0) and torch.equal(one.sample(2, g), x[:1].expand(2, -1))


def test_generative_replay_keeps_the_first_task_routed(pooler) -> None:  # type: ignore[no-untyped-def]
    """agnews then dbpedia (the same instruction shape), 2 stored replay inputs as the trainer keeps of 100
    rows: without draws from agnews' Gaussian, learning dbpedia pulls a quarter of agnews to it."""
    tasks = ("agnews", "dbpedia")
    data = {
        t: {
            s: pooler([e["route_text"] for e in read_task("long_sequence", t, s, k)])
            for s, k in (("train", 100), ("test", 50))
        }
        for t in tasks
    }
    acc = {}
    for generated in (0, 64):
        state, replay = SAPTState(pooler.dim, SAPTSettings(generated=generated)), {}
        for t in tasks:
            x = data[t]["train"]
            state = state.learn(t, x[10:], x[:10], replay)
            replay[t] = x[:2]
        acc[generated] = [
            float((state.attention(data[t]["test"]).argmax(-1) == i).float().mean()) for i, t in enumerate(tasks)
        ]
    assert min(acc[64]) >= 0.95, acc
    assert acc[64][0] > acc[0][0], acc  # the first task is what the draws protect


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


@pytest.mark.parametrize("field", ["generated", "feature_rank"])
def test_generative_replay_settings_are_validated(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SAPTSettings(**{field: -1})  # type: ignore[arg-type]
    SAPTSettings(**{field: 0})  # 0 turns generative replay off (SAPT as published)
