"""The embedded `hf` engine: transformers + our per-row LoRA mixes, with continuous batching.

One engine thread runs iterations. Each iteration (vLLM's scheduler, simplified):
  1. applies what other threads asked for since the last one: new requests, aborts, skills added or
     removed (so skills change between steps without draining the batch);
  2. prefills waiting requests within a per-step token budget (`max_batched_tokens` minus the decode
     rows; prefill.py): a row whose prefill completes samples its first token at once and joins the decode
     batch (its KV cache is merged in);
  3. decodes one token for every running row (one batched forward over a shared, left-padded KV cache).
A step that raises fails its rows, not the loop; a loop that ends anyway fails every queued request at once
and refuses new ones (EngineDead), so liveness turns red instead of clients hanging.
Rows leave the batch the moment they finish, are aborted or hit a stop string; each row has its own mix,
sampling parameters, stop strings and budget. Only the `max_loaded_skills` most recently used skills are
resident; others are read from the store on first use (S-LoRA's idea, from disk rather than host memory).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from skillpool.adapters_store.objects import StoreUnavailable
from skillpool.lora.bank import LoRABank
from skillpool.runtime.base_model import resolve_device
from skillpool.runtime.openmp import as_compute_thread

from .chat_template import ChatFront
from .detokenize import TextStream
from .grammar import Masks, RowGrammar
from .host_adapters import HostAdapters
from .kv import KVBatch, cache_keyword, kv_dtype
from .kv_budget import KVBudget
from .logits import Pick
from .packed import pack_linears
from .prefill import Prefill
from .prefix import PrefixCache
from .priority import lower_priority
from .protocol import (
    AdapterLoader,
    EngineBusy,
    EngineDead,
    EngineEvent,
    EngineRequest,
    RequestTooLarge,
    SamplingParams,
    StreamsEvents,
)
from .residency import SkillResidency
from .rows import Row, Sink, deliver, sample

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # the longest an idle loop waits for work: its last-step age stays below this while it lives


@dataclass
class _Control:
    kind: str  # submit | abort | add | remove | wake | stop
    args: tuple[Any, ...] = field(default_factory=tuple)


class HFEngine(Prefill, StreamsEvents, ChatFront):
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
        prefix_cache_tokens: int = 4096,
        on_step: Callable[[int], None] | None = None,
        kv_cache_memory_bytes: int | None = None,
        kv_reserve_bytes: int = 0,
        nice: int = 0,
    ) -> None:
        """`nice`: added to the engine thread's nice value on a CPU (its torch threads inherit it).
        `kv_cache_memory_bytes`: the KV budget requests are admitted by (kv_budget.py; None: on CUDA a share of
        the memory free after the weights less `kv_reserve_bytes`, kept for a trainer; on CPU no limit)."""
        self.device = torch.device(resolve_device(device))
        dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=dtype)
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]  # transformers' stubs type .to oddly
        self.bank = LoRABank(self.model, torch.float32 if self.device.type == "cpu" else None)
        self.kv_dtype = kv_dtype(self.model)
        pack_linears(self.model)  # bfloat16 on a CPU: weights in oneDNN's layout once, not on every product
        self.cache_kw = cache_keyword(self.model)
        self.max_context = int(getattr(self.model.config, "max_position_embeddings", 2048))
        eos = tokenizer.eos_token_id
        cfg_eos = self.model.generation_config.eos_token_id if self.model.generation_config else None
        ids = {eos} | (set(cfg_eos) if isinstance(cfg_eos, list) else {cfg_eos})
        self.eos_ids = {i for i in ids if i is not None}
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        # the chat template, and output constraints compiled off the loop (ChatFront.prepare)
        self._front(tokenizer, int(self.model.get_output_embeddings().weight.shape[0]))
        self.masks = Masks(self.grammars.vocab_size, torch.get_num_threads())
        if max_batched_tokens < max_num_seqs + 1:
            raise ValueError("max_batched_tokens must exceed max_num_seqs (each decode row takes one token a step)")
        if prefix_cache_tokens < 0:
            raise ValueError("prefix_cache_tokens must be >= 0 (0 turns prefix caching off)")
        self.max_num_seqs, self.max_batched_tokens, self.max_waiting = max_num_seqs, max_batched_tokens, max_waiting
        self.on_step = on_step  # observes the rows of every decode step (the batch-size metric)
        self._inbox: queue.SimpleQueue[_Control] = queue.SimpleQueue()
        self._waiting: deque[Row] = deque()
        self._running: list[Row] = []  # the decode batch, in KV row order
        self._kv: KVBatch | None = None
        # skills' adapters read off the loop; host copies as many as may be resident (16 when unbounded)
        self.host_adapters = HostAdapters(max_loaded_skills or 16, lambda: self._inbox.put(_Control("wake")))
        self.skills = SkillResidency(self.bank, max_loaded_skills, self.host_adapters)
        self.prefix = PrefixCache(prefix_cache_tokens)
        self.kv_budget = KVBudget.for_model(
            self.model,
            self.kv_dtype,
            self.device,
            kv_cache_memory_bytes,
            kv_reserve_bytes,
            prefix_cache_tokens,
            self.max_context,
        )
        if self.kv_budget.max_request is not None:  # what one request can hold is this server's context length
            self.max_context = min(self.max_context, self.kv_budget.max_request)
        self._pending = 0  # submitted and not yet admitted to the batch (for backpressure)
        self._pending_lock = threading.Lock()
        self._alive = True
        self._beat = time.monotonic()  # when the loop last began an iteration
        self._stepping: list[Row] = []  # the rows the current step touched (they fail if it raises)
        self._held = False  # the last step's admission waited (a skill slot, or a skill's read)
        self._aborted = 0  # requests that ended by abort (a client went away)
        self.nice = nice if self.device.type == "cpu" else 0
        self._thread = threading.Thread(target=self._loop, name="skillpool-engine-hf", daemon=True)
        self._thread.start()

    # --- the contract ---------------------------------------------------------------------------
    def submit(self, req: EngineRequest, sink: Sink) -> None:
        """Queue a request; `sink` receives its events on the engine thread. Raises EngineBusy when full, and
        EngineDead once the loop has stopped (under the lock: a request is never queued to a dead loop)."""
        with self._pending_lock:
            if not self._alive:
                raise EngineDead(self.name)
            if self._pending >= self.max_waiting:
                raise EngineBusy(self._pending)
            if (why := self.kv_budget.refusal(req)) is not None:  # waiting would never make room for it
                raise RequestTooLarge(why)
            self._pending += 1
            self._inbox.put(_Control("submit", (req, sink)))
        self.skills.prefetch(req.mix)  # routing has decided: the skills' reads start while the loop steps

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Control("abort", (request_id,)))

    def add_skill(self, name: str, load: AdapterLoader) -> None:
        self._inbox.put(_Control("add", (name, load)))

    def remove_skill(self, name: str) -> None:
        self._inbox.put(_Control("remove", (name,)))

    def healthy(self) -> bool:
        return self._alive and self._thread.is_alive()

    def last_step_age(self) -> float:
        return time.monotonic() - self._beat

    def stats(self) -> dict[str, int]:
        return {
            "running": len(self._running),
            "waiting": self._pending,
            "resident_skills": len(self.bank),
            "adapter_loads": self.skills.loads,
            "adapter_hits": self.skills.hits,
            "known_skills": self.skills.known,
            "aborted": self._aborted,
            "prefix_cached_tokens": self.prefix.cached_tokens,
            "prefix_hit_tokens": self.prefix.hit_tokens,
            "grammars_compiled": self.grammars.compiles,
        }

    def close(self) -> None:
        self._inbox.put(_Control("stop"))
        self._thread.join(timeout=10)
        self.host_adapters.close()

    # --- the engine thread ----------------------------------------------------------------------
    @torch.inference_mode()  # everything the thread touches (KV, adapter stacks) stays an inference tensor
    def _loop(self) -> None:
        lower_priority(self.nice)
        as_compute_thread()  # whatever helper threads lowered torch's default to (runtime/openmp.py)
        try:
            while True:
                self._beat = time.monotonic()
                # idle too while the only waiting work is a request whose skill is being read: a read that ends
                # posts a wake-up, so the loop does not spin meanwhile
                idle = not self._running and (not self._waiting or self._held)
                try:  # a bounded wait: an idle loop still ticks, so only a stuck one grows its last-step age
                    first = self._inbox.get(timeout=HEARTBEAT_S) if idle else None
                except queue.Empty:
                    first = None
                if not self._apply(first):
                    return
                if not self._apply_all():
                    return
                self._stepping, self._held = [], False
                try:
                    self._step()
                except Exception as e:  # the step's rows fail, the loop goes on
                    self._contain(e)
        except BaseException:
            log.exception("engine thread died")
            raise
        finally:  # stopped or crashed: never leave clients hanging on a dead thread
            self._die()

    def _contain(self, e: Exception) -> None:
        """A step raised: its rows, and every running row (their shared KV may be half-updated), end with an
        error; rows that had not started are untouched."""
        log.exception("engine step failed; failing its rows")
        for s in [*self._stepping, *self._running]:
            self._finish(s, "error", error=f"generation failed: {type(e).__name__}: {e}")
        self._running, self._kv = [], None
        self._drop_finished()

    def _die(self) -> None:
        """The loop is over: refuse new requests, fail every queued one at once (liveness turns red)."""
        with self._pending_lock:
            self._alive = False
        for s in [*self._running, *self._waiting]:
            self._finish(s, "error", error="the engine stopped")
        while True:
            try:
                c = self._inbox.get_nowait()
            except queue.Empty:
                return
            if c.kind == "submit":
                req, sink = c.args
                deliver(sink, EngineEvent(finish_reason="error", error="the engine stopped"), req.request_id)

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
            self._waiting.append(Row(req, sink, TextStream(self.tokenizer, req.params.stop), None))
        elif c.kind == "abort":
            (rid,) = c.args
            for s in [*self._running, *self._waiting]:
                if s.req.request_id == rid and not s.finished:
                    self._finish(s, "abort")
            self._drop_finished()
        elif c.kind == "add":
            name, load = c.args
            self.skills.add(name, load, self._in_use())
        elif c.kind == "remove":
            (name,) = c.args
            self.skills.remove(name, self._in_use())
        return True  # "wake": a skill's read ended; the step that follows admits its request

    def _in_use(self) -> set[str]:
        rows = [*self._running, *(s for s in self._waiting if s.done_prompt)]
        return {k for s in rows for k, _ in s.mix}

    def _step(self) -> None:
        # Prefill first: a new row's first token then does not wait for a decode forward, and the running rows'
        # next token waits for the same prefill either way (vLLM runs both in one forward; here they are two).
        decoding = len(self._running)
        budget = self.max_batched_tokens - decoding
        if self._waiting and decoding < self.max_num_seqs and budget > 0:
            self._prefill(budget)
        if self._running:
            self._decode()

    # --- admission, skills ----------------------------------------------------------------------
    def _admit(self, s: Row, reserved: frozenset[str] = frozenset()) -> bool | None:
        """Make the row's skills resident and its sampler ready. False (and an error event): it cannot run;
        None: it must wait, every resident slot being in use by running rows."""
        try:
            s.mix = self.skills.resolve(s.req.mix)
            needed = [k for k, w in s.mix if w != 0.0]
            keep = self._in_use() | reserved | set(needed)  # reserved: skills of rows admitted with this one
            if not self.skills.ensure(needed, keep):
                self._held = True
                return None
            s.grammar = self._grammar(s.req.params)  # compiled when the request was prepared: a copy of its start
            s.gen = self._generator(s.req.params, 0)
        except Exception as e:  # this request alone fails (a skill retired since routing, a broken adapter)
            why = str(e).strip("'\"")  # a KeyError: 404; StoreUnavailable: 503
            self._finish(s, "error", "", why, isinstance(e, KeyError), isinstance(e, StoreUnavailable))
            return False
        return True

    def _grammar(self, p: SamplingParams) -> RowGrammar | None:
        """A choice's own output grammar state, from the constraint compiled when the request was prepared."""
        return self.grammars.matcher(p.constraint) if p.constraint is not None else None

    def _generator(self, p: SamplingParams, index: int) -> torch.Generator | None:
        """Choice `index`'s own generator (None when greedy): seeded with its choice seed, else at random."""
        if p.greedy:
            return None
        gen = torch.Generator(device=self.device)
        seed = p.choice_seed(index)
        if seed is not None:
            gen.manual_seed(seed % 2**64)
        else:
            gen.seed()
        return gen

    # --- decode (prefill: prefill.py) ----------------------------------------------------------
    def _join(self, group: list[Row], kv: KVBatch, logits: torch.Tensor) -> None:
        """Sample each new row's first token; rows that go on join the decode batch. A request of n choices
        becomes n rows here: its prompt was prefilled once, and each choice's row takes a copy of its KV."""
        rows, source = [], []
        for i, s in enumerate(group):
            p = s.req.params
            rows += [
                s,
                *(
                    s.choice(j, TextStream(self.tokenizer, p.stop), self._generator(p, j), self._grammar(p))
                    for j in range(1, p.n)
                ),
            ]
            source += [i] * p.n
        if len(rows) > len(group):
            logits = logits[source]
        picks = sample(logits.float(), rows, self.eos_ids, self.masks)
        keep = [source[k] for k, (s, t) in enumerate(zip(rows, picks)) if self._push(s, t)]
        if not keep:
            return
        if self._kv is None:
            self._kv = kv.select(keep)  # a decode batch of its own: buffers with room to grow
        else:  # written into the batch's spare rows: no copy of its own first unless some rows ended already
            self._kv = self._kv.merge(kv if keep == list(range(len(group))) else kv.select(keep))
        self._running.extend(s for s in rows if not s.finished)

    def _decode(self) -> None:
        assert self._kv is not None
        rows = self._running
        ids = torch.tensor([[s.last] for s in rows], dtype=torch.long, device=self.device)
        pos = torch.tensor([[s.position] for s in rows], dtype=torch.long, device=self.device)
        cache, mask = self._kv.step_inputs()
        try:
            with self.bank.mixed([s.mix.ranked for s in rows]):
                out = self.model(
                    input_ids=ids, attention_mask=mask, position_ids=pos, **{self.cache_kw: cache}, use_cache=True
                )
        except Exception as e:
            log.exception("decode step failed")
            for s in rows:
                self._finish(s, "error", error=f"decode failed: {e}")
            self._drop_finished()
            return
        self._kv.stepped(mask)
        if self.on_step is not None:
            self.on_step(len(rows))
        for s, t in zip(rows, sample(out.logits[:, -1, :].float(), rows, self.eos_ids, self.masks)):
            if not s.finished:
                self._push(s, t)
        self._drop_finished()

    def _drop_finished(self) -> None:
        gone = [i for i, s in enumerate(self._running) if s.finished]
        if gone:
            if len(gone) < len(self._running) and self._kv is not None:
                self._kv, order = self._kv.remove(gone)  # in place: the last rows take the leavers' places
                self._running = [self._running[i] for i in order]
            else:
                self._running, self._kv = [], None
            self.skills.sweep(self._in_use())
        if any(s.finished for s in self._waiting):
            for s in [s for s in self._waiting if s.finished]:
                self._waiting.remove(s)
                self._admitted()

    def _admitted(self) -> None:
        with self._pending_lock:
            self._pending -= 1

    # --- events -----------------------------------------------------------------------------------
    def _push(self, s: Row, picked: Pick | None) -> bool:
        """Record one sampled token and emit its text; False when the row is finished (None: no token could be
        sampled from its logits, and it ends with its own error). The end of sequence is no completion token (not
        counted), but its logprob goes out with the last event, as vLLM's does (a loglikelihood needs it)."""
        if picked is None:
            why = "the model produced non-finite logits"
            if s.grammar is not None:
                why = f"no finite token the output constraint allows ({s.grammar.error or 'it allows none here'})"
            self._finish(s, "error", error=f"{why} for this request")
            return False
        token, p = picked.token, s.req.params
        if picked.logprob is not None:
            s.logprobs.append(picked.logprob)
        if token in self.eos_ids and not p.ignore_eos:
            self._finish(s, "stop", text=s.text.finish())
            return False
        if s.grammar is not None and not s.grammar.advance(token):
            self._finish(s, "error", error=f"the output constraint refused a token: {s.grammar.error}")
            return False
        s.out += 1
        s.last = token
        s.answer.append(token)
        delta, stopped = s.text.push(token, stops=s.out > p.min_tokens)  # vLLM's: no stop string before min_tokens
        if stopped:
            self._finish(s, "stop", text=delta)
            return False
        if s.grammar is not None and s.grammar.complete:  # nothing but the end can follow: end without a step
            self._finish(s, "stop", text=delta + s.text.finish())
            return False
        if s.out >= s.req.params.max_tokens or s.position + 1 >= self.max_context:
            self._finish(s, "length", text=delta + s.text.finish())
            return False
        if delta:
            s.send(EngineEvent(text=delta, tokens=s.out))
        return True

    def _finish(
        self,
        s: Row,
        reason: str,
        text: str = "",
        error: str | None = None,
        not_found: bool = False,
        unavailable: bool = False,
    ) -> None:
        if s.finished:
            return
        s.finished = True
        self._aborted += reason == "abort" and s.index == 0  # a request, not each of its choices
        s.send(EngineEvent(text, s.out, reason, error, not_found, unavailable))
