"""The groups the server's --affinity-group-size makes of the placement benchmarks' skill vectors (tests.synthetic's
`directions`: rank neighbours are near, as the router's mixed skills are near in its embedding space)."""

from __future__ import annotations

from functools import cache

from tests.synthetic import directions


@cache  # one grouping per pool, shared by every replica count and policy run
def group_keys(skills: int, size: int) -> tuple[int, ...]:
    """Each rank's group as the server computes it from `directions`, as a negative id (never a skill's own)."""
    from skillpool.server.cluster.groups import SkillGroups

    groups, vectors = SkillGroups(size), directions(skills)
    for rank in range(skills):
        groups.add(str(rank), vectors[rank : rank + 1])
    ids: dict[str | None, int] = {}
    return tuple(-1 - ids.setdefault(groups.key(str(rank)), len(ids)) for rank in range(skills))
