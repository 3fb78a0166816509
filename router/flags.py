"""Router command-line flags, defined once from `RouterSettings` for `serve`, `worker` and `eval routing`.

Each flag names a RouterSettings field (dotted for a nested one); its type, default and on/off form come from
the dataclass. The first name is the canonical one; the others are the spellings a command used before, kept
as aliases (`eval routing` said `--top-k` where `serve` said `--router-top-k`).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import Any

from .sapt import POOLS, REPLAY_SOURCES
from .types import MODES, RouterSettings

_TYPES: dict[str, type] = {"int": int, "float": float, "str": str, "bool": bool}  # annotations are strings here


@dataclass(frozen=True)
class Flag:
    field: str  # a RouterSettings field, dotted for a nested one ("sapt.arm_lambda")
    names: tuple[str, ...]  # canonical first, then the older spellings (aliases)
    dest: str  # the namespace attribute: `eval routing` records these names in its JSON's settings
    help: str | None = None
    choices: tuple[str, ...] | None = None


FLAGS: tuple[Flag, ...] = (
    Flag(
        "mode",
        ("--router-mode", "--router"),
        "router",
        "dtkr (SLM keys), sapt (query projector) or centroid (baseline)",
        tuple(MODES),
    ),
    Flag("n_keys", ("--router-keys", "--keys"), "keys", "keys per skill"),
    Flag("dtkr.groups", ("--router-groups", "--groups"), "groups", "dtkr: key groups per skill"),
    Flag("top_k", ("--router-top-k", "--top-k"), "top_k", "key slots retrieved per request (over all skills)"),
    Flag(
        "mix_keep_ratio",
        ("--router-mix-keep-ratio",),
        "mix_keep_ratio",
        "a mix keeps only skills with at least this fraction of the top skill's weight (default 0: all above 5%%)",
    ),
    Flag(
        "temperature", ("--router-temperature", "--temperature"), "temperature", "softmax temperature over slot scores"
    ),
    Flag(
        "threshold_percentile",
        ("--router-threshold-percentile", "--threshold-percentile"),
        "threshold_percentile",
        "gate percentile of a skill's own inputs' held-out scores",
    ),
    Flag(
        "threshold_margin",
        ("--router-threshold-margin", "--threshold-margin"),
        "threshold_margin",
        "... minus this margin (larger: more requests pass the gate)",
    ),
    Flag(
        "white_threshold_percentile",
        ("--router-white-threshold-percentile", "--white-threshold-percentile"),
        "white_threshold_percentile",
        "dtkr: gate percentile of a skill's own inputs' held-out whitened scores",
    ),
    Flag(
        "white_threshold_margin",
        ("--router-white-threshold-margin", "--white-threshold-margin"),
        "white_threshold_margin",
        "dtkr: ... minus this margin (larger: fewer of a skill's own requests fall back, more unseen ones pass)",
    ),
    Flag(
        "format.enabled",
        ("--router-format-gate", "--format-gate"),
        "format_gate",
        "send a request to the base model when it lacks the fixed prompt text of every skill it resembles",
    ),
    Flag(
        "format.min_df",
        ("--router-format-min-df", "--format-min-df"),
        "format_min_df",
        "share of a skill's inputs a gram must be in to be part of its format",
    ),
    Flag(
        "format.margin",
        ("--router-format-margin", "--format-margin"),
        "format_margin",
        "nats below the skill's held-out percentile",
    ),
    Flag(
        "format.percentile",
        ("--router-format-percentile", "--format-percentile"),
        "format_percentile",
        "format gate percentile of the skill's held-out inputs",
    ),
    Flag(
        "format.source",
        ("--router-format-source", "--format-source"),
        "format_source",
        "fit the format gate on the inputs without instruction (fields) or on whole training prompts",
        ("inputs", "prompts"),
    ),
    Flag(
        "labels.enabled",
        ("--router-labels", "--labels"),
        "labels",
        "gate on the skill's label set: a request naming some of its labels but not all falls back",
    ),
    Flag(
        "augment_inputs",
        ("--router-augment-inputs", "--augment-inputs"),
        "augment_inputs",
        "keys and thresholds also learn each training input without its instruction",
    ),
    Flag(
        "sapt.replay",
        ("--sapt-replay",),
        "sapt_replay",
        "sapt: replay the stored real samples or generated pseudo inputs",
        tuple(REPLAY_SOURCES),
    ),
    Flag("sapt.steps", ("--sapt-steps",), "sapt_steps", "sapt: projector training steps"),
    Flag("sapt.arm_lambda", ("--sapt-lambda",), "sapt_lambda", "sapt: weight of attentive reflection"),
    Flag("sapt.pool", ("--sapt-pool",), "sapt_pool", "sapt: how a query's token states are pooled", tuple(POOLS)),
    Flag(
        "sapt.generated",
        ("--sapt-generated",),
        "sapt_generated",
        "sapt: inputs drawn per earlier skill from its stored Gaussian for attentive reflection (0: off)",
    ),
    Flag("sapt.feature_rank", ("--sapt-feature-rank",), "sapt_feature_rank", "sapt: the Gaussian's rank"),
)
_BY_FIELD = {f.field: f for f in FLAGS}

# the router settings a server (and a worker, which prepares the same keys) takes on its command line
SERVE_FIELDS = (
    "mode",
    "n_keys",
    "top_k",
    "mix_keep_ratio",
    "temperature",
    "threshold_percentile",
    "threshold_margin",
    "white_threshold_percentile",
    "white_threshold_margin",
    "format.enabled",
    "sapt.replay",
    "sapt.arm_lambda",
    "sapt.generated",
)
# `eval routing` tunes the gates and the projector too; replay and the mix cut belong to a live server
EVAL_FIELDS = tuple(f.field for f in FLAGS if f.field not in ("mix_keep_ratio", "sapt.replay"))


def _field(path: str) -> tuple[str, Any]:
    """(annotated type name, default) of a dotted RouterSettings field."""
    obj: Any = RouterSettings()
    *parents, leaf = path.split(".")
    for name in parents:
        obj = getattr(obj, name)
    kind = next(f.type for f in fields(obj) if f.name == leaf)
    return str(kind), getattr(obj, leaf)


def add_router_flags(p: argparse.ArgumentParser, which: Iterable[str] = SERVE_FIELDS) -> None:
    """Add the flags of these RouterSettings fields to `p`, defaults from a default RouterSettings."""
    for path in which:
        flag = _BY_FIELD[path]
        kind, default = _field(path)
        if kind == "bool":  # an on/off choice, as before: `--router-format-gate off`
            p.add_argument(
                *flag.names, dest=flag.dest, choices=("on", "off"), default="on" if default else "off", help=flag.help
            )
        else:
            p.add_argument(
                *flag.names, dest=flag.dest, type=_TYPES[kind], choices=flag.choices, default=default, help=flag.help
            )


def router_settings(args: argparse.Namespace, base: RouterSettings | None = None) -> RouterSettings:
    """`base` (default RouterSettings()) with every router flag that `args` holds applied."""
    given = vars(args)
    settings: RouterSettings = base or RouterSettings()
    for flag in FLAGS:
        if flag.dest in given:
            value = given[flag.dest]
            settings = _set(
                settings, flag.field.split("."), value == "on" if _field(flag.field)[0] == "bool" else value
            )
    return settings


def _set(obj: Any, path: list[str], value: Any) -> Any:
    """A copy of the frozen dataclass `obj` with the field at `path` set to `value`."""
    head, *rest = path
    return replace(obj, **{head: _set(getattr(obj, head), rest, value) if rest else value})
