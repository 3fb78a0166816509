"""The engine contract's values: a request of n choices ends when each has, or at its first error (and then the
choices still running are to be aborted); sampling parameters refuse what the API would never send."""

from __future__ import annotations

import pytest

from skillpool.server.engines.protocol import Choices, EngineEvent, SamplingParams


def test_a_request_ends_when_every_choice_has() -> None:
    c = Choices(3)
    assert not c.over(EngineEvent("a", 1, index=1))
    assert not c.over(EngineEvent("", 2, "stop", index=1))
    assert not c.over(EngineEvent("", 2, "stop", index=1))  # a choice counts once
    assert not c.over(EngineEvent("", 4, "length", index=0))
    assert c.over(EngineEvent("", 1, "abort", index=2)) and not c.cut


def test_an_error_ends_the_request_and_says_whether_others_still_ran() -> None:
    early = Choices(2)
    assert early.over(EngineEvent(finish_reason="error", error="retired")) and early.cut
    last = Choices(2)
    last.over(EngineEvent("", 3, "stop", index=0))
    assert last.over(EngineEvent(finish_reason="error", index=1)) and not last.cut


@pytest.mark.parametrize(
    "kw",
    [
        {"n": 0},
        {"n": 17},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3.0},
        {"repetition_penalty": 0.0},
        {"logit_bias": ((5, 101.0),)},
        {"logit_bias": ((-1, 1.0),)},
        {"top_k": -1},
        {"min_p": 1.5},
        {"min_tokens": 9},
        {"logprobs": 21},
        {"prompt_logprobs": -1},
    ],
)
def test_sampling_params_refuse_what_the_api_never_sends(kw: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=8, **kw)


def test_choice_seeds_follow_vllm() -> None:
    assert [SamplingParams(max_tokens=1, seed=7).choice_seed(i) for i in range(3)] == [7, 8, 9]
    assert SamplingParams(max_tokens=1).choice_seed(2) is None
