"""Engines behind one contract (`protocol.Engine`); `--engine NAME` picks one."""

from __future__ import annotations

from .protocol import (
    Constraint,
    ConstraintError,
    Engine,
    EngineBusy,
    EngineDead,
    EngineEvent,
    EngineRequest,
    Mix,
    RequestTooLarge,
    SamplingParams,
)

ENGINES = ("hf", "vllm")  # vllm is imported only when chosen (bash setup.sh --engine vllm installs it)

__all__ = [
    "ENGINES",
    "Constraint",
    "ConstraintError",
    "Engine",
    "EngineBusy",
    "EngineDead",
    "EngineEvent",
    "EngineRequest",
    "Mix",
    "RequestTooLarge",
    "SamplingParams",
]
