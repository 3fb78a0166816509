"""One request's row in the hf engine: its state, how its next token is chosen, and prefill buckets."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch
from transformers import DynamicCache

from .detokenize import TextStream
from .grammar import Masks, RowGrammar
from .kv import KVBatch
from .logits import Pick, adjust, finite_rows, pick
from .prefix import PrefixCache
from .protocol import EngineEvent, EngineRequest, Mix, TokenLogprob

log = logging.getLogger(__name__)
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
    past: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # a cached prefix's KV, per layer
    past_len: int = 0  # its tokens: the prefill starts after them
    past_mix: Mix | None = None  # the mix the prefix was looked up for (None: not yet)
    mix: Mix = Mix.base()  # the request's mix with each skill's resident version key
    out: int = 0  # completion tokens so far
    last: int = -1  # the newest token, the next decode step's input
    finished: bool = False
    grammar: RowGrammar | None = None  # its output constraint's state: masks its logits, takes its tokens
    index: int = 0  # which of the request's n choices (the row of choice 0 prefills the prompt for all)
    answer: list[int] = field(default_factory=list)  # the tokens generated so far (the penalties count them)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # since the last event, to go with the next
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # to go with the first event, then None
    sent: bool = False  # whether an event went out

    def send(self, ev: EngineEvent) -> None:
        first = not self.sent
        self.sent = True
        ev = replace(ev, index=self.index, logprobs=tuple(self.logprobs))
        if first and self.prompt_logprobs is not None:
            ev = replace(ev, prompt_logprobs=self.prompt_logprobs)
        self.logprobs.clear()
        deliver(self.sink, ev, self.req.request_id)

    def choice(self, index: int, text: TextStream, gen: torch.Generator | None, grammar: RowGrammar | None) -> Row:
        """Choice `index` of this row's request once its prompt is prefilled: the same prompt, mix and place, its
        own text, generator, answer and output grammar's state."""
        return replace(
            self,
            text=text,
            gen=gen,
            grammar=grammar,
            index=index,
            answer=[],
            logprobs=[],
            prompt_logprobs=self.prompt_logprobs,
        )

    def look_up(self, resolve: Callable[[Mix], Mix], prefix: PrefixCache) -> None:
        """Find the longest cached prefix once, before admission (the step's token budget counts the rest)."""
        if self.past_mix is not None:
            return
        try:
            self.past_mix = resolve(self.req.mix)
        except KeyError:  # its admission will fail with this error
            self.past_mix = Mix.base()
            return
        if self.req.params.prompt_logprobs is None:  # the cache keeps no logits: such a prompt is computed whole
            self.past_len, self.past = prefix.lookup(self.past_mix, self.req.prompt_ids)

    def check_past(self) -> None:
        """After admission: a skill re-added since the lookup means the prefix was computed with its old version."""
        if self.past_len and self.past_mix != self.mix:
            self.past_len, self.past = 0, []

    @property
    def todo(self) -> int:  # prompt tokens its prefill still has to compute
        return len(self.req.prompt_ids) - max(self.done_prompt, self.past_len)

    @property
    def position(self) -> int:  # position id of `last`
        return len(self.req.prompt_ids) + self.out - 1


def deliver(sink: Sink, ev: EngineEvent, request_id: str) -> None:
    try:
        sink(ev)
    except Exception:  # a sink whose event loop is gone must not stop the engine
        log.warning("could not deliver an event of %s", request_id)


def sample(
    logits: torch.Tensor, rows: Sequence[Row], eos_ids: Iterable[int] = (), masks: Masks | None = None
) -> list[Pick | None]:
    """The next token of each row (logits.py): a constrained row's output grammar masks its logits first (`masks`,
    as vLLM applies its grammar bitmask before the sampler), then its sampling options apply, then greedy or drawn
    with its own generator, with its logprobs (of the raw logits) where it asks. None for a row whose logits are not
    finite, or whose grammar allows no token here: that row fails alone, its batch-mates go on."""
    params = [s.req.params for s in rows]
    finite = finite_rows(logits)
    grammars = [s.grammar for s in rows]
    masked = logits
    if masks is not None and any(g is not None for g in grammars):
        masked = masks.apply(logits.clone(), grammars)  # a copy: the logprobs are the raw logits'
        allows = torch.isfinite(masked.amax(dim=-1)).tolist()
        finite = [f and (g is None or a) for f, g, a in zip(finite, grammars, allows)]
    adjusted = adjust(masked, params, [s.answer for s in rows], [s.req.prompt_ids for s in rows], eos_ids)
    return pick(logits, adjusted, params, [s.gen for s in rows], finite)


def similar_lengths(group: list[Row], max_padding: float = 0.1) -> list[list[Row]]:
    """Prompts in buckets of similar length still to prefill: a padded prefill computes every row to the
    longest, and on a CPU prefill is compute-bound (a 44-token prompt beside a 442-token one would cost ten
    times over)."""
    buckets: list[list[Row]] = []
    alone = [[s] for s in group if s.req.params.prompt_logprobs is not None]  # logits at every position: alone
    for s in sorted((s for s in group if s.req.params.prompt_logprobs is None), key=lambda s: s.todo):
        if buckets:
            b = [*buckets[-1], s]
            total = sum(x.todo for x in b)
            if s.todo * len(b) - total <= max_padding * total:
                buckets[-1] = b
                continue
        buckets.append([s])
    return buckets + alone


def prefill_inputs(
    group: Sequence[Row], pad_id: int, device: torch.device, kv_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, KVBatch | None]:
    """One padded forward's inputs for the rows' prompts after their cached prefixes: the prefixes left-padded
    to the longest (the returned past KV; None when no row has one), then the rest of each prompt left-padded
    to the longest rest, with masked holes between. Returns ids, positions, the attention mask over past and
    new columns, and the past."""
    n, width = len(group), max(s.todo for s in group)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    new = torch.zeros((n, width), dtype=torch.long)
    pos = torch.zeros((n, width), dtype=torch.long)
    for i, s in enumerate(group):
        rest = s.req.prompt_ids[s.past_len :]
        ids[i, width - len(rest) :] = torch.tensor(list(rest))
        new[i, width - len(rest) :] = 1
        pos[i, width - len(rest) :] = torch.arange(s.past_len, len(s.req.prompt_ids))
    new = new.to(device)
    past = KVBatch.stack([s.past for s in group], width, kv_dtype) if any(s.past_len for s in group) else None
    mask = torch.cat([past.mask, new], dim=1) if past is not None else new
    return ids.to(device), pos.to(device), mask, past
