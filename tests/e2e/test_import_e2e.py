"""End to end: a LoRA trained with plain PEFT on the real SmolLM2 is imported into `skillpool serve` with
`skillpool import` and AG News requests as its examples; called with the unmodified openai client, it answers as
PEFT's own `generate` does with that adapter, and `auto` routes the tasks' paraphrased instructions to it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from skillpool.cli.main import main
from skillpool.evaluation.answers_variants import messages_for
from skillpool.evaluation.process import ServerProcess
from skillpool.evaluation.tasks import load_paraphrases
from tests.datasets import dataset_dir, rows
from tests.peft_adapters import peft_answers, train_peft

pytestmark = pytest.mark.slow
SKILL = "news"
EXAMPLES = 60
TEST_ROWS = 24
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:  # type: ignore[no-untyped-def]
    dataset_dir("long_sequence", "agnews")  # skips with a message naming SKILLPOOL_DATASETS when it is unset
    with ServerProcess(Path(tmp_path_factory.mktemp("import-e2e")) / "data") as s:
        yield s


@pytest.fixture(scope="module")
def adapter(smollm, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """A LoRA of SmolLM2 trained a few steps with plain PEFT on AG News rows, as PEFT saves it."""
    pairs = [(f"{r['instruction']}\n{r['input']}", r["output"]) for r in rows("long_sequence", "agnews", "train", 8)]
    return train_peft(smollm.path, Path(tmp_path_factory.mktemp("peft")) / "news", steps=8, lr=1e-3, pairs=pairs)


def openai_client(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


def test_skillpool_import_then_answers_as_peft_and_routes_paraphrases(  # type: ignore[no-untyped-def]
    server: ServerProcess, adapter: Path, smollm, tmp_path: Path, capsys
) -> None:
    examples = tmp_path / "examples.jsonl"  # the requests it answers, without their answers: keys only, no gate
    train = rows("long_sequence", "agnews", "train", EXAMPLES)
    examples.write_text("\n".join(json.dumps({"instruction": r["instruction"], "input": r["input"]}) for r in train))
    assert main(["import", str(adapter), "--name", SKILL, "--examples", str(examples), "--url", server.url]) == 0, (
        capsys.readouterr().err
    )
    client = openai_client(server.url)
    assert {m.id: m.model_extra.get("method") for m in client.models.list().data}[SKILL] == "imported"
    test = rows("long_sequence", "agnews", "test", TEST_ROWS)
    prompts = [f"{r['instruction']}\n{r['input']}" for r in test[:3]]
    got = [
        client.chat.completions.create(
            model=SKILL, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=MAX_TOKENS
        )
        .choices[0]
        .message.content
        for p in prompts
    ]
    assert got == peft_answers(smollm.path, adapter, prompts, MAX_TOKENS)
    paraphrases = load_paraphrases("long_sequence")["agnews"]
    routes = []
    for i, row in enumerate(test):
        raw = client.chat.completions.with_raw_response.create(
            model="auto",
            messages=messages_for(row, "paraphrase", paraphrases[i % len(paraphrases)]),  # type: ignore[arg-type]
            temperature=0,
            max_tokens=1,
        )
        routes.append(str(raw.headers.get("x-skillpool-route", "")))
    rate = sum(r.startswith(f"{SKILL}=") for r in routes) / len(routes)
    print(f"\nimported skill: {rate:.2f} of {len(routes)} paraphrased AG News requests routed to it")
    assert rate >= 0.9, routes
    other = client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "Write a short poem about the sea."}], max_tokens=1
    )
    assert other.headers.get("x-skillpool-route") == "base"
