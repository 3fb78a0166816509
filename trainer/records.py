"""Core records shared by the trainer, the job queues, the HTTP API and the CLI clients.

Kept free of heavy imports (no torch) so that a client such as `skillpool upload` can use them.
"""

from __future__ import annotations

from enum import Enum
from typing import NotRequired, TypedDict


class JobStatus(str, Enum):
    """A training job's state: validating → queued → running → succeeded | failed | cancelled.

    A str subclass, so JSON records, Redis values and metric labels hold the same plain strings as before
    and a member compares equal to its string (`JobStatus.QUEUED == "queued"`).
    """

    VALIDATING = "validating"  # set by the API while it builds the job; submit() queues it at once
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:  # f"{status}" and str() give the value on every Python version (3.12 changed it)
        return self.value


TERMINAL = frozenset({JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED})
PENDING = frozenset({JobStatus.QUEUED, JobStatus.RUNNING})


class Example(TypedDict):
    """One normalized training or evaluation row (trainer.datasets.parse_jsonl builds it).

    A TypedDict, not a dataclass: examples travel as JSON (Redis job data, stored replay samples) and the
    training code indexes them as dicts, so the runtime shape stays a plain dict.
    """

    messages: list[dict[str, str]]  # the prompt: every message before the learned assistant answer
    answer: str
    route_text: str  # what the router sees
    route_input: str  # the routed text without the instruction (format gate, input keys)
    held_out: NotRequired[bool]  # from a job's validation file: the held-out split, never trained on
