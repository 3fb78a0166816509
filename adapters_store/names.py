"""Skill-name validation: names become folder names, so they are slugs and never raw paths."""

from __future__ import annotations

import re

# fullmatch, not match: `$` also matches before a trailing newline, and "abc\n" would pass
_SLUG = re.compile(r"[a-z0-9](?:[a-z0-9._-]{0,62}[a-z0-9])?")
# Names the API gives another meaning to (`model="auto"` routes, `base` means no adapter).
RESERVED = frozenset({"auto", "base"})


class InvalidSkillName(ValueError):
    pass


def validate_skill_name(name: str) -> str:
    """Return `name` if it is a usable skill slug, else raise InvalidSkillName saying why."""
    if not isinstance(name, str) or not name:
        raise InvalidSkillName("skill name is required")
    if not _SLUG.fullmatch(name) or ".." in name:
        raise InvalidSkillName(
            f"invalid skill name {name!r}: use 1-64 lowercase letters, digits, '.', '_' or '-', "
            "starting and ending with a letter or digit"
        )
    if name in RESERVED:
        raise InvalidSkillName(f"skill name {name!r} is reserved")
    return name
