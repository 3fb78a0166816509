"""logits.py: each sampling option against a plain reference over the vocabulary, one row at a time; rows of a
batch keep their own options and generators; logprobs are the raw model's."""

from __future__ import annotations

import math

import pytest
import torch

from skillpool.server.engines.logits import adjust, draw, finite_rows, logprobs_of, pick, token_counts
from skillpool.server.engines.protocol import SamplingParams

VOCAB = 40


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def sp(**kw) -> SamplingParams:  # type: ignore[no-untyped-def]
    return SamplingParams(max_tokens=kw.pop("max_tokens", 8), **kw)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_token_counts_count_each_rows_tokens() -> None:
    counts = token_counts([[1, 1, 5], [], [39, 0, 39, 39]], VOCAB, torch.device("cpu"))
    assert counts.shape == (3, VOCAB)
    assert counts[0, 1] == 2 and counts[0, 5] == 1 and counts[0].sum() == 3
    assert counts[1].sum() == 0
    assert counts[2, 39] == 3 and counts[2, 0] == 1


def test_penalties_and_bias_match_their_definitions_row_by_row() -> None:
    x = logits(4)
    answers = [[3, 3, 7], [1, 2], [], [5, 5, 5, 9]]
    prompts = [[11, 12], [3], [4, 4], [9]]
    params = [
        sp(presence_penalty=0.5, frequency_penalty=1.5),
        sp(logit_bias=((2, -100.0), (30, 7.5))),
        sp(),
        sp(repetition_penalty=1.3, frequency_penalty=-0.4),
    ]
    got = adjust(x, params, answers, prompts)
    for r, p in enumerate(params):  # the reference: one row, one token at a time
        for t in range(VOCAB):
            v = float(x[r, t]) + dict(p.logit_bias).get(t, 0.0)
            if t in prompts[r] or t in answers[r]:
                if p.repetition_penalty != 1.0:
                    v = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
            c = answers[r].count(t)
            v -= c * p.frequency_penalty + (c > 0) * p.presence_penalty
            assert math.isclose(float(got[r, t]), v, rel_tol=1e-6, abs_tol=1e-5), (r, t)
    assert torch.equal(got[2], x[2])


def test_nothing_asked_means_no_copy() -> None:
    x = logits(3)
    assert adjust(x, [sp(), sp(temperature=0.5), sp(top_k=3)], [[1], [2], [3]], [[], [], []]) is x


def test_min_tokens_holds_off_the_end_of_sequence() -> None:
    x = logits(2)
    x[:, 9] = 50.0  # the end of sequence would win
    params = [sp(min_tokens=3), sp(min_tokens=3)]
    got = adjust(x, params, [[1, 2], [1, 2, 3]], [[], []], eos_ids=[9])
    assert got[0, 9] == -math.inf and got[1, 9] == 50.0
    picks = pick(x, got, [sp(temperature=0.0), sp(temperature=0.0)], [None, None], finite_rows(x))
    assert picks[0] is not None and picks[0].token != 9
    assert picks[1] is not None and picks[1].token == 9


def test_a_bias_of_minus_100_moves_greedy_off_its_token_and_plus_100_onto_another() -> None:
    x = logits(1)
    best = int(x.argmax())
    for bias, expect in (((best, -100.0),), None), (((5, 100.0),), 5):
        p = [sp(temperature=0.0, logit_bias=bias)]
        [got] = pick(x, adjust(x, p, [[]], [[]]), p, [None], [True])
        assert got is not None
        assert got.token != best if expect is None else got.token == expect


def test_top_k_one_min_p_one_and_a_tiny_top_p_are_greedy() -> None:
    x = logits(3, seed=4)
    params = [sp(top_k=1), sp(min_p=1.0), sp(top_p=1e-9)]
    got = draw(x, params, [gen(i) for i in range(3)])
    assert got == x.argmax(dim=-1).tolist()


def test_sampling_keeps_to_top_k_and_top_p() -> None:
    x = logits(1, seed=5)
    order = x[0].argsort(descending=True).tolist()
    probs = torch.softmax(x[0], dim=-1)[order]
    nucleus = int((probs.cumsum(0) - probs < 0.6).sum())
    for p, allowed in ((sp(top_k=3), order[:3]), (sp(top_p=0.6), order[:nucleus]), (sp(min_p=0.2), None)):
        seen = {t for i in range(300) for t in draw(x, [p], [gen(i)])}
        if allowed is None:  # min_p: tokens at least 0.2 times as likely as the likeliest
            allowed = [t for t in range(VOCAB) if torch.softmax(x[0], -1)[t] >= 0.2 * torch.softmax(x[0], -1).max()]
        assert seen <= set(allowed) and len(seen) == len(allowed)


def test_draws_follow_the_distribution() -> None:
    x = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5]])
    probs = torch.softmax(x[0] / 0.8, dim=-1)
    n = 4000
    counts = torch.zeros(5)
    for i in range(n):
        [t] = draw(x, [sp(temperature=0.8)], [gen(i)])
        assert t is not None
        counts[t] += 1
    assert torch.allclose(counts / n, probs, atol=0.025), (counts / n, probs)


def test_a_seeded_row_draws_the_same_alone_or_beside_others() -> None:
    x = logits(4, seed=6)
    params = [sp(temperature=1.0), sp(temperature=0.7, top_k=5), sp(temperature=1.3, top_p=0.9), sp(min_p=0.05)]
    together = draw(x, params, [gen(10 + i) for i in range(4)])
    alone = [draw(x[i : i + 1], [params[i]], [gen(10 + i)])[0] for i in range(4)]
    assert together == alone


def test_logprobs_are_the_raw_models_with_the_likeliest_first() -> None:
    x = logits(2, seed=7)
    params = [sp(temperature=0.0, logprobs=5, logit_bias=((0, 100.0),)), sp(temperature=0.0, logprobs=0)]
    got = pick(x, adjust(x, params, [[], []], [[], []]), params, [None, None], [True, True])
    raw = torch.log_softmax(x, dim=-1)
    assert got[0] is not None and got[0].token == 0  # the bias chose it...
    lp = got[0].logprob
    assert lp is not None and math.isclose(lp.logprob, float(raw[0, 0]), abs_tol=1e-6)  # ...its logprob is raw
    assert [t for t, _ in lp.top] == raw[0].topk(5).indices.tolist()
    assert all(v <= 0 for _, v in lp.top) and [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    assert got[1] is not None and got[1].logprob is not None and got[1].logprob.top == ()
    assert got[1].token == int(x[1].argmax()) and got[1].logprob.logprob == pytest.approx(float(raw[1].max()))


def test_logprobs_of_prompt_positions() -> None:
    x = logits(5, seed=8)
    targets = [3, 1, 4, 1, 5]
    got = logprobs_of(x, targets, [2] * 5)
    raw = torch.log_softmax(x, dim=-1)
    for r, t in enumerate(targets):
        assert got[r].token == t and got[r].logprob == pytest.approx(float(raw[r, t]), abs=1e-6)
        assert len(got[r].top) == 2 and got[r].top[0][0] == int(raw[r].argmax())


def test_a_row_with_no_finite_logits_gets_no_token() -> None:
    x = logits(3, seed=9)
    x[1, 4] = math.nan
    params = [sp(temperature=1.0), sp(temperature=1.0), sp(temperature=0.0)]
    got = pick(x, x, params, [gen(0), gen(1), None], finite_rows(x))
    assert got[0] is not None and got[1] is None and got[2] is not None
