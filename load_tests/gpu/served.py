"""What a GPU check serves and how many requests it sends: a LLaMA shape with random weights and random LoRA skills
of one rank (tests.synthetic builds both). The acceptance run's and the cluster check's setups extend it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Served:
    shape: dict[str, int]  # LlamaConfig fields
    dtype: str
    skills: int
    rank: int
    requests: int
