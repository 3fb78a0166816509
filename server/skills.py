"""The live skill pool: what is registered in the engine and the router, kept in step.

Skills trained by /v1/fine_tuning/jobs also answer to their OpenAI model id (`ft:<base>:<suffix>:<id>`,
kept in the version's meta.json as `fine_tuned_model`). Retire and rollback change the shared store's
state first and are then announced as events, so every server follows without a restart.
"""

from __future__ import annotations

import logging
import threading
import time

from prometheus_client import Gauge

from skillpool.adapters_store.store import SkillRecord, SkillStore, StoreUnavailable
from skillpool.lora.mix import Mix
from skillpool.router import Features, Router
from skillpool.runtime.base_model import BaseModel
from skillpool.trainer.events import Resync, SkillActivated, SkillEvent, SkillRegistered, SkillRetired

from .engines import Engine
from .metrics import Metrics
from .routing_log import BASE, ProbeHistory

log = logging.getLogger(__name__)


class SkillPool:
    def __init__(self, store: SkillStore, engine: Engine, router: Router, base: BaseModel, metrics: Metrics) -> None:
        self.store, self.engine, self.router, self.base, self.metrics = store, engine, router, base, metrics
        self._records: dict[str, SkillRecord] = {}
        self._aliases: dict[str, str] = {}  # fine_tuned_model id -> skill name
        self._broken: set[tuple[str, int]] = set()  # versions that failed to load: not retried by every resync
        self._probe_feats: dict[tuple[str, int], Features] = {}  # probe features, computed once per version
        self._eval_metric: dict[str, str] = {}  # skill -> the metric label of its skill_eval series
        self._measured: set[str] = set()  # skills that have a routing_accuracy series
        self.probes = ProbeHistory()  # each measurement's accuracy and the last one's confusion, for the console
        self._lock = threading.Lock()

    def load_all(self) -> None:
        """Serve every complete skill in the store (newest version of each)."""
        self.store.clean_tmp()
        for rec in self.store.list_latest():
            try:
                self.register(rec, measure=False)
            except Exception as e:  # one broken skill must not keep the server down
                log.error("not serving skill %s v%d: %s", rec.name, rec.version, e)
        self.measure_routing()

    def register(self, rec: SkillRecord, measure: bool = True) -> None:
        """Hot-add (or replace) a skill: the next batch can route to it; a running batch is untouched."""
        fp = rec.meta.get("base_model", {}).get("fingerprint")
        if fp != self.base.fingerprint:
            raise ValueError(f"trained on another base model (fingerprint {fp}, serving {self.base.fingerprint})")
        tensors = rec.router_tensors()
        with self._lock:
            # the engine reads the adapter from the store when a request first needs it (and again after an
            # LRU eviction), so a 1,000-skill pool costs memory only for the skills in use
            self.engine.add_skill(rec.name, rec.adapter)
            if tensors:
                self.router.add_skill(rec.name, tensors, (rec.meta.get("router") or {}).get("sapt_attention"))
            else:  # an imported skill without examples: served when named, never routed to (nor its old keys)
                self.router.remove_skill(rec.name)
            self._records[rec.name] = rec
            self._aliases = {a: n for a, n in self._aliases.items() if n != rec.name}
            if alias := rec.meta.get("fine_tuned_model"):
                self._aliases[str(alias)] = rec.name
            self.metrics.skills.set(len(self._records))
            self._drop_eval(rec.name)  # a new version, or a rollback: the score shown is the serving version's
            score = (rec.meta.get("eval") or {}).get("score")
            if score is not None:
                self._eval_metric[rec.name] = metric = str(rec.meta["eval"]["metric"])
                self.metrics.skill_eval.labels(rec.name, metric).set(score)
        if measure:
            self.measure_routing()
        log.info("serving skill %s v%d", rec.name, rec.version)

    def measure_routing(self) -> dict[str, float]:
        """Route every skill's held-out probe prompts; the share that lands on the skill is its accuracy, and
        where they all land (top-1) is the confusion between skills (kept with its history in `probes`).

        Re-measured for all skills whenever the pool changes, since a new skill can take traffic
        from an old one.
        """
        names: list[str] = []
        feats: list[Features] = []
        for rec in self.records():
            key = (rec.name, rec.version)
            if key not in self._probe_feats:
                self._probe_feats[key] = self.router.features([p["route_text"] for p in rec.probe()])
            names += [rec.name] * len(self._probe_feats[key].emb)
            feats.append(self._probe_feats[key])
        acc: dict[str, float] = {}
        confusion: dict[str, dict[str, int]] = {}  # probe's skill -> top-1 route (BASE: a fallback) -> count
        if names:
            decisions = self.router.route_features(Features.concat(feats))
            for name, d in zip(names, decisions):
                row = confusion.setdefault(name, {})
                top = d.route[0][0] if d.route else BASE
                row[top] = row.get(top, 0) + 1
            acc = {name: row.get(name, 0) / sum(row.values()) for name, row in confusion.items()}
        self.probes.record(acc, confusion, [rec.name for rec in self.records()], time.time())
        for name, a in acc.items():
            self.metrics.routing_accuracy.labels(name).set(a)
        for name in self._measured - acc.keys():  # retired, or no probe prompts any more: no stale accuracy
            _remove(self.metrics.routing_accuracy, name)
        self._measured = set(acc)
        return acc

    def unregister(self, name: str) -> None:
        """Stop serving a skill: out of the router first (no new routes), then out of the engine (a running
        row finishes on the version it started with)."""
        with self._lock:
            if self._records.pop(name, None) is None:
                return
            self.router.remove_skill(name)
            self.engine.remove_skill(name)
            self._aliases = {a: n for a, n in self._aliases.items() if n != name}
            self.metrics.skills.set(len(self._records))
            self._drop_eval(name)
        self.measure_routing()  # which drops its routing accuracy: a retired skill leaves no per-skill series
        log.info("retired skill %s", name)

    def _drop_eval(self, name: str) -> None:
        if (metric := self._eval_metric.pop(name, None)) is not None:
            _remove(self.metrics.skill_eval, name, metric)

    def on_event(self, event: SkillEvent) -> None:
        """A worker elsewhere stored a skill version, or a server retired or rolled back a skill: follow the
        shared store (the state it says, not only the event, so a late or repeated event does no harm)."""
        match event:
            case Resync():
                self.reconcile()
            case SkillRetired(name):
                if self.store.serving(name) is None:
                    self.unregister(name)
            case SkillActivated(name):
                rec = self.store.serving(name)
                have = self._records.get(name)
                if rec is not None and (have is None or have.version != rec.version):
                    self.register(rec)
            case SkillRegistered(name, version):
                have = self._records.get(name)
                if have is not None and have.version >= version:
                    return
                rec = self.store.get(name, version)
                if rec is None:
                    log.error("skill %s v%d announced but not in the store at %s", name, version, self.store.root)
                    return
                self.register(rec)

    def reconcile(self) -> None:
        """Serve exactly what the shared store says serves: catches up on events this server missed (its
        Redis connection dropped while another server retired, rolled back or registered a skill)."""
        serving = {rec.name: rec for rec in self.store.list_latest()}
        for name in [n for n in self._records if n not in serving]:
            self.unregister(name)
        for name, rec in serving.items():
            have = self._records.get(name)
            if (have is not None and have.version == rec.version) or (name, rec.version) in self._broken:
                continue
            try:
                self.register(rec)
            except Exception as e:  # one broken skill must not stop the others
                self._broken.add((name, rec.version))
                log.error("not serving skill %s v%d: %s", name, rec.version, e)

    def get(self, name: str) -> SkillRecord | None:
        return self._records.get(name)

    def resolve(self, model: str) -> str | None:
        """The served skill a model id names: a skill name or a fine_tuned_model id."""
        if model in self._records:
            return model
        return self._aliases.get(model)

    def alias(self, name: str) -> str | None:
        """The fine_tuned_model id of a served skill, if a fine-tuning job made it."""
        rec = self._records.get(name)
        return str(rec.meta["fine_tuned_model"]) if rec is not None and rec.meta.get("fine_tuned_model") else None

    def fetch_adapters(self, mix: Mix) -> None:
        """Bring the mix's adapters onto this node's disk (a remote store's cache) ahead of the engine, which then
        reads them locally. A store that cannot be reached is left to the engine: a skill it holds still serves,
        and a cold one fails there with a 503."""
        for name, weight in mix:
            rec = self._records.get(name)
            if rec is None or weight == 0.0:
                continue
            try:
                rec.fetch_adapter()
            except (StoreUnavailable, FileNotFoundError) as e:
                log.debug("adapter of %s v%d not fetched ahead: %s", name, rec.version, e)
                return

    def records(self) -> list[SkillRecord]:
        return sorted(self._records.values(), key=lambda r: r.meta.get("created", 0))


def _remove(gauge: Gauge, *labels: str) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:  # gone already (older prometheus_client releases raise for a series they lack)
        pass
