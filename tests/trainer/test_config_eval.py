"""Hyperparameter validation and the scoring functions."""
from __future__ import annotations

import pytest

from trainer.config import ConfigError, TrainConfig
from trainer.evaluation import first_word_match, is_classification, mean_score, metric_for, rouge_l


def test_defaults_and_overrides() -> None:
    cfg = TrainConfig.from_dict({"epochs": 1, "rank": 4, "target_modules": ["q_proj"]})
    assert cfg.epochs == 1.0 and cfg.rank == 4 and cfg.target_modules == ["q_proj"]
    assert TrainConfig.from_dict(None) == TrainConfig()


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
