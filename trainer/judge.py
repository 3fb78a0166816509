"""How the quality gate gets answers: greedy generation under per-row skill mixes.

A server's trainer judges a new skill with the serving engine itself (`skillpool.server.judge`), so a
skill is scored by the same code that will serve it; a Redis worker, which has no serving engine, uses
`LocalJudge`: its own model copy with the same per-row mix math (lora.bank) and transformers'
greedy decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from skillpool.lora.adapter import LoRAAdapter
from skillpool.lora.bank import LoRABank
from skillpool.lora.mix import Mix

from .scoring import generate_greedy

Prompt = list[dict[str, str]]


class Judge(Protocol):
    def candidate(self, name: str, load: Callable[[], LoRAAdapter]) -> str:
        """Make the new, not yet registered block usable; returns the key to put in mixes."""
        ...

    def registered(self, name: str, load: Callable[[], LoRAAdapter]) -> str:
        """The key of an already registered skill (loaded here if this judge does not serve it yet)."""
        ...

    def remove(self, key: str) -> None: ...

    def generate(self, prompts: Sequence[Prompt], mixes: Sequence[Mix], max_tokens: int) -> list[str]:
        """Greedy answers, row i under mix `mixes[i]` (empty: the base model)."""
        ...


class LocalJudge:
    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer, self.bank = model, tokenizer, LoRABank(model)

    def candidate(self, name: str, load: Callable[[], LoRAAdapter]) -> str:
        self.bank.add(name, load())
        return name

    def registered(self, name: str, load: Callable[[], LoRAAdapter]) -> str:
        if name not in self.bank:
            self.bank.add(name, load())
        return name

    def remove(self, key: str) -> None:
        self.bank.remove(key)

    def generate(self, prompts: Sequence[Prompt], mixes: Sequence[Mix], max_tokens: int) -> list[str]:
        return generate_greedy(self.model, self.tokenizer, prompts, max_tokens, bank=self.bank, mixes=mixes)
