"""The embedded `hf` engine: transformers + our per-row LoRA mixes, with continuous batching.

One engine thread runs iterations. Each iteration (vLLM's scheduler, simplified):
  1. applies what other threads asked for since the last one: new requests, aborts, skills added or
     removed (so skills change between steps without draining the batch);
  2. decodes one token for every running row (one batched forward over a shared, left-padded KV cache);
  3. prefills waiting requests within a per-step token budget (`max_batched_tokens` minus the decode
     rows): whole prompts that fit go together, in padded forwards of prompts of similar length; a prompt
     longer than what is left
     is prefilled in chunks over several iterations, so a long prompt delays the others' next token by at
     most one chunk. Prefill computes logits for the last position only. A row whose prefill completes
     samples its first token at once and joins the decode batch (its KV cache is merged in).
Rows leave the batch the moment they finish, are aborted or hit a stop string; each row has its own mix,
sampling parameters, stop strings and budget. Only the `max_loaded_skills` most recently used skills are
resident; others are read from the store on first use (S-LoRA's idea, from disk rather than host memory).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from skillpool.adapters_store.lora import LoRABank

from .detokenize import TextStream
from .kv import KVBatch
from .protocol import AdapterLoader, EngineBusy, EngineEvent, EngineRequest

log = logging.getLogger(__name__)

Sink = Callable[[EngineEvent], None]


@dataclass
class _Seq:
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


@dataclass
class _Control:
    kind: str  # submit | abort | add | remove | stop
    args: tuple[Any, ...] = field(default_factory=tuple)


class HFEngine:
    """Loads a base model once and serves requests with continuous batching and per-row LoRA mixes."""

    name = "hf"

    def __init__(
        self,
        model_path: str | Path,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        max_num_seqs: int = 32,
        max_batched_tokens: int = 512,
        max_waiting: int = 256,
        max_loaded_skills: int | None = None,
        on_step: Callable[[int], None] | None = None,
    ) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]  # transformers' stubs type .to oddly
        self.bank = LoRABank(self.model)
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 2048))
        eos = self.tokenizer.eos_token_id
        cfg_eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        ids = {eos} | (set(cfg_eos) if isinstance(cfg_eos, list) else {cfg_eos})
        self.eos_ids = {i for i in ids if i is not None}
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos
        if max_batched_tokens < max_num_seqs + 1:
            raise ValueError("max_batched_tokens must exceed max_num_seqs (each decode row takes one token a step)")
        self.max_num_seqs, self.max_batched_tokens, self.max_waiting = max_num_seqs, max_batched_tokens, max_waiting
        self.max_loaded_skills = max_loaded_skills
        self.on_step = on_step  # observes the rows of every decode step (the batch-size metric)
        self._inbox: queue.SimpleQueue[_Control] = queue.SimpleQueue()
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []  # the decode batch, in KV row order
        self._kv: KVBatch | None = None
        # A skill's weights are kept under a version key (name#n): a request admitted before the skill was
        # replaced keeps the weights it started with while new requests get the new version.
        self._current: dict[str, str] = {}  # skill name -> its version key
        self._loaders: dict[str, AdapterLoader] = {}  # version key -> reads the weights
        self._generation = 0
        self._lru: OrderedDict[str, None] = OrderedDict()  # resident version keys, least recently used first
        self._pending = 0  # submitted and not yet admitted to the batch (for backpressure)
        self._pending_lock = threading.Lock()
        self._alive = True
        self.steps = 0  # decode steps run (for tests and stats)
        self._aborted = 0  # requests that ended by abort (a client went away)
        self._thread = threading.Thread(target=self._loop, name="skillpool-engine-hf", daemon=True)
        self._thread.start()

    # --- the contract ---------------------------------------------------------------------------
    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def submit(self, req: EngineRequest, sink: Sink) -> None:
        """Queue a request; `sink` receives its events on the engine thread. Raises EngineBusy when full."""
        with self._pending_lock:
            if self._pending >= self.max_waiting:
                raise EngineBusy(self._pending)
            self._pending += 1
        self._inbox.put(_Control("submit", (req, sink)))

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineEvent]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[EngineEvent] = asyncio.Queue()

        def sink(ev: EngineEvent) -> None:
            loop.call_soon_threadsafe(events.put_nowait, ev)

        self.submit(request, sink)
        finished = False
        try:
            while True:
                ev = await events.get()
                finished = ev.finish_reason is not None
                yield ev
                if finished:
                    return
        finally:
            if not finished:  # the consumer went away (client disconnected): free the slot
                self.abort(request.request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Control("abort", (request_id,)))

    def add_skill(self, name: str, load: AdapterLoader) -> None:
        self._inbox.put(_Control("add", (name, load)))

    def remove_skill(self, name: str) -> None:
        self._inbox.put(_Control("remove", (name,)))

    def healthy(self) -> bool:
        return self._alive and self._thread.is_alive()

    def stats(self) -> dict[str, int]:
        return {
            "running": len(self._running),
            "waiting": self._pending,
            "resident_skills": len(self.bank),
            "known_skills": len(self._current),
            "aborted": self._aborted,
        }

    def close(self) -> None:
        self._inbox.put(_Control("stop"))
        self._thread.join(timeout=10)

    # --- the engine thread ----------------------------------------------------------------------
    @torch.inference_mode()  # everything the thread touches (KV, adapter stacks) stays an inference tensor
    def _loop(self) -> None:
        try:
            while True:
                idle = not self._running and not self._waiting
                if not self._apply(self._inbox.get() if idle else None):
                    return
                if not self._apply_all():
                    return
                self._step()
        except Exception:  # never leave clients hanging on a dead thread
            log.exception("engine thread died")
            self._alive = False
            for s in [*self._running, *self._waiting]:
                self._finish(s, "error", error="the engine stopped")
            raise

    def _apply_all(self) -> bool:
        while True:
            try:
                c = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if not self._apply(c):
                return False

    def _apply(self, c: _Control | None) -> bool:
        if c is None:
            return True
        if c.kind == "stop":
            for s in [*self._running, *self._waiting]:
                self._finish(s, "abort")
            return False
        if c.kind == "submit":
            req, sink = c.args
            self._waiting.append(_Seq(req, sink, TextStream(self.tokenizer, req.params.stop), None))
        elif c.kind == "abort":
            (rid,) = c.args
            for s in [*self._running, *self._waiting]:
                if s.req.request_id == rid and not s.finished:
                    self._finish(s, "abort")
            self._drop_finished()
        elif c.kind == "add":
            name, load = c.args
            self._generation += 1
            old, self._current[name] = self._current.get(name), f"{name}#{self._generation}"
            self._loaders[self._current[name]] = load
            self._retire(old)
        elif c.kind == "remove":
            (name,) = c.args
            self._retire(self._current.pop(name, None))
        return True

    def _in_use(self) -> set[str]:
        rows = [*self._running, *(s for s in self._waiting if s.done_prompt)]
        return {k for s in rows for k, _ in s.mix}

    def _retire(self, key: str | None) -> None:
        """An old version: dropped now if no running row uses it, else by LRU once they finish."""
        if key is None:
            return
        self._loaders.pop(key, None)
        if key in self.bank and key not in self._in_use():
            self._evict(key)

    def _step(self) -> None:
        if self._running:
            self._decode()
        budget = self.max_batched_tokens - len(self._running)
        if self._waiting and len(self._running) < self.max_num_seqs and budget > 0:
            self._prefill(budget)

    # --- admission, skills ----------------------------------------------------------------------
    def _admit(self, s: _Seq, reserved: frozenset[str] = frozenset()) -> bool | None:
        """Make the row's skills resident and its sampler ready. False (and an error event): it cannot run;
        None: it must wait, every resident slot being in use by running rows."""
        try:
            mix = []
            for name, w in s.req.mix:
                key = self._current.get(name)
                if key is None:
                    raise KeyError(f"skill {name!r} is not served by this engine (retired or never added)")
                mix.append((key, w))
            s.mix = tuple(mix)
            needed = [k for k, w in s.mix if w != 0.0]
            if self.max_loaded_skills is not None and len(needed) > self.max_loaded_skills:
                raise ValueError(
                    f"the mix needs {len(needed)} skills, more than max_loaded_skills ({self.max_loaded_skills})"
                )
            keep = self._in_use() | reserved | set(needed)  # reserved: skills of rows admitted with this one
            for key in needed:
                if not self._ensure_resident(key, keep):
                    return None
            p = s.req.params
            if p.temperature > 0:
                s.gen = torch.Generator(device=self.device)
                if p.seed is not None:
                    s.gen.manual_seed(p.seed % 2**64)
                else:
                    s.gen.seed()
        except Exception as e:  # this request alone fails (a skill retired since routing, a broken adapter)
            self._finish(s, "error", error=str(e))
            return False
        return True

    def _ensure_resident(self, key: str, keep: set[str]) -> bool:
        """False: no slot can be freed now (all resident skills are in use)."""
        if key in self.bank:
            self._lru.move_to_end(key)
            return True
        load = self._loaders[key]
        cap = self.max_loaded_skills
        if cap is not None:
            victims = [n for n in self._lru if n not in keep]
            while len(self.bank) >= cap and victims:
                self._evict(victims.pop(0))
            if len(self.bank) >= cap:
                return False
        self.bank.add(key, load())
        self._lru[key] = None
        return True

    def _evict(self, name: str) -> None:
        self.bank.remove(name)
        self._lru.pop(name, None)

    # --- prefill and decode ---------------------------------------------------------------------
    def _prefill(self, budget: int) -> None:
        head = self._waiting[0]
        if head.done_prompt == 0 and len(head.req.prompt_ids) <= budget:
            group: list[_Seq] = []
            used = 0
            room = self.max_num_seqs - len(self._running)
            while self._waiting and len(group) < room:
                s = self._waiting[0]
                n = len(s.req.prompt_ids)
                if s.done_prompt or used + n > budget:
                    break
                ok = self._admit(s, frozenset(k for g in group for k, _ in g.mix))
                if ok is None:  # waits for running rows to free a skill slot
                    break
                self._waiting.popleft()
                self._admitted()
                if ok:
                    group.append(s)
                    used += n
            for bucket in _similar_lengths(group):
                self._prefill_whole(bucket)
            return
        if head.done_prompt == 0:  # a chunked prompt is admitted on its first chunk
            ok = self._admit(head)
            if ok is None:
                return
            if not ok:
                self._waiting.popleft()
                self._admitted()
                return
        self._prefill_chunk(head, budget)

    def _prefill_whole(self, group: list[_Seq]) -> None:
        n, width = len(group), max(len(s.req.prompt_ids) for s in group)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, s in enumerate(group):
            p = s.req.prompt_ids
            ids[i, width - len(p) :] = torch.tensor(list(p))
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        try:
            with self.bank.mixed([s.mix for s in group]):
                out = self.model(
                    input_ids=ids,
                    attention_mask=mask,
                    position_ids=pos,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
        except Exception as e:
            log.exception("prefill failed")
            for s in group:
                self._finish(s, "error", error=f"prefill failed: {e}")
            return
        for s in group:
            s.done_prompt = len(s.req.prompt_ids)
        self._join(group, KVBatch.from_cache(cache, mask), out.logits[:, -1, :])

    def _prefill_chunk(self, s: _Seq, budget: int) -> None:
        p = s.req.prompt_ids
        start, end = s.done_prompt, min(len(p), s.done_prompt + budget)
        s.cache = s.cache if s.cache is not None else DynamicCache()
        ids = torch.tensor([list(p[start:end])], dtype=torch.long, device=self.device)
        try:
            with self.bank.mixed([s.mix]):
                out = self.model(
                    input_ids=ids,
                    attention_mask=torch.ones((1, end), dtype=torch.long, device=self.device),
                    position_ids=torch.arange(start, end, device=self.device)[None],
                    past_key_values=s.cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
        except Exception as e:
            log.exception("prefill failed")
            self._waiting.popleft()
            self._admitted()
            self._finish(s, "error", error=f"prefill failed: {e}")
            return
        s.done_prompt = end
        if end < len(p):
            return
        self._waiting.popleft()
        self._admitted()
        cache, s.cache = s.cache, None
        self._join(
            [s],
            KVBatch.from_cache(cache, torch.ones((1, end), dtype=torch.long, device=self.device)),
            out.logits[:, -1, :],
        )

    def _join(self, group: list[_Seq], kv: KVBatch, logits: torch.Tensor) -> None:
        """Sample each new row's first token; rows that go on join the decode batch."""
        tokens = self._sample(logits.float(), group)
        keep = [i for i, (s, t) in enumerate(zip(group, tokens)) if self._push(s, t)]
        if not keep:
            return
        kv = kv.select(keep)
        self._kv = kv if self._kv is None else self._kv.merge(kv)
        self._running.extend(group[i] for i in keep)

    def _decode(self) -> None:
        assert self._kv is not None
        rows = self._running
        ids = torch.tensor([[s.last] for s in rows], dtype=torch.long, device=self.device)
        pos = torch.tensor([[s.position] for s in rows], dtype=torch.long, device=self.device)
        cache, mask = self._kv.step_inputs()
        try:
            with self.bank.mixed([s.mix for s in rows]):
                out = self.model(
                    input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True
                )
        except Exception as e:
            log.exception("decode step failed")
            for s in rows:
                self._finish(s, "error", error=f"decode failed: {e}")
            self._drop_finished()
            return
        self._kv.stepped(mask)
        self.steps += 1
        if self.on_step is not None:
            self.on_step(len(rows))
        for s, t in zip(rows, self._sample(out.logits[:, -1, :].float(), rows)):
            if not s.finished:
                self._push(s, t)
        self._drop_finished()

    def _drop_finished(self) -> None:
        keep = [i for i, s in enumerate(self._running) if not s.finished]
        if len(keep) != len(self._running):
            self._running = [self._running[i] for i in keep]
            self._kv = self._kv.select(keep) if keep and self._kv is not None else None
            retired = [k for k in self._lru if k not in self._loaders]  # replaced/removed versions still resident
            if retired:
                in_use = self._in_use()
                for k in retired:
                    if k not in in_use:
                        self._evict(k)
        if any(s.finished for s in self._waiting):
            for s in [s for s in self._waiting if s.finished]:
                self._waiting.remove(s)
                self._admitted()

    def _admitted(self) -> None:
        with self._pending_lock:
            self._pending -= 1

    def _sample(self, logits: torch.Tensor, rows: Sequence[_Seq]) -> list[int]:
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

    # --- events -----------------------------------------------------------------------------------
    def _push(self, s: _Seq, token: int) -> bool:
        """Record one sampled token and emit its text; False when the row is finished."""
        if token in self.eos_ids and not s.req.params.ignore_eos:
            self._finish(s, "stop", text=s.text.finish())
            return False
        s.out += 1
        s.last = token
        delta, stopped = s.text.push(token)
        if stopped:
            self._finish(s, "stop", text=delta)
            return False
        if s.out >= s.req.params.max_tokens or s.position + 1 >= self.max_context:
            self._finish(s, "length", text=delta + s.text.finish())
            return False
        if delta:
            self._send(s, EngineEvent(text=delta, tokens=s.out))
        return True

    def _finish(self, s: _Seq, reason: str, text: str = "", error: str | None = None) -> None:
        if s.finished:
            return
        s.finished = True
        self._aborted += reason == "abort"
        self._send(s, EngineEvent(text=text, tokens=s.out, finish_reason=reason, error=error))

    @staticmethod
    def _send(s: _Seq, ev: EngineEvent) -> None:
        try:
            s.sink(ev)
        except Exception:  # a sink whose event loop is gone must not stop the engine
            log.warning("could not deliver an event of %s", s.req.request_id)


def _similar_lengths(group: list[_Seq], max_padding: float = 0.1) -> list[list[_Seq]]:
    """Prompts in buckets of similar length: a padded prefill computes every row to the longest prompt, and
    on a CPU prefill is compute-bound (a 44-token prompt beside a 442-token one would cost ten times over)."""
    buckets: list[list[_Seq]] = []
    for s in sorted(group, key=lambda s: len(s.req.prompt_ids)):
        if buckets:
            b = [*buckets[-1], s]
            total = sum(len(x.req.prompt_ids) for x in b)
            if len(s.req.prompt_ids) * len(b) - total <= max_padding * total:
                buckets[-1] = b
                continue
        buckets.append([s])
    return buckets
