"""Skill lifecycle events, typed: what every server follows to serve what the shared store says.

A worker that stores a skill publishes SkillRegistered; retiring one publishes SkillRetired, a rollback
SkillActivated. Resync is local: the listener's periodic "re-read the store" (a stream trimmed past what a
server saw). On the wire (the Redis events stream) each is a JSON object with a `type`, spelled as before, so
servers of this and the previous release follow one stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class _VersionEvent:
    """An event about one version of a skill: on the wire, its `name` and `version`."""

    name: str
    version: int


@dataclass(frozen=True)
class SkillRegistered(_VersionEvent):
    """A worker stored this version: serve it."""


@dataclass(frozen=True)
class SkillActivated(_VersionEvent):
    """A rollback made this stored version the one served."""


@dataclass(frozen=True)
class SkillRetired:
    """The skill is no longer served."""

    name: str


@dataclass(frozen=True)
class Resync:
    """Re-read the store (local only: the listener's periodic resync)."""


SkillEvent = SkillRegistered | SkillRetired | SkillActivated | Resync
_TYPES: dict[str, type[SkillEvent]] = {
    "skill_registered": SkillRegistered,
    "skill_retired": SkillRetired,
    "skill_activated": SkillActivated,
    "resync": Resync,
}
_NAMES = {cls: name for name, cls in _TYPES.items()}


def to_wire(event: SkillEvent) -> str:
    fields: dict[str, Any] = {"type": _NAMES[type(event)], **event.__dict__}
    return json.dumps(fields)


def from_wire(raw: str) -> SkillEvent | None:
    """The event in `raw`; None for a type this release does not know (a newer server's: skipped)."""
    fields = json.loads(raw)
    cls = _TYPES.get(str(fields.pop("type", "")))
    if cls is None:
        return None
    if "version" in fields:
        fields["version"] = int(fields["version"])
    return cls(**fields)
