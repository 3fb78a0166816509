"""One training job, start to finish: split, router keys, the new block (a training method: isolated, kif or
sapt, trainer/methods), the quality gate (held-out bar, earlier skills re-checked through the routed path),
then one atomic store write. An import job (`adopt`) takes its block as given, checked at intake: the same keys,
gate and write."""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from skillpool.adapters_store.store import SkillDraft, SkillRecord, SkillStore
from skillpool.lora.adapter import load_peft_adapter
from skillpool.router import Router
from skillpool.runtime.base_model import BaseModel, resolve_device
from skillpool.runtime.dtype import dtype_name, resolve_dtype

from .config import IMPORTED, TrainConfig
from .judge import Judge, LocalJudge
from .loop import Progress, stop_check
from .methods import BlockJob, TrainingMethod, method_error, method_for
from .methods.base import replay_inputs
from .prompt_variants import with_variants
from .pseudo import GeneratorConfig, pseudo_replay
from .quality import PoolProbe, QualityGateFailed, held_out_scores, verdict
from .records import Example

log = logging.getLogger(__name__)


def split_examples(
    examples: list[Example], cfg: TrainConfig
) -> tuple[list[Example], list[Example], list[Example], list[Example]]:
    """(train, eval, replay, probe): eval/probe are held out; replay is a small sample of train. Examples marked
    `held_out` (a fine-tuning job's validation file) are the eval split; otherwise it is cut from the examples."""
    rng = random.Random(cfg.seed)
    shuffled = [e for e in examples if not e.get("held_out")]
    given = [e for e in examples if e.get("held_out")]
    rng.shuffle(shuffled)
    if given:
        held, train = given[: cfg.max_eval_examples], shuffled
    else:
        n_eval = min(cfg.max_eval_examples, math.ceil(len(shuffled) * cfg.eval_fraction)) if len(shuffled) >= 10 else 0
        held, train = shuffled[:n_eval], shuffled[n_eval:]
    replay = rng.sample(train, max(1, round(len(train) * cfg.replay_fraction))) if train else []
    return train, held, replay, held[: cfg.probe_size]


def split_imported(
    examples: list[Example], cfg: TrainConfig
) -> tuple[list[Example], list[Example], list[Example], list[Example]]:
    """An imported adapter's (keyed, gated, replay, probe) rows. Nothing trains on them, so the gate scores every
    row with an answer (up to max_eval_examples): the forced block answers alike whatever the keys are. The probe is
    held out of the keys as a trained skill's is (answered rows: later gates score them), the replay is answered."""
    rng = random.Random(cfg.seed)
    answered = [e for e in examples if e["answer"].strip()]
    rng.shuffle(answered)
    n_probe = min(cfg.probe_size, math.ceil(len(answered) * cfg.eval_fraction)) if len(answered) >= 10 else 0
    probe = answered[:n_probe]
    held = {id(e) for e in probe}
    keyed = [e for e in examples if id(e) not in held]
    replay = rng.sample(answered, max(1, round(len(answered) * cfg.replay_fraction))) if answered else []
    return keyed, answered[: cfg.max_eval_examples], replay, probe


def _copy_files(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        shutil.copy2(f, dst / f.name)


def _touching(folder: Path, on_progress: Callable[[Progress], None] | None) -> Callable[[Progress], None]:
    """`on_progress` that also touches `folder` each minute: a sweep on another host goes by its age."""
    last = time.monotonic()

    def report(p: Progress) -> None:
        nonlocal last
        if time.monotonic() - last > 60:
            last = time.monotonic()
            try:
                os.utime(folder)
            except OSError:
                pass
        if on_progress is not None:
            on_progress(p)

    return report


class SkillTrainer:
    """Trains skills against one base model and one router; used by the job queue's worker."""

    def __init__(
        self,
        store: SkillStore,
        router: Router,
        base: BaseModel,
        device: str | None = None,
        sync_router: bool = False,
        judge: Judge | None = None,
        dtype: str | None = None,
    ) -> None:
        """`sync_router`: the router is private to this trainer (a Redis worker), so it is refreshed from the
        shared store before each job; a server's trainer shares the live router, which is always current.
        `judge`: what the quality gate generates with (a server passes its engine); None: a LocalJudge on the
        trainer's own model. `dtype`: what a job whose config says "auto" trains in (--dtype; None:
        SKILLPOOL_DTYPE, else auto)."""
        self.dtype = dtype
        self.store, self.router, self.base, self.device, self.sync_router = store, router, base, device, sync_router
        self.judge = judge
        store.clean_tmp()  # scratch and half-written versions of a trainer that was killed (live owners' stay)

    def _load_base(self) -> tuple[Any, Any]:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = resolve_device(self.device)
        tok = AutoTokenizer.from_pretrained(str(self.base.path))
        model = AutoModelForCausalLM.from_pretrained(str(self.base.path), dtype=torch.float32)
        model = model.to(device)  # type: ignore[arg-type]  # transformers' stubs type .to oddly
        return model, tok

    def _method(self, method: str) -> TrainingMethod:
        error = method_error(method, self.router.settings.mode)
        if error:
            raise ValueError(error)
        return method_for(method)

    def run(
        self,
        name: str,
        examples: list[Example],
        cfg: TrainConfig,
        method: str = "isolated",
        on_progress: Callable[[Progress], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        force: bool = False,
        extra_meta: dict[str, Any] | None = None,
    ) -> SkillRecord:
        """Train, gate and store one skill. Raises QualityGateFailed (nothing stored) unless `force`, Cancelled
        once `should_stop()` says so, at every stage (key preparation and its embedding included).
        `extra_meta` goes into meta.json as is (e.g. the OpenAI `fine_tuned_model` id the skill answers to)."""
        check = stop_check(should_stop)
        check()
        # the dtype it trains in, by name: the skill's meta says what it was
        dtype = resolve_dtype(self.dtype if cfg.dtype == "auto" else cfg.dtype, resolve_device(self.device), "float32")
        cfg = replace(cfg, dtype=dtype_name(dtype))
        training_method = self._method(method)
        train, held, replay, probe = split_examples(examples, cfg)
        router_tensors, router_meta = self._keys(train, check)
        check()
        model, tok = self._load_base()
        pseudo = self._pseudo(model, tok, train, len(replay), cfg, should_stop)
        check()
        with self.store.scratch("block-") as folder:  # on the data dir's disk, swept at start if we are killed
            job = BlockJob(
                name,
                # the block alone sees the other wordings
                with_variants(
                    train, cfg.prompt_variants, cfg.seed, cfg.prompt_variants_added, cfg.prompt_variant_copies
                ),
                held,
                cfg,
                model,
                tok,
                folder,
                self.base.model_id,
                self.store,
                self.router,
                _touching(folder, on_progress),
                should_stop,
                check,
            )
            if self.router.mode.learns_projector and not training_method.learns_router_key:
                # the block trains alone; the router still learns its key
                tensors, router_meta["sapt_attention"] = self.router.prepare_sapt(
                    name, [e["route_text"] for e in train], [e["route_text"] for e in held], job.replay_inputs(), check
                )
                router_tensors.update(tensors)
            block = training_method.train(job)
            router_tensors.update(block.router_tensors)
            if block.attention is not None:
                router_meta["sapt_attention"] = block.attention
            check()
            adapter, attention = load_peft_adapter(folder), router_meta.get("sapt_attention")
            quality = self._gate(
                name, block.model, tok, adapter, train, held, cfg, router_tensors, attention, force, check
            )
            check()
            training = {"method": method, "config": cfg.to_dict(), **block.training}
            samples = {"total": len(examples), "train": len(train), "eval": len(held)}
            meta = self._meta(extra_meta, training, quality, samples, replay, probe, router_meta)
            return self._write(name, folder, router_tensors, meta, replay, probe, pseudo)

    def adopt(
        self,
        name: str,
        folder: Path,
        examples: list[Example],
        cfg: TrainConfig,
        should_stop: Callable[[], bool] | None = None,
        force: bool = False,
        extra_meta: dict[str, Any] | None = None,
        adapter_meta: dict[str, Any] | None = None,
    ) -> SkillRecord:
        """Store an imported adapter (PEFT files in `folder`, checked at intake) as skill `name`: router keys from
        `examples` as a trained skill's (none: a skill served only when named, which `auto` never picks), then the
        quality gate (earlier skills re-checked whenever it has keys; the block scored on the rows that carry an
        answer) and one store write. `adapter_meta`: what intake found of the adapter (its rank, source), kept in the
        meta's `training.adapter`. Raises QualityGateFailed (nothing stored) unless `force`, Cancelled on stop."""
        check = stop_check(should_stop)
        check()
        adapter = load_peft_adapter(folder)
        keyed, gated, replay, probe = split_imported(examples, cfg)
        router_tensors: dict[str, Any] = {}
        router_meta: dict[str, Any] = {"mode": self.router.settings.mode, "keys": False}
        if keyed:
            router_tensors, router_meta = self._keys(keyed, check)
            if self.router.mode.learns_projector:
                texts = [e["route_text"] for e in keyed]
                tensors, router_meta["sapt_attention"] = self.router.prepare_sapt(
                    name,
                    texts,
                    [e["route_text"] for e in probe] or texts,
                    replay_inputs(self.store, self.router, name),
                    check,
                )
                router_tensors.update(tensors)
        check()
        model = tok = None
        pseudo: list[str] = []
        if router_tensors:
            if self.judge is None or (
                self.router.mode.learns_projector and self.router.settings.sapt.replay == "pseudo"
            ):
                model, tok = self._load_base()
                pseudo = self._pseudo(model, tok, keyed, len(replay), cfg, should_stop)  # before the gate's layers
            else:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(self.base.path))
            check()
            attention = router_meta.get("sapt_attention")
            quality = self._gate(name, model, tok, adapter, gated, gated, cfg, router_tensors, attention, force, check)
        else:  # a skill only named requests reach: no route of an earlier skill changes
            quality = {"new": None, "earlier": {}, "passed": True, "forced": False, "reasons": [], "ran": False}
        check()
        training = {"method": IMPORTED, "config": cfg.to_dict(), "adapter": adapter_meta or {}}
        samples = {"total": len(examples), "keys": len(keyed), "eval": len(gated)}
        meta = self._meta(extra_meta, training, quality, samples, replay, probe, router_meta)
        return self._write(name, folder, router_tensors, meta, replay, probe, pseudo)

    def _meta(
        self,
        extra: dict[str, Any] | None,
        training: dict[str, Any],
        quality: dict[str, Any],
        samples: dict[str, int],
        replay: list[Example],
        probe: list[Example],
        router: dict[str, Any],
    ) -> dict[str, Any]:
        """meta.json of a new version: `extra` as is, then how it was made, its gate and rows, its router's part."""
        return {
            **(extra or {}),
            "base_model": {"id": self.base.model_id, "fingerprint": self.base.fingerprint},
            "training": training,
            "eval": quality["new"],
            "quality": quality,
            "samples": {**samples, "replay": len(replay), "probe": len(probe)},
            "router": router,
        }

    def _write(
        self,
        name: str,
        folder: Path,
        router_tensors: dict[str, Any],
        meta: dict[str, Any],
        replay: list[Example],
        probe: list[Example],
        pseudo: list[str],
    ) -> SkillRecord:
        """One atomic store write: the PEFT files in `folder` and everything beside them."""
        draft = SkillDraft(name, partial(_copy_files, folder), router_tensors, meta, list(replay), list(probe), pseudo)
        return self.store.write(draft)

    def _keys(self, train: list[Example], check: Callable[[], None]) -> tuple[dict[str, Any], dict[str, Any]]:
        """The skill's router tensors from its training rows, and the router's part of its meta."""
        if self.sync_router:
            self._sync_router()
        router_tensors = self.router.prepare_keys(  # inputs and answers: gate on fields and labels, not wording
            [e["route_text"] for e in train],
            [str(e.get("route_input", e["route_text"])) for e in train],
            [str(e["answer"]) for e in train],
            check,
        )
        router_meta = {"mode": self.router.settings.mode, "threshold": float(router_tensors["threshold"][0])}
        return router_tensors, router_meta

    def _pseudo(
        self,
        model: Any,
        tok: Any,
        train: list[Example],
        n: int,
        cfg: TrainConfig,
        should_stop: Callable[[], bool] | None,
    ) -> list[str]:
        """This skill's own pseudo inputs, replayed when later skills learn (sapt replay "pseudo"), else none."""
        if not (self.router.mode.learns_projector and self.router.settings.sapt.replay == "pseudo"):
            return []
        texts = [e["route_text"] for e in train]
        return pseudo_replay(model, tok, texts, n, GeneratorConfig(seed=cfg.seed), should_stop)

    def _gate(
        self,
        name: str,
        model: Any,
        tok: Any,
        adapter: Any,
        train: list[Example],
        held: list[Example],
        cfg: TrainConfig,
        tensors: dict[str, Any],
        attention: dict[str, float] | None,
        force: bool,
        check: Callable[[], None],
    ) -> dict[str, Any]:
        """Score the new block and re-check earlier skills through the routed pool; raise unless it passes or is forced."""
        judge = self.judge or LocalJudge(model, tok)
        key = judge.candidate(name, lambda: adapter)
        try:
            new = held_out_scores(judge, tok, key, train, held)
            check()
            earlier = [rec for rec in self.store.list_latest() if rec.name != name]
            scratch = Router(self.router.embedder, self.router.settings, self.router.pooler)  # live router untouched
            probe = PoolProbe(scratch, earlier).run(judge, tok, name, key, tensors, attention)
        finally:
            judge.remove(key)
        report = verdict(new, probe, cfg, force)
        if not report["passed"] and not force:
            raise QualityGateFailed(report)
        return report

    def _sync_router(self) -> None:
        """Load every stored skill's router tensors: the SAPT state a new skill learns on top of."""
        for rec in self.store.list_latest():
            if tensors := rec.router_tensors():  # a skill without keys is never routed to
                self.router.add_skill(rec.name, tensors, (rec.meta.get("router") or {}).get("sapt_attention"))
