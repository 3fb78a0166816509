"""The quality gate through the serving engine answers as the trainer's own model would, and leaves no
candidate behind in the engine."""

from __future__ import annotations

import time

from transformers import AutoModelForCausalLM, AutoTokenizer

from skillpool.lora.mix import Mix
from skillpool.server.engines.hf import HFEngine
from skillpool.server.judge import EngineJudge
from skillpool.trainer.judge import LocalJudge
from tests.server.test_engine import adapter

PROMPTS = [[{"role": "user", "content": p}] for p in ("Hello there", "What is this news article about?", "x")]


def test_engine_judge_answers_like_the_local_judge_and_removes_its_candidate(tiny_base) -> None:  # type: ignore[no-untyped-def]
    engine = HFEngine(tiny_base.path, device="cpu")
    one, new = adapter(tiny_base, 4, 8, 1), adapter(tiny_base, 8, 8, 2)
    engine.add_skill("one", lambda: one)
    local = LocalJudge(
        AutoModelForCausalLM.from_pretrained(str(tiny_base.path)), AutoTokenizer.from_pretrained(str(tiny_base.path))
    )
    try:
        judges = [EngineJudge(engine), local]
        keys = [(j.registered("one", lambda: one), j.candidate("new", lambda: new)) for j in judges]
        assert keys[0][1] != "new" and "@" in keys[0][1]  # a key no request can name
        answers = []
        for j, (k_one, k_new) in zip(judges, keys):
            mixes = [Mix.of({k_new: 1.0}), Mix.base(), Mix.of([(k_one, 0.5), (k_new, 0.5)])]
            answers.append(j.generate(PROMPTS, mixes, 10))
        assert answers[0] == answers[1]
        assert len(set(answers[0])) == 3  # the mixes really differ
        judges[0].remove(keys[0][1])
        deadline = time.time() + 5
        while engine.stats()["known_skills"] != 1 and time.time() < deadline:
            time.sleep(0.01)
        assert engine.stats()["known_skills"] == 1
    finally:
        engine.close()
