"""Every Redis key and channel name the job queue uses, in one place (as arq's constants.py does).

All live under a prefix (default "skillpool", `--redis-prefix`) so that deployments can share a Redis.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "skillpool"


@dataclass(frozen=True)
class RedisKeys:
    prefix: str = DEFAULT_PREFIX

    def job(self, job_id: str) -> str:
        """The job record (JSON)."""
        return f"{self.prefix}:job:{job_id}"

    def data(self, job_id: str) -> str:
        """Examples + config, kept until the job ends (a retried job reads them again)."""
        return f"{self.prefix}:data:{job_id}"

    def lease(self, job_id: str) -> str:
        """The id of the worker running the job, with a TTL that worker's heartbeat renews."""
        return f"{self.prefix}:lease:{job_id}"

    def cancel(self, job_id: str) -> str:
        """Set when a cancel is requested."""
        return f"{self.prefix}:cancel:{job_id}"

    def skill(self, name: str) -> str:
        """The id of the job that creates or trains this skill now (trainer.reservations), until it ends."""
        return f"{self.prefix}:skill:{name}"

    @property
    def jobs(self) -> str:
        """Sorted set of job ids by creation time."""
        return f"{self.prefix}:jobs"

    @property
    def queue(self) -> str:
        """List of queued job ids (FIFO)."""
        return f"{self.prefix}:queue"

    @property
    def processing(self) -> str:
        """List of job ids a worker has claimed; one whose lease has expired goes back to the queue."""
        return f"{self.prefix}:processing"

    @property
    def events(self) -> str:
        """Stream of skill events; each server reads it from the last id it saw, so a reconnect loses none."""
        return f"{self.prefix}:events"
