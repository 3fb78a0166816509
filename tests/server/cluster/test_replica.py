"""An engine replica's skills follow the store, not only what it was told: with the real hf engine on the tiny
LLaMA and a real store, a skill resolves at the version the store serves, a hub command swaps a held version or
drops it (the engine then answers not-found), a version the store no longer serves is refused and dropped, and
the ingress-side helpers key a mix by its heaviest skill and version."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from skillpool.adapters_store.store import SkillStore
from skillpool.server.cluster.hub import Command
from skillpool.server.cluster.remote_engine import routing_key
from skillpool.server.cluster.replica import Refusal, ReplicaSkills, merge, parse_key
from skillpool.server.engines import (
    EngineBusy,
    EngineDead,
    EngineEvent,
    EngineRequest,
    Mix,
    RequestTooLarge,
    SamplingParams,
)
from skillpool.server.engines.protocol import TokenLogprob
from tests.synthetic import curve_skills


@pytest.fixture(scope="module")
def engine(tiny_base):  # type: ignore[no-untyped-def]
    from skillpool.server.engines.hf import HFEngine

    eng = HFEngine(tiny_base.path, device="cpu", prefix_cache_tokens=0)
    yield eng
    eng.close()


def generate(engine: Any, mix: dict[str, float]) -> list[EngineEvent]:
    async def go() -> list[EngineEvent]:
        request = EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0), Mix.of(mix))
        return [ev async for ev in engine.generate(request)]

    return asyncio.run(go())


def test_skills_follow_the_store_and_the_hubs_commands(engine: Any, tmp_path: Path) -> None:
    curve_skills(tmp_path, 2)  # skill-0000 and skill-0001, v1 each
    store = SkillStore(tmp_path)
    skills = ReplicaSkills(engine, store)
    assert skills.resolve({"skill-0000": 1, "skill-0001": 1}, {}, verify=False) == []
    assert skills.versions() == {"skill-0000": 1, "skill-0001": 1}
    assert generate(engine, {"skill-0000": 1.0})[-1].finish_reason == "length"

    curve_skills(tmp_path, 1)  # skill-0000 v2
    skills.apply(Command(1, "add", "skill-0000", 2))  # held: swapped at once, before any request asks for v2
    assert skills.versions() == {"skill-0000": 2, "skill-0001": 1}
    assert skills.resolve({"skill-0000": 1}, {}, verify=False) == ["skill-0000"]  # v1 is no longer served
    skills.apply(Command(2, "add", "skill-0002", 1))  # not held: nothing to swap, it loads on first use
    assert "skill-0002" not in (skills.versions() or {})

    skills.apply(Command(3, "remove", "skill-0001"))
    assert skills.versions() == {"skill-0000": 2}
    ev = generate(engine, {"skill-0001": 1.0})[-1]
    assert ev.finish_reason == "error" and ev.not_found  # the engine's not-found: the ingress answers 404


def test_a_retired_skill_is_refused_and_dropped_when_the_replica_checks_the_store(engine: Any, tmp_path: Path) -> None:
    curve_skills(tmp_path, 1)
    store = SkillStore(tmp_path)
    skills = ReplicaSkills(engine, store)
    assert skills.resolve({"skill-0000": 1}, {}, verify=False) == []
    store.retire("skill-0000")
    # a replica that has not heard from the hub lately checks the store instead of trusting what it holds
    assert skills.resolve({"skill-0000": 1}, {}, verify=True) == ["skill-0000"]
    assert skills.versions() == {}
    store.activate("skill-0000")
    assert skills.resolve({"skill-0000": 1}, {}, verify=False) == []  # served again: read from the store


def test_the_routing_key_is_the_heaviest_skill_and_its_version() -> None:
    versions = {"agnews": 3, "sst-2": 1}
    assert routing_key(Mix.of({"sst-2": 0.3, "agnews": 0.7}), versions) == "agnews#v3"
    assert routing_key(Mix.base(), versions) is None
    assert routing_key(Mix.of({"cand@candidate-1": 1.0}), versions) == "cand@candidate-1#inline"
    assert parse_key("agnews#v3") == ("agnews", 3)
    assert parse_key("cand@candidate-1#inline") is None and parse_key("#v3") is None


def test_events_merge_and_refusals_become_the_engines_exceptions() -> None:
    ev = merge(EngineEvent("Hel", 1), EngineEvent("lo", 2, "stop"))
    assert (ev.text, ev.tokens, ev.finish_reason) == ("Hello", 2, "stop")
    a, b = TokenLogprob(5, -0.5), TokenLogprob(6, -1.5)
    prompt = (TokenLogprob(1, -2.0),)
    ev = merge(
        EngineEvent("a", 1, index=2, logprobs=(a,), prompt_logprobs=prompt), EngineEvent("b", 2, index=2, logprobs=(b,))
    )
    assert (ev.logprobs, ev.prompt_logprobs, ev.index) == ((a, b), prompt, 2)
    busy = Refusal("busy", "full", waiting=7, retry_after_s=2).exception()
    assert isinstance(busy, EngineBusy) and (busy.waiting, busy.retry_after_s) == (7, 2)
    assert isinstance(Refusal("dead", "hf").exception(), EngineDead)
    assert isinstance(Refusal("too_large", "too long").exception(), RequestTooLarge)
