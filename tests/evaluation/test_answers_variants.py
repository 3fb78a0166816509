"""The four wordings `eval answers` asks a test row under, and the SuperNI paraphrase set they read."""

from __future__ import annotations

import json
import re

import pytest

from skillpool.evaluation.answers_variants import AnswerTask, messages_for
from skillpool.evaluation.continual_task import Task
from skillpool.evaluation.tasks import load_paraphrases, task_lines
from skillpool.trainer.datasets import parse_jsonl
from tests.datasets import dataset_dir

ROW = {"instruction": "Classify the review as POS or NEG.", "input": "A fine film.", "output": "POS"}


def test_uploaded_is_the_user_turn_the_skill_was_trained_on() -> None:
    trained = parse_jsonl(json.dumps(ROW).encode())[0]["messages"]
    assert (
        messages_for(ROW, "uploaded")
        == trained
        == [{"role": "user", "content": "Classify the review as POS or NEG.\nA fine film."}]
    )


def test_paraphrase_replaces_the_instruction_and_places_the_input() -> None:
    after = messages_for(ROW, "paraphrase", "Is this review positive or negative?")
    assert after == [{"role": "user", "content": "Is this review positive or negative?\nA fine film."}]
    inside = messages_for(ROW, "paraphrase", "{input}\nGood or bad?")
    assert inside == [{"role": "user", "content": "A fine film.\nGood or bad?"}]
    with pytest.raises(ValueError, match="needs a paraphrase"):
        messages_for(ROW, "paraphrase")


def test_system_and_input_only() -> None:
    assert messages_for(ROW, "system") == [
        {"role": "system", "content": "Classify the review as POS or NEG."},
        {"role": "user", "content": "A fine film."},
    ]
    assert messages_for(ROW, "input-only") == [{"role": "user", "content": "A fine film."}]
    no_input = {"instruction": "Name a prime number.", "output": "7"}
    assert messages_for(no_input, "input-only") == [{"role": "user", "content": "Name a prime number."}]
    with pytest.raises(ValueError, match="variant must be one of"):
        messages_for(ROW, "shouted")


def test_a_variant_keeps_answers_budget_and_metric_and_cycles_the_paraphrases() -> None:
    rows = [{**ROW, "input": f"review {i}"} for i in range(5)]
    body = "\n".join(json.dumps(r) for r in rows).encode()
    task = Task("t", body, [], parse_jsonl(body), "exact_match", budget=5)
    at = AnswerTask(task, rows, ["P0", "{input} P1"])
    asked = at.variant("paraphrase")
    assert [e["messages"][0]["content"] for e in asked.test] == [
        "P0\nreview 0",
        "review 1 P1",
        "P0\nreview 2",
        "review 3 P1",
        "P0\nreview 4",
    ]
    assert [e["answer"] for e in asked.test] == ["POS"] * 5 and asked.budget == 5 and asked.metric == "exact_match"
    assert task.test[0]["messages"][0]["content"] == "Classify the review as POS or NEG.\nreview 0"  # not changed
    assert asked.row_scores(["pos", "NEG", "", "POS!", "positive"]) == [100.0, 0.0, 0.0, 100.0, 0.0]
    with pytest.raises(ValueError, match="no paraphrases"):
        AnswerTask(task, rows, []).variant("paraphrase")


@pytest.mark.parametrize(
    ("task", "labels"),
    [
        ("task363_sst2_polarity_classification", {"pos", "neg", "positive", "negative"}),
        ("task1687_sentiment140_classification", {"pos", "neg", "positive", "negative"}),
    ],
)
def test_superni_paraphrases_name_the_labels_and_quote_no_test_row(task: str, labels: set[str]) -> None:
    para = load_paraphrases("superni")[task]
    assert len(para) >= 5
    for p in para:  # every paraphrase says which answers are possible, in some spelling
        assert labels & set(re.findall(r"\w+", p.lower())), p
    folder = dataset_dir("superni", task)
    inputs = [json.loads(line)["input"] for line in task_lines(folder, "test")]
    assert not any(i.strip() and i.strip() in p for p in para for i in inputs)
    own = json.loads(task_lines(folder, "train")[0])["instruction"]
    assert own not in para  # a paraphrase, not the uploaded instruction
