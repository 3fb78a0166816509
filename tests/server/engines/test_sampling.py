"""How a row's next token is chosen: the greedy pick is the first largest logit, and a row whose logits hold a
NaN or an infinity anywhere fails alone while its batch-mates get their tokens."""

from __future__ import annotations

import math

import torch

from skillpool.server.engines.protocol import EngineRequest, SamplingParams
from skillpool.server.engines.rows import Row, sample

VOCAB = 50


def rows(n: int, temperature: float = 0.0) -> list[Row]:
    params = SamplingParams(max_tokens=4, temperature=temperature)
    out = []
    for i in range(n):
        gen = torch.Generator().manual_seed(i) if temperature else None
        out.append(Row(EngineRequest(f"r{i}", [1, 2], params), lambda ev: None, None, gen))  # type: ignore[arg-type]
    return out


def test_greedy_takes_the_first_largest_logit_of_each_row() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    logits[2, 7] = logits[2, 31] = float(logits[2].max()) + 1.0  # a tie: the first one wins, as argmax's
    got = [p.token if p else None for p in sample(logits, rows(4))]
    assert got == logits.argmax(dim=-1).tolist()
    assert got[2] == 7


def test_a_row_with_a_nan_or_an_infinity_anywhere_fails_alone() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1))
    logits[1, 3] = math.nan
    logits[2, VOCAB - 1] = math.inf
    logits[3, 0] = -math.inf  # even a token nobody would pick
    for batch in (rows(5), rows(5, temperature=0.7)):
        got = [p.token if p else None for p in sample(logits, batch)]
        assert got[1] is None and got[2] is None and got[3] is None
        assert all(isinstance(t, int) and 0 <= t < VOCAB for t in (got[0], got[4]))
    fifth = sample(logits, rows(5))[4]
    assert fifth is not None and fifth.token == int(logits[4].argmax())
