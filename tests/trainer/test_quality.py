"""The quality gate's verdict and its pieces (the routed re-check runs in tests/server/test_api_tasks.py)."""

from __future__ import annotations

from skillpool.trainer.config import TrainConfig
from skillpool.trainer.quality import trivial_answer, verdict

NEW = {
    "metric": "exact_match",
    "score": 0.8,
    "base_score": 0.1,
    "trivial_score": 0.5,
    "n": 20,
    "gain": 0.3,
    "gain_se": 0.1,
}


def earlier(before: float, after: float) -> dict:
    return {
        "old": {
            "metric": "exact_match",
            "before": before,
            "after": after,
            "drop": before - after,
            "n": 20,
            "rerouted": 3,
        }
    }


def test_a_good_skill_passes() -> None:
    report = verdict(NEW, earlier(0.9, 0.85), TrainConfig(), force=False)
    assert report["passed"] and not report["forced"] and report["reasons"] == []
    assert report["new"]["bar"] == 0.5 + TrainConfig().quality_min_gain


def test_a_skill_no_better_than_its_most_frequent_answer_fails() -> None:
    report = verdict({**NEW, "score": 0.52, "gain": 0.02}, {}, TrainConfig(), force=False)
    assert not report["passed"] and "below the bar 0.550" in report["reasons"][0]
    assert "most frequent answer 0.500" in report["reasons"][0]


def test_a_gain_within_noise_fails() -> None:
    # the shuffled-labels SST-2 upload of the e2e run: 0.60 against 0.47, one standard error apart
    noisy = {**NEW, "score": 0.6, "trivial_score": 0.467, "gain": 0.133, "gain_se": 0.12}
    report = verdict(noisy, {}, TrainConfig(), force=False)
    assert not report["passed"] and "within noise on 20 held-out examples" in report["reasons"][0]
    assert report["new"]["gain_lower_bound"] < 0
    assert verdict(noisy, {}, TrainConfig(quality_z=0.0), force=False)["passed"]  # z = 0: the point bar alone


def test_held_out_scores_measure_the_gain_per_example() -> None:
    from skillpool.trainer.quality import per_example

    assert per_example("exact_match", ["Good", "bad", "x"], ["Good", "Good", "x"]) == [1.0, 0.0, 1.0]


def test_an_earlier_skill_that_drops_too_far_fails_and_force_is_recorded() -> None:
    cfg = TrainConfig(quality_max_drop=0.1)
    report = verdict(NEW, earlier(0.9, 0.75), cfg, force=True)
    assert not report["passed"] and report["forced"]
    assert "'old' drops from 0.900 to 0.750" in report["reasons"][0]
    assert verdict(NEW, earlier(0.9, 0.8), cfg, force=False)["passed"]  # exactly the margin is allowed


def test_no_held_out_split_skips_the_new_skill_check() -> None:
    report = verdict(
        {"metric": "rouge_l", "score": None, "base_score": None, "trivial_score": None, "n": 0},
        {},
        TrainConfig(),
        False,
    )
    assert report["passed"]


def test_trivial_answer_is_the_most_frequent() -> None:
    assert trivial_answer(["Good", "Bad ", "Bad", "Good", "Bad"]) == "Bad"
    assert trivial_answer([]) == ""
