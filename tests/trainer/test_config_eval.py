"""Hyperparameter validation and the scoring functions."""

from __future__ import annotations

import pytest

from skillpool.trainer.config import ConfigError, TrainConfig
from skillpool.trainer.scoring import first_word_match, is_classification, mean_score, metric_for, rouge_l


def test_defaults_and_overrides() -> None:
    cfg = TrainConfig.from_dict({"epochs": 1, "rank": 4, "target_modules": ["q_proj"]})
    assert cfg.epochs == 1.0 and cfg.rank == 4 and cfg.target_modules == ["q_proj"]
    assert TrainConfig.from_dict(None) == TrainConfig()


def test_gradient_checkpointing_takes_a_choice_or_a_bool_and_reaches_the_schedule() -> None:
    from skillpool.trainer.lora_train import schedule_of

    seen = {}
    for raw in ("auto", "on", "off", True, False):
        cfg = TrainConfig.from_dict({"gradient_checkpointing": raw})
        seen[raw] = (cfg.gradient_checkpointing, schedule_of(cfg).checkpointing)
    assert seen == {
        "auto": ("auto", None),  # the loop decides by device
        "on": ("on", True),
        "off": ("off", False),
        True: ("on", True),  # as transformers' TrainingArguments spells it
        False: ("off", False),
    }
    assert TrainConfig().gradient_checkpointing == "auto"


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        ({"epochs": 0}, "config.epochs"),
        ({"rank": "8"}, "config.rank"),
        ({"rank": 2.5}, "config.rank"),
        ({"learning_rate": True}, "config.learning_rate"),
        ({"dropout": 1.5}, "config.dropout"),
        ({"target_modules": []}, "config.target_modules"),
        ({"bogus": 1}, "config.bogus"),
        ({"learning_rate": float("nan")}, "config.learning_rate"),
        ({"alpha": float("inf")}, "config.alpha"),
        ({"quality_min_gain": float("-inf")}, "config.quality_min_gain"),
        ({"learning_rate": 5.0}, "config.learning_rate"),
        ({"seed": 2**64}, "config.seed"),
        ({"seed": -1}, "config.seed"),
        ({"kif_start_probe": -1}, "config.kif_start_probe"),
        ({"kif_start_margin": 1.0}, "config.kif_start_margin"),
        ({"kif_start_trial": -1}, "config.kif_start_trial"),
        ({"kif_start_trial": 1001}, "config.kif_start_trial"),
        ({"kif_start_trial": 0.5}, "config.kif_start_trial"),
        ({"kif_start": "nearest"}, "config.kif_start"),
        ({"kif_start": 1}, "config.kif_start"),
        ({"gradient_checkpointing": "sometimes"}, "config.gradient_checkpointing"),
        ({"gradient_checkpointing": 1}, "config.gradient_checkpointing"),
        ({"gradient_checkpointing": None}, "config.gradient_checkpointing"),
    ],
)
def test_bad_hyperparameters_name_the_field(raw: dict, param: str) -> None:
    with pytest.raises(ConfigError) as exc:
        TrainConfig.from_dict(raw)
    assert exc.value.param == param


def test_first_word_exact_match() -> None:
    assert first_word_match("Science or Technology", "Science or Technology") == 1.0
    assert first_word_match("science.", "Science or Technology") == 1.0
    assert first_word_match("Sports", "World") == 0.0
    assert first_word_match("", "World") == 0.0


def test_rouge_l() -> None:
    assert rouge_l("the cat sat on the mat", "the cat sat on the mat") == 1.0
    assert rouge_l("a b c", "x y z") == 0.0
    # LCS "the cat the mat" = 4 of 6 in both: F1 = 2/3
    assert rouge_l("the cat ran to the mat", "the cat sat on the mat") == pytest.approx(4 / 6)


def test_metric_choice() -> None:
    assert is_classification(["positive", "negative", "positive"])
    assert metric_for(["World", "Science or Technology"]) == "exact_match"
    assert metric_for(["a long free-form answer about many things", "another one entirely"]) == "rouge_l"
    assert mean_score("exact_match", ["World", "Sports"], ["World", "World"]) == 0.5


def test_answer_loss_equals_the_models_own_loss(tiny_base) -> None:  # type: ignore[no-untyped-def]
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from skillpool.trainer.loop import answer_loss, collate
    from skillpool.trainer.lora_train import encode_example

    tok = AutoTokenizer.from_pretrained(str(tiny_base.path))
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(tiny_base.path)), LoraConfig(r=4, target_modules=["q_proj"])
    ).eval()
    exs = [
        {"messages": [{"role": "user", "content": c}], "answer": a}
        for c, a in [("Is it good?", "Yes, very"), ("Topic of: stocks fell", "Business")]
    ]
    batch = collate([encode_example(tok, e, 128) for e in exs], tok.pad_token_id)
    labels = batch["labels"]
    assert (labels != -100).sum() == sum(len(tok(e["answer"], add_special_tokens=False)["input_ids"]) + 1 for e in exs)
    with torch.no_grad():
        assert torch.allclose(answer_loss(model, batch), model(**batch).loss, atol=1e-5)
