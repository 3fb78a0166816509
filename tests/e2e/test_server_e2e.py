"""End to end: the real SmolLM2 + MiniLM behind `skillpool serve`, called with the unmodified openai client.

Uploads a slice of Long Sequence AG News to a server in sapt mode, waits for the skill, and checks that AG News
prompts now route to it (no restart) and are answered better than by the base model. The store then serves the
skill after a restart in every router mode (dtkr, sapt, centroid): every mode's keys are stored at training, so
one training covers the three modes' routing (sapt's projector is learned only under sapt, hence it trains).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skillpool.evaluation.process import ServerProcess
from skillpool.evaluation.tasks_client import TasksClient
from skillpool.router import MODES
from skillpool.trainer.records import TERMINAL
from skillpool.trainer.scoring import first_word_match
from tests.chat import ask
from tests.datasets import dataset_dir, rows, user_text

pytestmark = pytest.mark.slow
TRAIN_ROWS = 160
TEST_ROWS = 40
# the rows as uploaded: the default prompt variants would double the training time of a test about serving
CONFIG = {"epochs": 2, "prompt_variants": 0.0}
LEARNS_IN = "sapt"  # the mode with the most to learn at upload: the skill's keys and the query projector


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return tmp_path_factory.mktemp("e2e") / "data"


@pytest.fixture(scope="module")
def server(data_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(data_dir, ["--router-mode", LEARNS_IN]) as s:
        yield s


def openai_client(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def client(server: ServerProcess):  # type: ignore[no-untyped-def]
    return openai_client(server.url)


def agnews(split: str, n: int) -> list[dict]:
    dataset_dir("long_sequence", "agnews")  # skips with a message naming SKILLPOOL_DATASETS when it is unset
    return rows("long_sequence", "agnews", split, n)


def test_models_list_base_and_auto(client) -> None:  # type: ignore[no-untyped-def]
    ids = [m.id for m in client.models.list().data]
    assert ids[:2] == ["SmolLM2-135M-Instruct", "auto"]


def test_chat_with_the_real_base_model(client) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=20,
    )
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens > 0


def test_streaming_with_the_openai_client(client) -> None:  # type: ignore[no-untyped-def]
    stream = client.chat.completions.create(
        model="auto",
        messages=[{"role": "user", "content": "Name a primary colour."}],
        temperature=0,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] in (
        ["stop"],
        ["length"],
    )
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def routes_and_beats_the_base_model(client, label: str) -> None:  # type: ignore[no-untyped-def]
    test = agnews("test", TEST_ROWS)
    texts = [user_text(row) for row in test]
    routed = ask(client, "auto", texts)
    base = ask(client, "SmolLM2-135M-Instruct", texts)
    route_rate = sum(h.startswith("agnews=") for _, h in routed) / len(test)
    acc_auto = sum(first_word_match(a, row["output"]) for (a, _), row in zip(routed, test)) / len(test)
    acc_base = sum(first_word_match(a, row["output"]) for (a, _), row in zip(base, test)) / len(test)
    print(f"\nagnews e2e ({label}): route_rate={route_rate:.2f} acc_auto={acc_auto:.2f} acc_base={acc_base:.2f}")
    assert all(h == "base" for _, h in base)
    assert route_rate >= 0.9
    assert acc_auto >= acc_base + 0.2


def test_upload_learn_route_and_beat_the_base_model(server: ServerProcess, client) -> None:  # type: ignore[no-untyped-def]
    body = "\n".join(json.dumps(r) for r in agnews("train", TRAIN_ROWS)).encode()
    tasks = TasksClient(server.url)
    job = tasks.wait_for(tasks.upload("agnews", body, config=CONFIG)["id"], TERMINAL, 2400)
    assert job["status"] == "succeeded", job
    print(f"\nagnews job eval: {job['eval']}")
    assert "agnews" in [m.id for m in client.models.list().data]
    routes_and_beats_the_base_model(client, f"{LEARNS_IN}, hot-registered")


def phrased_differently_routes_to_the_skill(client) -> None:  # type: ignore[no-untyped-def]
    """The skill was uploaded with Long Sequence's own instruction; users word it their own way, in the user
    turn or in a system message, in a multi-turn chat."""
    import concurrent.futures as cf

    ask_user = (
        "Classify this news article into one of these categories: World, Sports, Business, Science or Technology."
    )
    ask_system = "You sort news for a newspaper. Reply with one label: Sports, World, Science or Technology, Business."
    test = agnews("test", 20)

    def header(messages: list[dict[str, str]]) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model="auto", messages=messages, temperature=0, max_tokens=4
        )
        return str(raw.headers.get("x-skillpool-route", ""))

    chats = [[{"role": "user", "content": f"{ask_user}\n{row['input']}"}] for row in test]
    chats += [
        [
            {"role": "system", "content": ask_system},
            {"role": "user", "content": "Hi! I have some articles for you."},
            {"role": "assistant", "content": "Sure, send them over."},
            {"role": "user", "content": row["input"]},
        ]
        for row in test
    ]
    with cf.ThreadPoolExecutor(8) as pool:
        routes = list(pool.map(header, chats))
    user_rate = sum(h.startswith("agnews=") for h in routes[:20]) / 20
    system_rate = sum(h.startswith("agnews=") for h in routes[20:]) / 20
    print(f"\nagnews paraphrased: user-turn route_rate={user_rate:.2f} system-message route_rate={system_rate:.2f}")
    assert user_rate >= 0.8 and system_rate >= 0.8, routes
    other = [{"role": "user", "content": "Is this movie review Good or Bad?\nA waste of two hours."}]
    assert header(other) == "base"  # another task in other words still falls back


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_serves_the_learned_skill_after_a_restart(server: ServerProcess, data_dir: Path, mode: str) -> None:
    """Runs after the upload test (same module store): the learning server stops, one in `mode` starts on its store."""
    server.stop()
    with ServerProcess(data_dir, ["--router-mode", mode]) as again:
        client = openai_client(again.url)
        assert "agnews" in [m.id for m in client.models.list().data]
        routes_and_beats_the_base_model(client, f"{mode}, after a restart")
        phrased_differently_routes_to_the_skill(client)
