"""Command-line flags generated from dataclass fields (as vLLM's EngineArgs.add_cli_args), and the value parsers
every command's flags share.

A field's `option(...)` metadata holds its help text and any flag spelling other than the field's own name
(`--data-dir` for data_dir), older spellings kept as aliases, the environment variable that gives the default,
and a unit the flag is given in (`--batch-window-ms` for a field in seconds). Type, default and choices come
from the field.
"""

from __future__ import annotations

import argparse
import math
import os
import typing
from collections.abc import Callable
from dataclasses import Field, dataclass, field, fields
from types import NoneType, UnionType
from typing import Any

from pydantic import ByteSize, TypeAdapter, ValidationError


@dataclass(frozen=True)
class Option:
    help: str
    names: tuple[str, ...] = ()  # the flag's spellings, canonical first; default: --the-field-name
    env: str | None = None  # the environment variable that gives the default (an empty one gives none)
    per: float = 1.0  # flag units per field unit: 1000 for a flag in ms of a field in s (the flag is a float)
    choices: tuple[str, ...] | None = None
    negate: str | None = None  # a bool field set False by this store_true flag (`--no-trainer`)
    parse: Callable[[str], Any] | None = None  # the flag's own parser, where the field's type is not enough


def option(default: Any, help: str, *names: str, **kw: Any) -> Any:
    """A field default with its flag's `Option` as metadata."""
    return field(default=default, metadata={"option": Option(help, names, **kw)})


def number(
    kind: type[int] | type[float] = int, lo: float | None = None, hi: float | None = None
) -> Callable[[str], Any]:
    """A parser of a whole number (`int`) or a finite number (`float`), at least `lo` and at most `hi` where given."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"not a whole number: {text!r}" if kind is int else f"not a number: {text!r}"
            ) from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, not {text}")
        if lo is not None and hi is not None and not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"must be from {lo:g} to {hi:g}, not {value:g}")
        if lo is not None and value < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo:g}, not {value:g}")
        if hi is not None and value > hi:
            raise argparse.ArgumentTypeError(f"must be at most {hi:g}, not {value:g}")
        return value

    return parse


positive_int = number(int, lo=1)  # a count that must be at least 1 (threads, a batch size)


def byte_size(text: str) -> int:
    """A size: bytes, or a number with a unit (20GiB, 512MiB, 1.5GB), as pydantic's ByteSize reads it; never negative."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"a size must be >= 0 bytes, not {text}")
    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (bytes, or with a unit: 20GiB, 512MiB)") from None


def flag_type(annotation: Any) -> type:
    """The argparse type of a field annotated `T` or `T | None`."""
    if isinstance(annotation, UnionType):
        (annotation,) = (a for a in typing.get_args(annotation) if a is not NoneType)
    if not isinstance(annotation, type):
        raise TypeError(f"no flag type for {annotation!r}")
    return annotation


def optioned(cls: type) -> list[Field[Any]]:
    """The fields of dataclass `cls` that carry an `option(...)`."""
    return [f for f in fields(cls) if "option" in f.metadata]


def add_options(p: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One flag per optioned field of `cls`, each with its help and default; the field's name is the dest."""
    types = typing.get_type_hints(cls)
    for f in optioned(cls):
        opt: Option = f.metadata["option"]
        if opt.negate is not None:
            p.add_argument(opt.negate, dest=f.name, action="store_false", help=opt.help)
            continue
        default: Any = f.default
        if opt.env is not None:
            default = os.environ.get(opt.env) or default  # compose passes an unset variable as empty
        names = opt.names or ("--" + f.name.replace("_", "-"),)
        kind, metavar = flag_type(types[f.name]), None
        if opt.per != 1.0:  # named after the flag's unit (BATCH_WINDOW_MS), not the field's
            kind, default, metavar = float, default * opt.per, names[0][2:].replace("-", "_").upper()
        p.add_argument(
            *names,
            dest=f.name,
            type=opt.parse or kind,
            default=default,
            choices=opt.choices,
            metavar=metavar,
            help=opt.help,
        )


def read_options(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The values of `cls`'s optioned fields in `args` (parsed by a parser add_options built), in field units."""
    types, values = typing.get_type_hints(cls), {}
    for f in optioned(cls):
        value = getattr(args, f.name)
        opt: Option = f.metadata["option"]
        if opt.per != 1.0:
            value = flag_type(types[f.name])(value / opt.per)
        values[f.name] = value
    return values
