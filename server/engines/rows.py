"""One request's row in the hf engine: its state, how its next token is chosen, and prefill buckets."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .detokenize import TextStream
from .protocol import EngineEvent, EngineRequest

Sink = Callable[[EngineEvent], None]


@dataclass
class Row:
    """One request in the engine: where its prompt and answer stand, and its mix with resident version keys."""

    req: EngineRequest
    sink: Sink
    text: TextStream
    gen: torch.Generator | None
    done_prompt: int = 0  # prompt tokens prefilled so far
    cache: DynamicCache | None = None  # while its prefill is chunked: its own cache (batch of 1)
    mix: tuple[tuple[str, float], ...] = ()  # the request's mix with each skill's resident version key
    out: int = 0  # completion tokens so far
    last: int = -1  # the newest token, the next decode step's input
    finished: bool = False

    @property
    def position(self) -> int:  # position id of `last`
        return len(self.req.prompt_ids) + self.out - 1


def sample(logits: torch.Tensor, rows: Sequence[Row]) -> list[int]:
    """The next token of each row: greedy, or sampled with the row's own temperature, top-p and generator."""
    out = logits.argmax(dim=-1)
    for i, s in enumerate(rows):
        p = s.req.params
        if p.temperature <= 0 or s.gen is None:
            continue
        probs = torch.softmax(logits[i] / p.temperature, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            keep = sorted_p.cumsum(0) - sorted_p < p.top_p  # always keeps the top token
            probs = torch.zeros_like(probs).scatter(0, order, sorted_p * keep)
        out[i] = torch.multinomial(probs, 1, generator=s.gen)[0]
    return [int(t) for t in out.tolist()]


def similar_lengths(group: list[Row], max_padding: float = 0.1) -> list[list[Row]]:
    """Prompts in buckets of similar length: a padded prefill computes every row to the longest prompt, and
    on a CPU prefill is compute-bound (a 44-token prompt beside a 442-token one would cost ten times over)."""
    buckets: list[list[Row]] = []
    for s in sorted(group, key=lambda s: len(s.req.prompt_ids)):
        if buckets:
            b = [*buckets[-1], s]
            total = sum(len(x.req.prompt_ids) for x in b)
            if len(s.req.prompt_ids) * len(b) - total <= max_padding * total:
                buckets[-1] = b
                continue
        buckets.append([s])
    return buckets
