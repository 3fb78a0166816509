"""The Mix value: canonical (sorted by skill, normalized), hashable, the base model empty, bad weights refused."""

from __future__ import annotations

import math

import pytest

from skillpool.lora.mix import Mix, format_pairs


def test_pairs_are_sorted_by_skill_and_normalized() -> None:
    m = Mix.of({"b": 3.0, "a": 1.0})
    assert m.pairs == (("a", 0.25), ("b", 0.75))
    assert m.skills == ("a", "b") and m.weights == (0.25, 0.75)
    assert list(m) == [("a", 0.25), ("b", 0.75)] and len(m) == 2
    assert m.ranked == (("b", 0.75), ("a", 0.25)) and m.top == "b"
    assert str(m) == "b=0.75,a=0.25"


def test_a_skill_named_twice_sums_and_zero_weights_drop() -> None:
    assert Mix.of([("a", 3.0), ("b", 0.0), ("a", 1.0)]).pairs == (("a", 1.0),)
    assert Mix.of([("a", 1), ("b", 1)]).weights == (0.5, 0.5)  # ints are numbers too


def test_ties_rank_in_the_order_given_and_do_not_change_equality() -> None:
    ba, ab = Mix.of([("b", 1.0), ("a", 1.0)]), Mix.of([("a", 1.0), ("b", 1.0)])
    assert ba.ranked == (("b", 0.5), ("a", 0.5)) and ab.ranked == (("a", 0.5), ("b", 0.5))
    assert ba == ab and hash(ba) == hash(ab) and len({ba, ab}) == 1


def test_equal_mixes_hash_alike_and_differ_from_others() -> None:
    assert Mix.of({"a": 2.0, "b": 2.0}) == Mix.of({"b": 0.5, "a": 0.5})
    assert hash(Mix.of({"a": 2.0, "b": 2.0})) == hash(Mix.of({"b": 0.5, "a": 0.5}))
    assert Mix.of({"a": 0.6, "b": 0.4}) != Mix.of({"a": 0.4, "b": 0.6})
    assert Mix.of({"a": 1.0}) != Mix.base()
    with pytest.raises(AttributeError):
        Mix.of({"a": 1.0}).pairs = ()  # type: ignore[misc]  # frozen


def test_the_base_model_is_the_empty_mix() -> None:
    base = Mix.base()
    assert base == Mix() == Mix.of({}) == Mix.of([]) and not base and len(base) == 0
    assert base.top is None and base.skills == () and str(base) == "base" == format_pairs([])


def test_normalized_weights_are_kept_bit_for_bit_and_renormalizing_is_idempotent() -> None:
    route = [("x", 0.1), ("y", 0.2), ("z", 0.7)]  # sums to 0.9999999999999999
    m = Mix.of(route)
    assert dict(m.pairs) == dict(route)  # within 1e-12 of 1: not divided again
    assert Mix.of(m.ranked) == m and Mix.of(m.ranked).ranked == m.ranked
    thirds = Mix.of({"a": 1.0, "b": 1.0, "c": 1.0})
    assert math.isclose(sum(thirds.weights), 1.0) and Mix(thirds.pairs) == thirds


def test_renamed_keeps_weights_and_ranking() -> None:
    m = Mix.of([("b", 0.6), ("a", 0.4)])
    keyed = m.renamed(lambda s: f"{s}#1")
    assert keyed.ranked == (("b#1", 0.6), ("a#1", 0.4)) and keyed.pairs == (("a#1", 0.4), ("b#1", 0.6))


@pytest.mark.parametrize(
    "pairs",
    [
        (("one", math.nan),),
        (("one", math.inf), ("two", 1.0)),
        (("one", 1e308), ("two", 1e308)),  # each finite, the sum is not
        (("one", -1.0), ("two", 1.0)),
        (("one", 0.0),),  # named skills but no weight: not the base model
        (("one", True),),
        (("one", "1"),),
    ],
    ids=["nan", "inf", "sum-overflows", "negative", "all-zero", "bool", "text"],
)
def test_bad_weights_are_refused(pairs) -> None:  # type: ignore[no-untyped-def]
    """What the engines refused per request before (a NaN weight would poison a row's logits) can no longer
    be built: no engine request carries such a mix."""
    with pytest.raises(ValueError, match="mix weight"):
        Mix.of(pairs)


def test_a_skill_must_be_a_name() -> None:
    with pytest.raises(TypeError):
        Mix.of([(1, 1.0)])  # type: ignore[list-item]
