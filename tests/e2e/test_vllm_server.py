"""`skillpool serve --engine vllm` as a user runs it, called with the openai client: 8 concurrent streaming
clients (base, a forced skill, a forced mix) get no error, and greedy answers equal the hf engine's."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
from pathlib import Path

import pytest

from skillpool.lora.mix import Mix
from skillpool.server.engines import EngineRequest, SamplingParams
from tests.datasets import dataset_dir

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BASE = "SmolLM2-135M-Instruct"
PROMPT = "Name three animals that live in the sea."
# the skills' router keys come from these SuperNI tasks' texts (the serving benchmark's)
SUPERNI_TASKS = (
    "task1729_personachat_generate_next",
    "task639_multi_woz_user_utterance_generation",
    "task1590_diplomacy_text_generation",
    "task748_glucose_reverse_cause_event_detection",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):  # type: ignore[no-untyped-def]
    pytest.importorskip("vllm", reason="vLLM is not installed: bash setup.sh --engine vllm")
    from skillpool.evaluation.process import ServerProcess
    from tests.datasets import rows, user_text
    from tests.synthetic import task_skills

    dataset_dir("superni", "task1729_personachat_generate_next")  # the skills' router keys come from SuperNI
    data = Path(tmp_path_factory.mktemp("vllm-e2e")) / "data"
    texts = [[user_text(r) for r in rows("superni", t, "train", 200)] for t in SUPERNI_TASKS]
    names = task_skills(data, 3, rank=8, texts=texts)
    flags = ["--engine", "vllm", "--max-model-len", "1024", "--max-loras", "2", "--max-batch-size", "8"]
    with ServerProcess(data, flags, startup_s=900) as srv:
        yield srv, data, names


def chat(url: str, model: str, stream: bool, max_tokens: int = 24) -> tuple[str, str | None, int]:
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    msgs = [{"role": "user", "content": PROMPT}]
    if not stream:
        r = client.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, temperature=0)  # type: ignore[arg-type]
        assert r.usage is not None
        return r.choices[0].message.content or "", r.choices[0].finish_reason, r.usage.completion_tokens
    text, reason, used = "", None, 0
    for chunk in client.chat.completions.create(
        model=model,
        messages=msgs,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage is not None:
            used = chunk.usage.completion_tokens
    return text, reason, used


def test_eight_concurrent_streaming_clients_get_no_error(server) -> None:  # type: ignore[no-untyped-def]
    srv, _, names = server
    models = [BASE, names[0], f"{names[1]}=0.5,{names[2]}=0.5", names[2]] * 2
    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda m: chat(srv.url, m, stream=True), models))
    for text, reason, used in results:
        assert text and reason in ("stop", "length") and used > 0
    assert results[0] == results[4]  # the same greedy request, answered alike under load


def test_greedy_answers_equal_the_hf_engine(server, smollm) -> None:  # type: ignore[no-untyped-def]
    from skillpool.adapters_store.store import SkillStore
    from skillpool.server.engines.hf import HFEngine

    srv, data, names = server
    hf = HFEngine(smollm.path, device="cpu")
    rec = SkillStore(data).get(names[0])
    assert rec is not None
    hf.add_skill(names[0], rec.adapter)
    try:
        ids = hf.encode_chat([{"role": "user", "content": PROMPT}])

        async def hf_answer(mix: tuple[tuple[str, float], ...]) -> str:
            req = EngineRequest(f"hf-{len(mix)}", ids, SamplingParams(max_tokens=24, temperature=0.0), Mix.of(mix))
            return "".join([ev.text async for ev in hf.generate(req)])

        for model, mix in ((BASE, ()), (names[0], ((names[0], 1.0),))):
            assert chat(srv.url, model, stream=False)[0] == asyncio.run(hf_answer(mix))
    finally:
        hf.close()


def test_a_skill_learned_through_tasks_is_routed_to(server) -> None:  # type: ignore[no-untyped-def]
    """Hot registration end to end: the trainer stores a skill (judged by this vllm engine) and `auto` routes
    the next requests to it, no restart."""
    import json

    from openai import OpenAI

    from skillpool.evaluation.tasks_client import TasksClient
    from skillpool.trainer.records import TERMINAL
    from skillpool.trainer.scoring import first_word_match
    from tests.chat import ask
    from tests.datasets import rows, user_text

    srv, _, _ = server
    dataset_dir("long_sequence", "agnews")
    body = "\n".join(json.dumps(r) for r in rows("long_sequence", "agnews", "train", 160)).encode()
    # the rows as uploaded: the default prompt variants would double the training time of a test about routing
    tasks = TasksClient(srv.url)
    job = tasks.wait_for(
        tasks.upload("agnews", body, config={"epochs": 2, "prompt_variants": 0.0})["id"], TERMINAL, 1500
    )
    assert job["status"] == "succeeded", job
    client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    test = rows("long_sequence", "agnews", "test", 24)
    texts = [user_text(row) for row in test]
    routed, base = ask(client, "auto", texts), ask(client, BASE, texts)
    route_rate = sum(h.startswith("agnews") for _, h in routed) / len(test)
    acc, acc_base = (
        sum(first_word_match(a, row["output"]) for (a, _), row in zip(x, test)) / len(test) for x in (routed, base)
    )
    assert route_rate >= 0.9 and acc >= acc_base + 0.2, (route_rate, acc, acc_base, job["eval"])
