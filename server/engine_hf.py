"""The embedded `hf` engine: transformers + our batched mixed-LoRA layers, own decode loop.

One batch = one prefill over left-padded prompts and a shared KV cache; every row carries its
own LoRA mix (set once for the whole batch, reused for every generated token), its own sampling
parameters, stop strings and token budget. Rows that finish early are masked out of sampling and
their tokens are ignored; the batch ends when every row has finished.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from skillpool.adapters_store.lora import LoRAAdapter, LoRABank, Mix

log = logging.getLogger(__name__)


@dataclass
class GenEvent:
    text: str = ""  # new text since the previous event
    tokens: int = 0  # completion tokens so far
    finish_reason: str | None = None  # stop | length | cancelled (set on the last event)


@dataclass
class GenRequest:
    prompt_ids: list[int]
    mix: Mix
    max_tokens: int
    on_event: Callable[[GenEvent], None]
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()
    cancelled: threading.Event = field(default_factory=threading.Event)


def _stop_holdback(text: str, stops: Sequence[str]) -> int:
    """How many trailing chars might be the start of a stop string (not yet safe to emit)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                hold = max(hold, k)
                break
    return hold


class _Row:
    def __init__(self, req: GenRequest, tokenizer: Any, device: torch.device) -> None:
        self.req = req
        self.tok = tokenizer
        self.ids: list[int] = []
        self.emitted = 0  # chars of decoded text already sent
        self.done = False
        self.gen: torch.Generator | None = None
        if req.temperature > 0:
            self.gen = torch.Generator(device=device)
            if req.seed is not None:
                self.gen.manual_seed(req.seed)
            else:
                self.gen.seed()

    def push(self, token: int, eos_ids: set[int]) -> None:
        """Record one sampled token; emit new text or finish the row."""
        if self.req.cancelled.is_set():
            self._emit("", finish="cancelled")
            return
        if token in eos_ids:
            # flush anything held back for stop-string matching
            self._emit(self.tok.decode(self.ids, skip_special_tokens=True), finish="stop")
            return
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        for s in self.req.stop:
            at = text.find(s, max(0, self.emitted - len(s)))
            if at != -1:
                self._emit(text[:at], finish="stop")
                return
        if len(self.ids) >= self.req.max_tokens:
            self._emit(text, finish="length")
            return
        if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return
        self._emit(text[: len(text) - _stop_holdback(text, self.req.stop)])

    def finish_length(self) -> None:
        self._emit(self.tok.decode(self.ids, skip_special_tokens=True), finish="length")

    def _emit(self, text: str, finish: str | None = None) -> None:
        delta = text[self.emitted :] if len(text) > self.emitted else ""
        self.emitted = max(self.emitted, len(text))
        if finish is not None:
            self.done = True
        if delta or finish is not None:
            self.req.on_event(GenEvent(text=delta, tokens=len(self.ids), finish_reason=finish))


class HFEngine:
    """Loads a base model once and generates batches of requests with per-row LoRA mixes."""

    name = "hf"

    def __init__(self, model_path: str | Path, device: str | None = None, dtype: torch.dtype | None = None) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype).to(self.device).eval()
        self.bank = LoRABank(self.model)
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 2048))
        eos = self.tokenizer.eos_token_id
        cfg_eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        ids = {eos} | (set(cfg_eos) if isinstance(cfg_eos, list) else {cfg_eos})
        self.eos_ids = {i for i in ids if i is not None}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        self._lock = threading.Lock()  # one batch at a time; adapters change between batches

    # --- adapters -----------------------------------------------------------------------------
    def add_adapter(self, name: str, adapter: LoRAAdapter) -> None:
        with self._lock:
            self.bank.add(name, adapter)

    def remove_adapter(self, name: str) -> None:
        with self._lock:
            self.bank.remove(name)

    # --- prompts ------------------------------------------------------------------------------
    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # --- generation ---------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, reqs: Sequence[GenRequest]) -> None:
        """Run one batch to completion, delivering text through each request's `on_event`."""
        if not reqs:
            return
        with self._lock, self.bank.mixed([r.mix for r in reqs]):
            self._decode(reqs)

    def _decode(self, reqs: Sequence[GenRequest]) -> None:
        width = max(len(r.prompt_ids) for r in reqs)
        n = len(reqs)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        rows = [_Row(r, self.tokenizer, self.device) for r in reqs]
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1, :]
        next_pos = pos[:, -1:] + 1
        steps = max(r.max_tokens for r in reqs)
        for _ in range(steps):
            tokens = self._sample(logits.float(), rows)
            for row, t in zip(rows, tokens.tolist()):
                if not row.done:
                    row.push(t, self.eos_ids)
            if all(r.done for r in rows):
                break
            mask = torch.cat([mask, torch.ones((n, 1), dtype=mask.dtype, device=self.device)], dim=1)
            out = self.model(
                input_ids=tokens[:, None],
                attention_mask=mask,
                position_ids=next_pos,
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1
        for row in rows:  # budget exhausted at the last step
            if not row.done:
                row.finish_length()

    def _sample(self, logits: torch.Tensor, rows: Sequence[_Row]) -> torch.Tensor:
        out = logits.argmax(dim=-1)
        for i, row in enumerate(rows):
            if row.done or row.req.temperature <= 0:
                continue
            probs = torch.softmax(logits[i] / row.req.temperature, dim=-1)
            if row.req.top_p < 1.0:
                sorted_p, order = probs.sort(descending=True)
                keep = sorted_p.cumsum(0) - sorted_p < row.req.top_p  # always keeps the top token
                sorted_p = sorted_p * keep
                probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
            out[i] = torch.multinomial(probs, 1, generator=row.gen)[0]
        return out
