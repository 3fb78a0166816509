"""One training job, start to finish: split, router keys, the new block (isolated | sapt | kif), the quality
gate (held-out bar, earlier skills re-checked through the routed path), then one atomic store write.

Methods:
  isolated  a fresh LoRA block trained on the task alone.
  sapt      SAPT attentive learning: the block trains inside the attention mix of every earlier block
            (frozen) with its key and the query projector, plus attentive reflection (trainer/attentive.py).
            Needs the router in sapt mode: serving mixes blocks with that same attention.
  kif       Recurrent-KIF: the block starts from the most similar blocks whose answers are of the new task's
            kind (label set or free text; one alone or their router-weighted mix) when that lowers the new
            task's loss before training, else fresh (trainer/kif.py), and
            trains in cycles of inner steps on the task and an outer step on the memory buffer (the stored
            samples of every earlier skill of the same answer kind), fused through importance masks that by
            default keep the whole update (kif_top_q 1.0: earlier blocks are frozen, nothing for a mask to
            guard).
All three run on one training loop (trainer/loop.py); each is a `Method` with its own hooks.
"""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from skillpool.adapters_store.base_model import BaseModel, resolve_device
from skillpool.adapters_store.lora import load_peft_adapter, save_peft_adapter
from skillpool.adapters_store.store import SkillDraft, SkillRecord, SkillStore
from skillpool.router import Router

from .attentive import train_attentive
from .config import TrainConfig, method_error
from .judge import Judge, LocalJudge
from .kif import KIFSettings, StartTrial, choose_start, init_from_blocks, train_kif
from .loop import Progress, stop_check
from .lora_train import add_lora, encode_example, fit_config, pad_id, save_adapter, schedule_of
from .pseudo import GeneratorConfig, pseudo_replay
from .quality import PoolProbe, QualityGateFailed, held_out_scores, verdict
from .records import Example
from .scoring import metric_for

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


def _unlike_answers(records: list[SkillRecord], kind: str) -> set[str]:
    """Skills among `records` whose answers are of another kind than `kind` (a label set, scored by exact match,
    against free text, scored by ROUGE-L): no start for a new kif block (issue 18). A label block lowers a
    free-text task's loss before training only because it makes answers short: on the SuperNI sequence the
    probe chose one for every free-text task, and sciq scored 8.7 from sentiment140's block, 11.5 fresh.
    Nor are their rows in its memory buffer."""
    return {rec.name for rec in records if (rec.meta.get("eval") or {}).get("metric") not in (None, kind)}


def _latest(records: list[SkillRecord], exclude: set[str]) -> dict[str, float]:
    """kif_start "latest": the newest of `records` outside `exclude`, whole ({} when none). Started from it, each
    block continues the one before, as one LoRA trained on the tasks in turn does (the yelp sequence's imdb: 92
    after four tasks in turn, 76 alone), and stays frozen as its task's block, so nothing it knew is lost."""
    newest = max((r for r in records if r.name not in exclude), key=lambda r: r.meta.get("created", 0.0), default=None)
    return {newest.name: 1.0} if newest is not None else {}


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
    ) -> None:
        """`sync_router`: the router is private to this trainer (a Redis worker), so it is refreshed from the
        shared store before each job; a server's trainer shares the live router, which is always current.
        `judge`: what the quality gate generates with (a server passes its engine); None: a LocalJudge on the
        trainer's own model."""
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

    def check_method(self, method: str) -> None:
        error = method_error(method, self.router.settings.mode)
        if error:
            raise ValueError(error)

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
        self.check_method(method)
        train, held, replay, probe = split_examples(examples, cfg)
        if self.sync_router:
            self._sync_router()
        train_texts = [e["route_text"] for e in train]
        router_tensors = self.router.prepare_keys(  # inputs and answers: gate on fields and labels, not wording
            train_texts,
            [str(e.get("route_input", e["route_text"])) for e in train],
            [str(e["answer"]) for e in train],
            check,
        )
        router_meta: dict[str, Any] = {
            "mode": self.router.settings.mode,
            "threshold": float(router_tensors["threshold"][0]),
        }
        training: dict[str, Any] = {"method": method, "config": cfg.to_dict()}
        check()
        model, tok = self._load_base()
        pseudo: list[str] = []
        if self.router.mode.learns_projector and self.router.settings.sapt.replay == "pseudo":
            # this skill's own pseudo inputs, replayed when later skills learn
            pseudo = pseudo_replay(model, tok, train_texts, len(replay), GeneratorConfig(seed=cfg.seed), should_stop)
        check()
        with self.store.scratch("block-") as folder:  # on the data dir's disk, swept at start if we are killed
            report = _touching(folder, on_progress)
            if method == "sapt":
                held_texts, replay_texts, pool = (
                    [e["route_text"] for e in held],
                    self._replay_inputs(name),
                    self.router.pooler,
                )
                assert pool is not None
                # router-only stage first (SAPT's settings.steps of CE + ARM): the LM steps alone are too few to place the key
                warm = self.router.sapt_state().learn(
                    name,
                    pool(train_texts),
                    pool(held_texts),
                    {n: pool(t) for n, t in replay_texts.items() if t},
                    check,
                )
                result = train_attentive(
                    model,
                    tok,
                    name,
                    train,
                    held_texts,
                    cfg,
                    warm,
                    pool,
                    {n: self._record(n).adapter() for n in warm.names if n != name},
                    replay_texts,
                    route_weight=cfg.sapt_route_weight,
                    on_progress=report,
                    should_stop=should_stop,
                )
                save_peft_adapter(
                    result.adapter, folder, self.base.model_id, cfg.alpha, cfg.target_modules, cfg.dropout
                )
                router_tensors.update(result.state.skill_tensors(name))
                router_meta["sapt_attention"] = result.state.mean_attention[name]
            else:
                if self.router.mode.learns_projector:  # the block trains alone; the router still learns its key
                    tensors, mean_attention = self.router.prepare_sapt(
                        name, train_texts, [e["route_text"] for e in held], self._replay_inputs(name), check
                    )
                    router_tensors.update(tensors)
                    router_meta["sapt_attention"] = mean_attention
                peft_model = add_lora(model, cfg.rank, cfg.alpha, cfg.dropout, cfg.target_modules, cfg.seed)
                if method == "kif":
                    training["kif"] = self._train_kif(name, peft_model, tok, train, held, cfg, report, should_stop)
                else:
                    fit_config(peft_model, tok, train, cfg, report, should_stop)
                save_adapter(peft_model, folder, self.base.model_id)
                model = cast(Any, peft_model).unload()  # the plain base model again, for the gate's routed generation
            attention = router_meta.get("sapt_attention")
            check()
            quality = self._gate(
                name, model, tok, load_peft_adapter(folder), train, held, cfg, router_tensors, attention, force, check
            )
            check()
            draft = SkillDraft(
                name=name,
                write_adapter=lambda dst: _copy_files(folder, dst),
                router_tensors=router_tensors,
                meta={
                    **(extra_meta or {}),
                    "base_model": {"id": self.base.model_id, "fingerprint": self.base.fingerprint},
                    "training": training,
                    "eval": quality["new"],
                    "quality": quality,
                    "samples": {
                        "total": len(examples),
                        "train": len(train),
                        "eval": len(held),
                        "replay": len(replay),
                        "probe": len(probe),
                    },
                    "router": router_meta,
                },
                replay=replay,
                probe=probe,
                pseudo=pseudo,
            )
            return self.store.write(draft)

    def _record(self, name: str) -> SkillRecord:
        rec = self.store.serving(name)  # the version that serves (a rollback may pin an older one)
        if rec is None:
            raise KeyError(f"skill {name!r} is in the router but not in the store at {self.store.root}")
        return rec

    def _train_kif(
        self,
        name: str,
        peft_model: Any,
        tok: Any,
        train: list[Example],
        held: list[Example],
        cfg: TrainConfig,
        on_progress: Callable[[Progress], None] | None,
        should_stop: Callable[[], bool] | None,
    ) -> dict[str, Any]:
        """Recurrent-KIF on the new block: seeded from similar blocks where the probe (and the trial, if on) says
        that helps, or from the newest block of its answer kind (kif_start "latest"); fused against the memory."""
        kind = metric_for([e["answer"] for e in train])
        earlier = [rec for rec in self.store.list_latest() if rec.name != name]  # one read: starts and memory
        unlike = _unlike_answers(earlier, kind)
        similar = cfg.kif_start == "similar"  # else "latest": no probe, no trial
        if similar:
            seeds = self._similar_skills(name, [e["route_text"] for e in train], cfg.kif_init_blocks, unlike)
        else:
            seeds = _latest(earlier, unlike) if cfg.kif_init_blocks > 0 else {}
        encoded = [encode_example(tok, e, cfg.max_seq_len) for e in train]
        trial_rows = similar and cfg.kif_start_trial > 0
        held_out = [encode_example(tok, e, cfg.max_seq_len) for e in held] if trial_rows else []
        can_trial = bool(held_out)  # the trial is on and has rows to judge by
        start: dict[str, Any] = {"init_from": seeds, "answers": kind, "unlike_answers": sorted(unlike)}
        start["start"] = cfg.kif_start
        trial: StartTrial | None = None
        if seeds and cfg.kif_start_probe > 0 and similar:
            probe = random.Random(cfg.seed).sample(encoded, min(cfg.kif_start_probe, len(encoded)))
            blocks = {n: (self._record(n).adapter(), w) for n, w in seeds.items()}
            choice = choose_start(peft_model, blocks, probe, pad_id(tok), cfg.kif_start_margin, apply=not can_trial)
            start |= {"init_from": choice.blocks, "start_candidates": choice.candidates}
            if choice.blocks and can_trial:  # the probe's pick against fresh, judged again after training
                adapters = {n: blocks[n][0] for n in choice.blocks}
                trial = StartTrial(adapters, [{}, choice.blocks], held_out, cfg.kif_start_margin, cfg.kif_start_trial)
        elif seeds:
            init_from_blocks(peft_model, [(self._record(n).adapter(), w) for n, w in seeds.items()])
        # the memory holds only skills of the new task's answer kind: label rows replayed into a free-text block
        # pull it toward short answers (SuperNI: sciq 12.7 with sst-2's and sentiment140's rows, 13.5 alone)
        remembered = [rec for rec in earlier if rec.name not in unlike]
        memory = [encode_example(tok, e, cfg.max_seq_len) for rec in remembered for e in rec.replay()]
        settings = KIFSettings(
            cfg.kif_inner_steps, cfg.kif_ema_in, cfg.kif_ema_hist, cfg.kif_top_q, cfg.kif_init_blocks
        )
        schedule = schedule_of(cfg)
        finalists = train_kif(
            peft_model, encoded, memory, pad_id(tok), schedule, settings, trial, on_progress, should_stop
        )
        if finalists:
            kept = next(f["blocks"] for f in finalists if f.get("kept"))
            start |= {"init_from": kept, "start_trial": finalists}
        return {**start, "memory_examples": len(memory), "memory_skills": len(remembered)}

    def _similar_skills(
        self, name: str, texts: list[str], k: int, exclude: set[str] | None = None, sample: int = 64
    ) -> dict[str, float]:
        """The k registered skills nearest to these inputs (none of `exclude`), by mean mix weight (normalized).
        Ungated: the new task's inputs are unseen, so the open-set and format gates would send most of them to
        the base model."""
        if k <= 0 or not texts:
            return {}
        share: dict[str, float] = {}
        for d in self.router.route(texts[:sample], open_set=False):
            for skill, w in d.route:
                if skill != name and skill not in (exclude or ()):
                    share[skill] = share.get(skill, 0.0) + w
        top = sorted(share.items(), key=lambda kv: -kv[1])[:k]
        total = sum(w for _, w in top)
        return {s: w / total for s, w in top} if total > 0 else {}

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
            self.router.add_skill(rec.name, rec.router_tensors(), (rec.meta.get("router") or {}).get("sapt_attention"))

    def _replay_inputs(self, name: str) -> dict[str, list[str]]:
        """Earlier skills' replay inputs for attentive reflection: their stored real samples, or their
        generated pseudo inputs when the setting asks for them and the skill has some."""
        out: dict[str, list[str]] = {}
        for rec in self.store.list_latest():
            if rec.name == name:
                continue
            pseudo = rec.pseudo() if self.router.settings.sapt.replay == "pseudo" else []
            out[rec.name] = [str(p) for p in pseudo] or [str(e["route_text"]) for e in rec.replay()]
        return out
