"""Routing on what a skill needs (input fields, label set), so paraphrased instructions still route."""

from __future__ import annotations

import json

import numpy as np
import pytest

from skillpool.evaluation.tasks import load_paraphrases, task_text
from skillpool.router import Router, RouterSettings
from skillpool.router.formats import gram_ids
from skillpool.router.needs import (
    FieldModel,
    LabelIndex,
    LabelModel,
    LabelSettings,
    field_ids,
    fields_accept_each,
    fit_fields,
    fit_labels,
    label_set,
    labels_accept_each,
    option_ids,
    request_grams,
)
from tests.datasets import dataset_dir, read_task

PARAPHRASES = load_paraphrases("long_sequence")


def _rows(task: str, split: str, n: int) -> list[dict]:
    path = dataset_dir("long_sequence", task) / f"{split}.jsonl"
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()][:n]


def _paraphrased(task: str, n: int, mode: str = "with-instruction") -> list[str]:
    para = PARAPHRASES[task]
    return [task_text(r, mode, para[i % len(para)]) for i, r in enumerate(_rows(task, "test", n))]


def _learn(router: Router, task: str, n: int = 120) -> None:
    ex = read_task("long_sequence", task, "train", n)
    router.add_skill(
        task,
        router.prepare_keys([e["route_text"] for e in ex], [e["route_input"] for e in ex], [e["answer"] for e in ex]),
    )


def test_label_set_is_the_answers_of_a_classifier_and_empty_for_generation() -> None:
    mnli = read_task("long_sequence", "mnli", "train", 200)
    assert sorted(label_set([e["answer"] for e in mnli], LabelSettings())) == ["contradiction", "entailment", "neutral"]
    xsum = read_task("superni", "task1290_xsum_summarization", "train", 100)
    assert label_set([e["answer"] for e in xsum], LabelSettings()) == []  # summaries: no short list


def test_a_request_naming_part_of_the_label_set_asks_for_another_task() -> None:
    mnli = read_task("long_sequence", "mnli", "train", 200)
    model = fit_labels([e["answer"] for e in mnli], [e["route_input"] for e in mnli], LabelSettings())
    assert model is not None and model.max_partial < 1 / 3  # premises rarely say "entailment" by chance
    rte = "Does sentence 1 imply sentence 2? Answer entailment or contradiction.\nsentence 1: a\nsentence 2: b"
    own = "How are these two sentences related? Options: neutral, entailment, contradiction.\nsentence 1: a"
    assert model.coverage(gram_ids(rte)) == pytest.approx(2 / 3) and not model.accepts(gram_ids(rte))
    assert model.accepts(gram_ids(own)) and model.accepts(gram_ids("sentence 1: a\nsentence 2: b"))
    restored = LabelModel.from_tensors(model.tensors())
    assert restored is not None and restored.accepts(gram_ids(own)) and not restored.accepts(gram_ids(rte))


def test_a_request_naming_a_wider_label_set_is_not_for_a_skill_with_a_subset() -> None:
    models: dict[str, LabelModel] = {}
    for task in ("mnli", "rte"):
        ex = read_task("long_sequence", task, "train", 200)
        m = fit_labels([e["answer"] for e in ex], [e["route_input"] for e in ex], LabelSettings())
        assert m is not None
        models[task] = m
    index = LabelIndex(models)  # rte's two labels never occur in its inputs by chance: indexed too
    both = [models["mnli"], models["rte"]]
    mnli = [request_grams(t) for t in _paraphrased("mnli", 12)]
    rte = [request_grams(t) for t in _paraphrased("rte", 12)]
    assert all(list(labels_accept_each(r, both, index)) == [True, False] for r in mnli)
    assert all(list(labels_accept_each(r, both, index)) == [False, True] for r in rte)


def test_a_spelled_out_option_list_must_name_all_of_the_skills_labels() -> None:
    agnews = read_task("long_sequence", "agnews", "train", 200)
    model = fit_labels([e["answer"] for e in agnews], [e["route_input"] for e in agnews], LabelSettings())
    assert model is not None
    dbpedia = read_task("long_sequence", "dbpedia", "test", 20)  # same fields, its own option list
    assert not any(model.accepts(gram_ids(e["route_text"]), option_ids(e["route_text"])) for e in dbpedia)
    own = [e["route_text"] for e in read_task("long_sequence", "agnews", "test", 20)] + _paraphrased("agnews", 12)
    assert all(model.accepts(gram_ids(t), option_ids(t)) for t in own)
    assert not len(option_ids("It is one of the best films: great acting, bad plot."))  # prose, not a list
    assert not len(option_ids(agnews[0]["route_input"]))  # input only: no option list


def _sentiment_models() -> dict[str, LabelModel]:
    """SuperNI's two sentiment tasks: one output space spelled POS, NEG (task363) and positive, negative (task1687)."""
    models = {}
    for task in ("task363_sst2_polarity_classification", "task1687_sentiment140_classification"):
        ex = read_task("superni", task, "train", 200)
        m = fit_labels([e["answer"] for e in ex], [e["route_input"] for e in ex], LabelSettings())
        assert m is not None
        models[task] = m
    return models


def test_a_label_set_in_another_spelling_asks_for_the_same_output_space() -> None:
    models = _sentiment_models()
    sst2, tweets = models.values()
    assert sst2.label_keys() != tweets.label_keys() and sst2.stem_key == tweets.stem_key
    index = LabelIndex(models)  # neither set is named by chance in its inputs: both indexed
    review = "Would you call this line from a film review positive or negative?\nA gorgeous, witty film."
    tweet = "Tweet sentiment please, POS or NEG.\n@sam can't wait for the weekend!"
    for text in (review, tweet):  # each names the other skill's whole set: neither is turned away now
        assert list(labels_accept_each(request_grams(text), [sst2, tweets], index, option_ids(text))) == [True, True]
    # an option list in the other spelling passes; one of another output space does not
    assert sst2.accepts(request_grams(review), option_ids("Options: positive, negative.\n" + review))
    assert not sst2.accepts(request_grams(review), option_ids("Options: Good, Bad.\n" + review))
    restored = LabelModel.from_tensors(sst2.tensors())
    assert restored is not None and restored.stem_key == sst2.stem_key
    # a skill stored before stems keeps the old rule: another spelling of its labels turns it away
    old = {k: v for k, v in sst2.tensors().items() if k != "label_stems"}
    before = LabelModel.from_tensors(old)
    assert before is not None and before.stem_key is None
    assert list(labels_accept_each(request_grams(review), [before, tweets], index)) == [False, True]


def test_stems_that_cannot_tell_labels_apart_are_not_a_spelling() -> None:
    ex = read_task("long_sequence", "amazon", "train", 300)  # very negative, very positive: both "ver"
    m = fit_labels([e["answer"] for e in ex], [e["route_input"] for e in ex], LabelSettings())
    assert m is not None and m.stem_key is None
    text = "Options: very bad, bad, neutral, good, very good.\nGreat blender."
    assert not m.accepts(request_grams(text), option_ids(text))


def test_two_spellings_of_one_label_set_route_by_their_inputs(embedder) -> None:  # type: ignore[no-untyped-def]
    """Movie reviews and tweets with the other skill's label spelling in the instruction go to their own skill."""
    router = Router(embedder, RouterSettings())
    tasks = ("task363_sst2_polarity_classification", "task1687_sentiment140_classification")
    for task in tasks:
        ex = read_task("superni", task, "train", 200)
        keys = router.prepare_keys(
            [e["route_text"] for e in ex], [e["route_input"] for e in ex], [e["answer"] for e in ex]
        )
        assert "label_stems" in keys
        router.add_skill(task, keys)
    asks = {
        tasks[0]: "Would you call this line from a film review positive or negative?\n{}",
        tasks[1]: "Tweet sentiment please, POS or NEG.\n{}",
    }
    for task, ask in asks.items():
        ds = router.route([ask.format(e["route_input"]) for e in read_task("superni", task, "test", 30)])
        top1 = [d.route[0][0] if d.route else "base" for d in ds]
        assert top1.count(task) >= 24, (task, top1)  # 0 of 30 when the other spelling turned the skill away


def test_field_ids_are_line_initial_names_apart_from_word_grams() -> None:
    ids = field_ids("Title: a day\nText: so: it went\n\nAnswer:")
    assert len(ids) == 3 and np.array_equal(ids, field_ids("title: x\n  TEXT : y\nanswer: z"))
    assert not len(field_ids("I like it. Text: not at a line start"))
    assert not np.intersect1d(ids, gram_ids("title text answer")).size  # salted: never a word gram
    assert np.array_equal(request_grams("Title: a"), np.union1d(gram_ids("Title: a"), field_ids("Title: a")))


def test_a_request_with_another_skills_fields_is_not_for_a_skill_without_them() -> None:
    """imdb's inputs have no field; sst-2's and amazon's have "Text:". Same labels (Good, Bad) for imdb and
    sst-2, so only the field tells an sst-2 request from an imdb one."""
    imdb = fit_fields([e["route_input"] for e in read_task("long_sequence", "imdb", "train", 300)])
    amazon = fit_fields([e["route_input"] for e in read_task("long_sequence", "amazon", "train", 300)])
    assert len(imdb.typical) == 1 and len(amazon.typical) == 3  # answer; title, text, answer
    known = np.unique(np.concatenate([imdb.typical, amazon.typical]))
    models: list[FieldModel | None] = [imdb, amazon, None]
    sst2 = [request_grams(t) for t in _paraphrased("sst-2", 30)]
    assert all(list(fields_accept_each(r, models, known)) == [False, True, True] for r in sst2)
    own = [request_grams(t) for t in _paraphrased("imdb", 30)]
    assert sum(fields_accept_each(r, models, known)[0] for r in own) >= 29
    restored = FieldModel.from_tensors(imdb.tensors())
    assert restored is not None and np.array_equal(restored.seen, imdb.seen)


@pytest.fixture(scope="module")
def needs_router(embedder):  # type: ignore[no-untyped-def]
    router = Router(embedder, RouterSettings())
    for task in ("agnews", "amazon", "mnli", "sst-2"):
        _learn(router, task)
    return router


def test_paraphrased_instructions_route_to_the_skill(needs_router) -> None:  # type: ignore[no-untyped-def]
    for task in ("agnews", "amazon", "mnli", "sst-2"):
        for mode in ("with-instruction", "system-message"):
            ds = needs_router.route(_paraphrased(task, 36, mode))
            top1 = [d.route[0][0] if d.route else "base" for d in ds]
            assert top1.count(task) >= 32, (task, mode, top1)


def test_siblings_without_the_skills_fields_or_labels_still_fall_back(needs_router) -> None:  # type: ignore[no-untyped-def]
    yelp = needs_router.route(_paraphrased("yelp", 36))  # amazon's labels, but no "Title:" field
    assert sum(not d.route for d in yelp) >= 32, [d.reason for d in yelp]
    rte = needs_router.route(_paraphrased("rte", 36))  # mnli's fields, two of its three labels
    assert sum(not d.route for d in rte) >= 32, [d.route for d in rte]
    assert all(d.reason in ("format_mismatch", "below_threshold") for d in yelp + rte if not d.route)


def test_skills_stored_before_the_needs_gate_still_load_and_route(needs_router, embedder) -> None:  # type: ignore[no-untyped-def]
    """A skill stored with a whole-prompt format model and no label model (prepare_keys(texts) only, as
    before) is gated on its uploaded wording, as it was; one stored with neither still routes. (Their keys
    never saw an input without its instruction, so paraphrases mostly miss them: retrain to get both.)"""
    router = Router(embedder, needs_router.settings)
    old = router.prepare_keys([e["route_text"] for e in read_task("long_sequence", "agnews", "train", 120)])
    assert "label_grams" not in old and "format_grams" in old
    router.add_skill("agnews", old)
    original = router.route([e["route_text"] for e in read_task("long_sequence", "agnews", "test", 30)])
    assert sum(bool(d.route) and d.route[0][0] == "agnews" for d in original) >= 29
    assert all(not d.route for d in router.route(_paraphrased("agnews", 12)))  # the old gate: wording only
    bare = {k: v for k, v in old.items() if not k.startswith(("format_", "threshold_format"))}
    router.add_skill("agnews", bare)  # stored with neither model: loads, routes, never format-gated
    ds = router.route([e["route_text"] for e in read_task("long_sequence", "agnews", "test", 30)])
    assert sum(bool(d.route) and d.route[0][0] == "agnews" for d in ds) >= 29
    assert not any(d.reason == "format_mismatch" for d in router.route(_paraphrased("agnews", 12)))


def test_inputs_must_match_the_texts(embedder) -> None:  # type: ignore[no-untyped-def]
    router = Router(embedder)
    with pytest.raises(ValueError, match="one input per text"):
        router.prepare_keys_from_embeddings(np.zeros((2, embedder.dim), np.float32), ["a", "b"], ["a"])
