"""The hf engine's prefill: waiting prompts into the decode batch within a step's token budget.

Whole prompts that fit go together, in padded forwards of prompts of similar length; a prompt longer than
what is left is prefilled in chunks over several steps, so a long prompt delays the others' next token by at
most one chunk. Prefill computes logits for the last position only. A prompt that starts with blocks some
earlier prompt had, under the same mix, reuses their KV and prefills only the rest (`prefix.py`).
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import torch
from transformers import DynamicCache

from skillpool.lora.bank import LoRABank

from .kv import KVBatch, growing_cache
from .kv_budget import KVBudget
from .logits import logprobs_of
from .prefix import PrefixCache
from .residency import SkillResidency
from .rows import Row, prefill_inputs, similar_lengths

log = logging.getLogger(__name__)


class Prefill:
    """Mixed into HFEngine (as vLLM mixes LoRA support into its model runner): the state it reads is the
    engine's, the methods it calls back are declared below."""

    _waiting: deque[Row]
    _running: list[Row]
    _stepping: list[Row]
    skills: SkillResidency
    prefix: PrefixCache
    bank: LoRABank
    model: Any
    cache_kw: str
    pad_id: int
    device: torch.device
    kv_dtype: torch.dtype
    max_num_seqs: int
    kv_budget: KVBudget

    def _admit(self, s: Row, reserved: frozenset[str] = frozenset()) -> bool | None:
        raise NotImplementedError

    def _admitted(self) -> None:
        raise NotImplementedError

    def _finish(
        self,
        s: Row,
        reason: str,
        text: str = "",
        error: str | None = None,
        not_found: bool = False,
        unavailable: bool = False,
    ) -> None:
        raise NotImplementedError

    def _join(self, group: list[Row], kv: KVBatch, logits: torch.Tensor) -> None:
        raise NotImplementedError

    def _kv_held(self) -> list[int]:
        """The KV reservations of the rows that hold KV: the decode batch, and a prompt part-way through prefill
        (for each of its choices)."""
        held = [self.kv_budget.reservation(s.req) for s in self._running]
        return held + [r for s in self._waiting if s.done_prompt for r in self.kv_budget.reservations(s.req)]

    def _kv_fits(self, rows: list[Row]) -> bool:
        """Whether these rows can start now beside the rows holding KV (else they wait for rows to finish)."""
        return self.kv_budget.fits([*self._kv_held(), *(r for s in rows for r in self.kv_budget.reservations(s.req))])

    def _prefill(self, budget: int) -> None:
        head = self._waiting[0]
        self._stepping.append(head)  # a step that raises fails it: a prompt that breaks prefill cannot loop
        head.look_up(self.skills.resolve, self.prefix)
        if head.done_prompt == 0 and head.todo <= budget:
            group: list[Row] = []
            used = 0
            room, rows = self.max_num_seqs - len(self._running), 0  # rows: a request of n choices becomes n
            while self._waiting:
                s = self._waiting[0]
                n = s.req.params.n
                if rows + n > room and (rows or self._running):  # alone, n choices may exceed the batch size
                    break
                s.look_up(self.skills.resolve, self.prefix)
                if s.done_prompt or used + s.todo > budget or not self._kv_fits([*group, s]):
                    break
                self._stepping.append(s)
                ok = self._admit(s, frozenset(k for g in group for k, _ in g.mix))
                if ok is None:  # waits for running rows to free a skill slot
                    break
                self._waiting.popleft()
                self._admitted()
                if ok:
                    s.check_past()
                    group.append(s)
                    used += s.todo
                    rows += n
            for bucket in similar_lengths(group):
                self._prefill_whole(bucket)
            return
        if head.done_prompt == 0:  # a chunked prompt is admitted on its first chunk
            if not self._kv_fits([head]):
                return
            ok = self._admit(head)
            if ok is None:
                return
            if not ok:
                self._waiting.popleft()
                self._admitted()
                return
            head.check_past()
            if head.past_len:
                head.cache, head.done_prompt = growing_cache(head.past, budget, self.kv_dtype), head.past_len
        self._prefill_chunk(head, budget)

    def _prefill_whole(self, group: list[Row]) -> None:
        """One padded forward over the rows' prompts after their cached prefixes: the prefixes left-padded to
        the longest, then the rest of each prompt left-padded to the longest rest (masked holes between)."""
        ids, pos, mask, past = prefill_inputs(group, self.pad_id, self.device, self.kv_dtype)
        cache = past.cache if past is not None else DynamicCache()
        every = any(s.req.params.prompt_logprobs is not None for s in group)  # such a row is a bucket of its own
        try:
            with self.bank.mixed([s.mix.ranked for s in group], tokens=ids.shape[1]):
                out = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=pos,
                    **{self.cache_kw: cache},
                    use_cache=True,
                    logits_to_keep=0 if every else 1,
                )
        except Exception as e:
            log.exception("prefill failed")
            for s in group:
                self._finish(s, "error", error=f"prefill failed: {e}")
            return
        kv = KVBatch(cache, mask, self.kv_dtype)
        width = ids.shape[1]
        for i, s in enumerate(group):
            if s.req.params.prompt_logprobs is not None:  # its prompt fills the last columns (no cached prefix)
                self._prompt_logprobs(s, out.logits[i, width - len(s.req.prompt_ids) :], 0)
            s.done_prompt, s.past = len(s.req.prompt_ids), []
            if self.prefix.would_keep(len(s.req.prompt_ids), s.past_len):
                self.prefix.insert(s.mix, s.req.prompt_ids, kv.row(i))
        self._join(group, kv, out.logits[:, -1, :])

    @staticmethod
    def _prompt_logprobs(s: Row, logits: torch.Tensor, start: int) -> None:
        """Add the logprobs of the prompt tokens that `logits` (a row's, from prompt position `start` on) predict:
        position j predicts token j + 1. A prompt's logprobs are never taken from the prefix cache, which keeps
        no logits (vLLM's rule too), so the row prefilled its whole prompt."""
        p, k = s.req.prompt_ids, s.req.params.prompt_logprobs or 0
        count = min(logits.shape[0], len(p) - 1 - start)
        if count > 0:
            new = logprobs_of(logits[:count], p[start + 1 : start + 1 + count], [k] * count)
            s.prompt_logprobs = (*(s.prompt_logprobs or ()), *new)
        elif s.prompt_logprobs is None:
            s.prompt_logprobs = ()

    def _prefill_chunk(self, s: Row, budget: int) -> None:
        p = s.req.prompt_ids
        start, end = s.done_prompt, min(len(p), s.done_prompt + budget)
        s.cache = s.cache if s.cache is not None else DynamicCache()
        ids = torch.tensor([list(p[start:end])], dtype=torch.long, device=self.device)
        every = s.req.params.prompt_logprobs is not None
        try:
            with self.bank.mixed([s.mix.ranked], tokens=end - start):
                out = self.model(
                    input_ids=ids,
                    attention_mask=torch.ones((1, end), dtype=torch.long, device=self.device),
                    position_ids=torch.arange(start, end, device=self.device)[None],
                    **{self.cache_kw: s.cache},
                    use_cache=True,
                    logits_to_keep=0 if every else 1,
                )
        except Exception as e:
            log.exception("prefill failed")
            self._waiting.popleft()
            self._admitted()
            self._finish(s, "error", error=f"prefill failed: {e}")
            return
        s.done_prompt = end
        if every:
            self._prompt_logprobs(s, out.logits[0], start)
        if end < len(p):
            return
        self._waiting.popleft()
        self._admitted()
        cache, s.cache, s.past = s.cache, None, []
        kv = KVBatch(cache, torch.ones((1, end), dtype=torch.long, device=self.device), self.kv_dtype)
        if self.prefix.would_keep(len(p), s.past_len):
            self.prefix.insert(s.mix, p, kv.row(0))
        self._join([s], kv, out.logits[:, -1, :])
