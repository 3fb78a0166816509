"""lm-evaluation-harness against `skillpool serve`, as its users run it: the `local-completions` model scores a
local multiple-choice task (a task YAML over a JSONL of SST-2 test rows, no hub) by the loglikelihood of each
choice (`/v1/completions` with echo, logprobs and max_tokens 1), tokenizing through the server's /tokenize. A skill
trained on SST-2 through /tasks scores higher than the base model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.datasets import rows, user_text
from tests.e2e.conftest import Sst2Server

pytestmark = pytest.mark.slow
BASE = "SmolLM2-135M-Instruct"
TEST_ROWS = 60
CHOICES = ["Good", "Bad"]  # SST-2's answers in the Long Sequence benchmark


def write_task(folder: Path, smollm: Any) -> str:
    """A task folder: test.jsonl (each row's prompt as the chat template renders it, and its label) and the YAML
    that makes it a multiple-choice task."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm.path))
    lines = []
    for row in rows("long_sequence", "sst-2", "test", TEST_ROWS):
        messages = [{"role": "user", "content": user_text(row)}]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        lines.append(json.dumps({"prompt": prompt, "label": CHOICES.index(row["output"])}))
    (folder / "test.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "sst2_local.yaml").write_text(
        "\n".join(
            [
                "task: sst2_local",
                "dataset_path: json",
                "dataset_kwargs:",
                "  data_files:",
                f"    test: {folder / 'test.jsonl'}",
                "test_split: test",
                "output_type: multiple_choice",
                'doc_to_text: "{{prompt}}"',
                f"doc_to_choice: {json.dumps(CHOICES)}",
                'doc_to_target: "{{label}}"',
                'target_delimiter: ""',
                "metric_list:",
                "  - metric: acc",
                "    aggregation: mean",
                "    higher_is_better: true",
                "",
            ]
        )
    )
    return "sst2_local"


def accuracy(url: str, model: str, folder: Path, task: str) -> float:
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "base_url": url + "/v1/completions",
            "model": model,
            "tokenizer_backend": "remote",  # what lm-eval picks by itself when /tokenizer_info and /tokenize answer
            "num_concurrent": 4,
            "max_retries": 1,
        },
        tasks=[task],
        task_manager=TaskManager(include_path=str(folder)),
    )
    assert results is not None
    acc: float = results["results"][task]["acc,none"]
    return acc


def test_a_trained_skill_scores_higher_than_the_base_model(sst2_server: Sst2Server, smollm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    server = sst2_server.server  # its sst-2 learned through /tasks from SST-2's rows as uploaded (conftest.py)
    task = write_task(tmp_path, smollm)
    from lm_eval.utils import check_remote_tokenizer_support

    assert check_remote_tokenizer_support(server.url + "/v1/completions")  # lm-eval's own probe of the server
    base, skill = accuracy(server.url, BASE, tmp_path, task), accuracy(server.url, "sst-2", tmp_path, task)
    print(f"lm-eval {task}: accuracy base {base:.3f}, sst-2 skill {skill:.3f} ({TEST_ROWS} rows)")
    assert skill > base and skill >= 0.7, (skill, base)
