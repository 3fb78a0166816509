"""Router flags defined once: defaults are RouterSettings', every spelling reaches the same field."""

from __future__ import annotations

import argparse

import pytest

from skillpool.router import RouterSettings
from skillpool.router.flags import EVAL_FIELDS, FLAGS, SERVE_FIELDS, add_router_flags, router_settings


def _parse(argv: list[str], which: tuple[str, ...] = SERVE_FIELDS) -> RouterSettings:
    p = argparse.ArgumentParser()
    add_router_flags(p, which)
    return router_settings(p.parse_args(argv))


@pytest.mark.parametrize("which", [SERVE_FIELDS, EVAL_FIELDS, tuple(f.field for f in FLAGS)])
def test_no_flag_given_is_the_default_settings(which: tuple[str, ...]) -> None:
    assert _parse([], which) == RouterSettings()


def test_the_serve_and_the_eval_spellings_set_the_same_field() -> None:
    for argv in (["--router-top-k", "3"], ["--top-k", "3"]):
        assert _parse(argv).top_k == 3 and _parse(argv, EVAL_FIELDS).top_k == 3
    assert _parse(["--router", "sapt", "--keys", "2"]) == _parse(["--router-mode", "sapt", "--router-keys", "2"])


def test_nested_fields_and_on_off_switches() -> None:
    s = _parse(["--router-format-gate", "off", "--sapt-lambda", "1.5", "--sapt-replay", "pseudo"])
    assert (s.format.enabled, s.sapt.arm_lambda, s.sapt.replay) == (False, 1.5, "pseudo")
    assert s.format.min_df == RouterSettings().format.min_df  # the rest of a nested block keeps its defaults
    assert _parse(["--groups", "2", "--labels", "off"], EVAL_FIELDS).dtkr.groups == 2


def test_a_bad_choice_is_refused() -> None:
    with pytest.raises(SystemExit):
        _parse(["--router-mode", "nope"])
