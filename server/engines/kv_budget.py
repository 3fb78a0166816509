"""The hf engine's admission by KV memory: a request reserves its prompt + max_tokens, and waits while the rows
already holding KV leave no room for it.

The decode batch's cache is left-padded to its longest row (kv.py), with at most SPARE columns more (room on
the left and columns to grow into), and is copied whole when it grows: n rows at their peak cost
2 × n × (longest + SPARE) tokens. The prefix cache's tokens are taken off the budget first. A request that cannot fit even alone is
refused at submit (protocol.RequestTooLarge, a 400); one that does not fit now waits in the queue, in order.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..memory import MemoryPlanError, ModelShape, kv_bytes_per_token
from .kv import SPARE
from .protocol import EngineRequest

COPIES = 2  # the cache exists twice while it grows (the new buffers are filled from the old)
CUDA_SHARE = 0.8  # of the memory free after weights and the trainer's reserve: the rest is prefill's activations


class KVBudget:
    """Bytes the KV cache may take; None: no limit (CPU without --kv-cache-memory-bytes)."""

    def __init__(self, budget_bytes: int | None, bytes_per_token: int, prefix_tokens: int, max_context: int) -> None:
        self.bytes_per_token, self.max_context = bytes_per_token, max_context
        self.tokens: int | None = None  # row tokens the budget holds, counted as cost() counts them
        if budget_bytes is not None:
            rows = budget_bytes - prefix_tokens * bytes_per_token
            self.tokens = rows // bytes_per_token
            if self.cost([1]) > self.tokens:
                raise MemoryPlanError(
                    f"--kv-cache-memory-bytes {budget_bytes} holds {budget_bytes // bytes_per_token} tokens of KV "
                    f"({bytes_per_token} bytes each): not even the prefix cache's {prefix_tokens} and one short "
                    "request. Raise it or lower --prefix-cache-tokens"
                )

    @classmethod
    def for_model(
        cls,
        model: Any,
        dtype: torch.dtype,
        device: torch.device,
        budget_bytes: int | None,
        reserve_bytes: int,
        prefix_tokens: int,
        max_context: int,
    ) -> KVBudget:
        """The budget of a loaded model: `budget_bytes` if given, else on CUDA a share of the memory free now
        (after the weights) less `reserve_bytes` (the in-process trainer's estimate), else none."""
        per_token = kv_bytes_per_token(ModelShape.from_config(model.config), dtype.itemsize)
        if budget_bytes is None and device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget_bytes = int((free - reserve_bytes) * CUDA_SHARE)
            if budget_bytes <= 0:
                raise MemoryPlanError(
                    f"no GPU memory left for the KV cache: {free} bytes free after the weights, {reserve_bytes} "
                    "kept for the in-process trainer. Train elsewhere (--redis-url URL --no-trainer, and "
                    "`skillpool worker` on another GPU) or set --kv-cache-memory-bytes"
                )
        return cls(budget_bytes, per_token, prefix_tokens, max_context)

    def reservation(self, req: EngineRequest) -> int:
        """The tokens one row of a request may come to hold: its prompt and every token it may generate."""
        return min(len(req.prompt_ids) + req.params.max_tokens, self.max_context)

    def reservations(self, req: EngineRequest) -> list[int]:
        """A request's rows' reservations: one row per choice (n), each with its own copy of the prompt's KV."""
        return [self.reservation(req)] * req.params.n

    def cost(self, reservations: Iterable[int]) -> int:
        """Row tokens these rows take at their peak: every row padded to the longest, twice during a copy."""
        held = list(reservations)
        return COPIES * len(held) * (max(held) + SPARE) if held else 0

    @property
    def max_request(self) -> int | None:
        """The most tokens (prompt + max_tokens) a request alone can reserve; None: no limit."""
        return None if self.tokens is None else self.tokens // COPIES - SPARE

    def fits(self, reservations: Iterable[int]) -> bool:
        return self.tokens is None or self.cost(reservations) <= self.tokens

    def refusal(self, req: EngineRequest) -> str | None:
        """Why this request can never run here (None: it can, perhaps after waiting)."""
        need = self.reservations(req)
        if self.fits(need):
            return None
        n = f" for each of {len(need)} choices" if len(need) > 1 else ""
        return (
            f"the prompt ({len(req.prompt_ids)} tokens) and max_tokens ({req.params.max_tokens}) need {need[0]} tokens "
            f"of KV cache{n}; this server's KV budget holds at most {self.max_request} for one request "
            "(--kv-cache-memory-bytes): lower max_tokens or n, or shorten the messages"
        )
