"""Every Redis key and channel name the job queue uses, in one place (as arq's constants.py does).

All live under a prefix (default "skillpool", `--redis-prefix`) so that deployments can share a Redis: a key
is `PREFIX:NAME` or, one per job or skill, `PREFIX:NAME:ID`, NAME being the attribute's own name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_PREFIX = "skillpool"


class _Named:
    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name


class _Key(_Named):
    """`keys.NAME`: the one key `PREFIX:NAME`."""

    def __get__(self, keys: RedisKeys, owner: type | None = None) -> str:
        return f"{keys.prefix}:{self.name}"


class _KeyPerId(_Named):
    """`keys.NAME(id)`: one key per job or skill, `PREFIX:NAME:ID`."""

    def __get__(self, keys: RedisKeys, owner: type | None = None) -> Callable[[str], str]:
        return lambda ident: f"{keys.prefix}:{self.name}:{ident}"


@dataclass(frozen=True)
class RedisKeys:
    prefix: str = DEFAULT_PREFIX

    job = _KeyPerId()  # the job record (JSON)
    data = _KeyPerId()  # examples + config, kept until the job ends (a retried job reads them again)
    lease = _KeyPerId()  # the id of the worker running the job, with a TTL that worker's heartbeat renews
    cancel = _KeyPerId()  # set when a cancel is requested
    skill = _KeyPerId()  # the id of the job that creates or trains this skill now (reservations), until it ends
    jobs = _Key()  # sorted set of job ids by creation time
    queue = _Key()  # list of queued job ids (FIFO)
    processing = _Key()  # list of job ids a worker has claimed; one whose lease has expired goes back to the queue
    pending = _Key()  # hash: job id -> its owner ("" without a key), for every admitted job until it ends
    events = _Key()  # stream of skill events; each server reads it from the last id it saw, so a reconnect loses none
