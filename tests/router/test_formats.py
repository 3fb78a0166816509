"""The format gate: per-skill Bernoulli model of fixed prompt text, and its use in routing."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from skillpool.router import Router, RouterSettings
from skillpool.router.formats import FormatModel, FormatSettings, accepts_each, fit_format, gram_ids
from tests.datasets import read_task

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "paper",
    "glass",
    "music",
    "window",
    "forest",
    "engine",
    "candle",
    "silver",
    "orange",
    "mountain",
]


def _texts(template: str, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [template.format(" ".join(rng.choices(WORDS, k=rng.randint(3, 12)))) for _ in range(n)]


def test_gram_ids_are_lowercased_unigrams_and_bigrams_with_punctuation() -> None:
    ids = gram_ids("Title: Hi")
    assert len(ids) == 5  # title, :, hi, "title :", ": hi"
    assert np.array_equal(ids, gram_ids("title : hi")) and np.array_equal(ids, np.unique(ids))
    assert not np.array_equal(ids, gram_ids("Text: Hi"))
    assert gram_ids("").shape == (0,) and gram_ids("").dtype == np.int64


def test_score_is_minus_the_log_odds_of_the_missing_grams() -> None:
    texts = _texts("Title: {}\nAnswer:", 99, 0)
    m = fit_format(texts, FormatSettings())
    title = gram_ids("title")[0]
    # in all 99 inputs: p = 99.5 / 100, so missing it costs log(p / (1 - p))
    assert title in m.grams
    want = -np.log(0.995 / 0.005)
    [without_title] = m.scores([np.setdiff1d(gram_ids(texts[0]), [title])])
    assert without_title == pytest.approx(want, rel=1e-5)
    assert m.scores([gram_ids(texts[0] + " extra words")])[0] == 0.0  # extra text costs nothing


def test_gate_accepts_its_own_format_and_rejects_a_sibling_without_its_field_names() -> None:
    template = "Rate the review. Option: good, bad.\nTitle: {}\nText: as the title says."
    m = fit_format(_texts(template, 300, 1), FormatSettings())
    own = _texts(template, 200, 2)
    sibling = _texts("Rate the review. Option: good, bad.\nText: {}\n\nAnswer:", 200, 3)  # no "Title:"
    assert m.accepts([gram_ids(t) for t in own]).mean() >= 0.98
    assert m.accepts([gram_ids(t) for t in sibling]).mean() == 0.0


def test_accepts_each_equals_each_model_alone() -> None:
    """The router checks a request against all its candidate skills in one vectorized pass."""
    templates = [
        "Title: {}\nText: as said.",
        "Text: {}\nAnswer:",
        "Option: good, bad.\n{}",
        "sentence 1: {}\nsentence 2: the same.",
    ]
    models: list[FormatModel | None] = [
        fit_format(_texts(t, 120, i), FormatSettings()) for i, t in enumerate(templates)
    ]
    models += [
        None,
        FormatModel(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32), -2.0),
    ]  # no model; no grams
    requests = [gram_ids(t) for i, tpl in enumerate(templates) for t in _texts(tpl, 10, 10 + i)] + [gram_ids("")]
    verdicts = np.array([accepts_each(r, models) for r in requests])
    alone = np.array([[m is None or bool(m.accepts([r])[0]) for m in models] for r in requests])
    assert np.array_equal(verdicts, alone)
    assert (
        verdicts[:, -2:].all() and not verdicts[-1, :4].any()
    )  # ungated models pass all; an empty request fails the rest
    assert 0 < verdicts[:-1, :4].mean() < 1  # both verdicts occur


def test_skill_without_fixed_text_gates_nothing() -> None:
    rng = random.Random(4)
    free = [" ".join(rng.choices(WORDS, k=rng.randint(1, 2))) for _ in range(200)]  # no word is in half the inputs
    m = fit_format(free, FormatSettings())
    assert len(m.grams) == 0
    assert m.accepts([gram_ids("anything at all, say a haiku")]).all()


def test_too_few_inputs_means_no_gate_and_tensors_round_trip() -> None:
    few = fit_format(_texts("Title: {}", 5, 5), FormatSettings(min_inputs=20))
    assert few.threshold == float("-inf") and few.accepts([gram_ids("nothing alike")]).all()
    m = fit_format(_texts("Title: {}", 100, 6), FormatSettings())
    back = FormatModel.from_tensors(m.tensors())
    assert back is not None and np.array_equal(back.grams, m.grams) and back.threshold == pytest.approx(m.threshold)
    assert np.allclose(back.log_odds, m.log_odds)
    assert FormatModel.from_tensors({}) is None


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="min_df"):
        FormatSettings(min_df=0)
    with pytest.raises(ValueError, match="folds"):
        FormatSettings(folds=1)


# --- in the router, with the real MiniLM on real Long Sequence inputs --------------------------------------
def _route_texts(task: str, split: str, n: int) -> list[str]:
    return [e["route_text"] for e in read_task("long_sequence", task, split, n)]


@pytest.fixture(scope="module")
def amazon_router(embedder):  # type: ignore[no-untyped-def]
    router = Router(embedder, RouterSettings())
    router.add_skill("amazon", router.prepare_keys(_route_texts("amazon", "train", 150)))
    return router


def test_unseen_sibling_falls_back_by_format_and_the_similarity_gate_alone_would_take_it(
    amazon_router, embedder
) -> None:  # type: ignore[no-untyped-def]
    """yelp has amazon's instruction and labels; only its field names differ ("Text:" without "Title:")."""
    yelp = _route_texts("yelp", "test", 60)
    gated = amazon_router.route(yelp)
    assert sum(d.reason == "format_mismatch" for d in gated) >= 57, [d.reason for d in gated]
    off = Router(
        embedder, replace(amazon_router.settings, format=replace(amazon_router.settings.format, enabled=False))
    )
    off.add_skill("amazon", amazon_router.prepare_keys(_route_texts("amazon", "train", 150)))
    taken = off.route(yelp)
    assert sum(bool(d.route) for d in taken) >= 30  # input similarity accepts most of them


def test_own_inputs_pass_and_a_learned_sibling_takes_its_own(amazon_router) -> None:  # type: ignore[no-untyped-def]
    own = amazon_router.route(_route_texts("amazon", "test", 60))
    assert sum(not d.route for d in own) <= 2
    amazon_router.add_skill("yelp", amazon_router.prepare_keys(_route_texts("yelp", "train", 150)))
    try:
        routed = {task: amazon_router.route(_route_texts(task, "test", 60)) for task in ("amazon", "yelp")}
        for task, ds in routed.items():
            assert sum(bool(d.route) and d.route[0][0] == task for d in ds) >= 52, task  # 96-99% in the full eval
        assert not any(
            s == "amazon" for d in routed["yelp"] for s, _ in d.route
        )  # amazon's slots are dropped: no mixing
    finally:
        amazon_router.remove_skill("yelp")


def test_unrelated_requests_report_below_threshold_not_format(amazon_router) -> None:  # type: ignore[no-untyped-def]
    ds = amazon_router.route(["Write a haiku about autumn leaves.", "What is 17 times 23?"])
    assert [d.reason for d in ds] == ["below_threshold", "below_threshold"]
    nearest = amazon_router.route(
        ["Write a haiku about autumn leaves.", *_route_texts("yelp", "test", 3)], open_set=False
    )
    assert all(d.reason == "matched" and d.route == [("amazon", 1.0)] for d in nearest)  # no gate: the nearest skill


def test_skill_stored_without_a_format_model_is_not_format_gated(amazon_router, embedder) -> None:  # type: ignore[no-untyped-def]
    router = Router(embedder, amazon_router.settings)
    tensors = amazon_router.prepare_keys_from_embeddings(
        embedder.embed(_route_texts("amazon", "train", 150))
    )  # no texts
    assert "format_grams" not in tensors
    router.add_skill("amazon", tensors)
    assert not any(d.reason == "format_mismatch" for d in router.route(_route_texts("yelp", "test", 20)))
