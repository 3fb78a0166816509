"""The live skill pool: what is registered in the engine and the router, kept in step."""

from __future__ import annotations

import logging
import threading

from skillpool.adapters_store.base_model import BaseModel
from skillpool.adapters_store.store import SkillRecord, SkillStore
from skillpool.router import Features, Router

from .engines import Engine
from .metrics import Metrics

log = logging.getLogger(__name__)


class SkillPool:
    def __init__(self, store: SkillStore, engine: Engine, router: Router, base: BaseModel, metrics: Metrics) -> None:
        self.store, self.engine, self.router, self.base, self.metrics = store, engine, router, base, metrics
        self._records: dict[str, SkillRecord] = {}
        self._probe_feats: dict[tuple[str, int], Features] = {}  # probe features, computed once per version
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
            self.router.add_skill(rec.name, tensors, (rec.meta.get("router") or {}).get("sapt_attention"))
            self._records[rec.name] = rec
            self.metrics.skills.set(len(self._records))
        score = (rec.meta.get("eval") or {}).get("score")
        if score is not None:
            self.metrics.skill_eval.labels(rec.name, rec.meta["eval"]["metric"]).set(score)
        if measure:
            self.measure_routing()
        log.info("serving skill %s v%d", rec.name, rec.version)

    def measure_routing(self) -> dict[str, float]:
        """Route every skill's held-out probe prompts; the share that lands on the skill is its accuracy.

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
        if not names:
            return {}
        decisions = self.router.route_features(Features.concat(feats))
        hits: dict[str, list[bool]] = {}
        for name, d in zip(names, decisions):
            hits.setdefault(name, []).append(bool(d.route) and d.route[0][0] == name)
        acc = {name: sum(h) / len(h) for name, h in hits.items()}
        for name, a in acc.items():
            self.metrics.routing_accuracy.labels(name).set(a)
        return acc

    def on_event(self, event: dict) -> None:  # type: ignore[type-arg]
        """A worker elsewhere stored a skill version: load it from the shared store unless we have it."""
        if event.get("type") != "skill_registered":
            return
        name, version = event["name"], int(event["version"])
        have = self._records.get(name)
        if have is not None and have.version >= version:
            return
        rec = self.store.get(name, version)
        if rec is None:
            log.error("skill %s v%d announced but not in the store at %s", name, version, self.store.root)
            return
        self.register(rec)

    def get(self, name: str) -> SkillRecord | None:
        return self._records.get(name)

    def records(self) -> list[SkillRecord]:
        return sorted(self._records.values(), key=lambda r: r.meta.get("created", 0))
