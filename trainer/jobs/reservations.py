"""Skill-name reservations: one job at a time creates or trains a given skill.

A job reserves its skill when it is created and frees it when it ends (succeeded, failed or cancelled), so of
two uploads of the same new name one gets its job and the other a 409, and a new version of a skill cannot be
queued while another job for that skill is pending or running (409 skill_busy: retry once it ended; versions
are never queued behind each other, so which one serves is never a race). The in-process queue keeps them
here (a lock and a dict); the Redis queue keeps them in Redis (SET NX with the job id), shared by every server.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..records import TERMINAL, JobStatus

CREATION_GRACE_S = 600.0  # a holder not recorded yet (being created) keeps its name this long at most

# The Redis queue's reservations (trainer.jobs.redis_queue). KEYS: skill; ARGV: job id, job record key prefix, grace ms.
# Take the name unless a job that has not ended holds it (a holder with no record yet is being created: it keeps
# the name while the key's TTL lasts; recording the job removes the TTL).
RESERVE_SCRIPT = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then
  local raw = redis.call('GET', ARGV[2] .. holder)
  if raw then
    local status = cjson.decode(raw)['status']
    if status ~= 'succeeded' and status ~= 'failed' and status ~= 'cancelled' then return holder end
  elseif redis.call('PTTL', KEYS[1]) > 0 then
    return holder
  end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return false
"""
# KEYS: skill; ARGV: job id. Free the name if this job holds it.
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class NameReservations:
    """skill name → the id of the job that holds it. `status(job_id)`: the queue's record of that job's state,
    None when it has none yet (the job is being created)."""

    def __init__(self, status: Callable[[str], JobStatus | None]) -> None:
        self._status = status
        self._held: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def reserve(self, skill: str, job_id: str) -> str | None:
        """Reserve `skill` for `job_id`: None when done, else the id of the job that holds it."""
        now = time.monotonic()
        with self._lock:
            held = self._held.get(skill)
            if held is not None and held[0] != job_id:
                holder, since = held
                status = self._status(holder)
                creating = status is None and now - since < CREATION_GRACE_S
                if creating or (status is not None and status not in TERMINAL):
                    return holder
            self._held[skill] = (job_id, now)
            return None

    def release(self, skill: str, job_id: str) -> None:
        """Free `skill` if `job_id` holds it (a later job may hold it by now)."""
        with self._lock:
            if skill in self._held and self._held[skill][0] == job_id:
                del self._held[skill]
