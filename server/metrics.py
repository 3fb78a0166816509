"""Prometheus metrics (skillpool_ prefix, base units, _total counters), one registry per app."""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from skillpool.adapters_store.objects import TIERS
from skillpool.adapters_store.store import SkillStore
from skillpool.trainer.service import Catalog, TrainingMetrics

from .engines import Engine

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_BATCH_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
_COSINE = tuple(i / 10 for i in range(-2, 11))


class Metrics:
    def __init__(self, replica: str | None = None) -> None:
        """`replica`: this process' name on the per-replica series (default: the host name)."""
        self.replica = replica or socket.gethostname() or "0"
        self.registry = CollectorRegistry()
        self.catalog: Catalog = {}  # exposition name -> (type, labels): checked against deploy/README.md's table
        counter, gauge, histogram = self._counter, self._gauge, self._histogram
        self.requests = counter("skillpool_requests_total", "HTTP requests", "endpoint", "status")
        self.request_seconds = histogram("skillpool_request_duration_seconds", "End-to-end request latency", "endpoint")
        self.ttft = histogram("skillpool_time_to_first_token_seconds", "Time to first token")
        self.inter_token = histogram("skillpool_inter_token_seconds", "Mean time between generated tokens per request")
        self.tokens = counter("skillpool_tokens_total", "Tokens processed", "kind")
        self.route_decisions = counter(
            "skillpool_route_decisions_total", "Requests routed, per skill (top-1) and reason", "skill", "reason"
        )
        self.route_weight = counter("skillpool_route_weight_total", "Sum of mix weights given to each skill", "skill")
        self.fallbacks = counter(
            "skillpool_route_fallbacks_total", "Auto-routed requests served by the base model", "reason"
        )
        self.router_seconds = histogram("skillpool_router_latency_seconds", "Router latency per batch")
        self.routing_wait = histogram(
            "skillpool_routing_wait_seconds",
            "Per auto-routed request: arrival at the routing stage to its route (window, queue and embedding)",
        )
        self.router_cpu = counter(
            "skillpool_router_cpu_seconds",
            "CPU time the routing stage's thread spent routing (embedding included when it runs on that thread)",
        )
        self.router_score = histogram(
            "skillpool_router_score", "Best key cosine score per routed request", buckets=_COSINE
        )
        self.batch_size = histogram("skillpool_batch_size", "Rows in each engine decode step", buckets=_BATCH_ROWS)
        self.skills = gauge("skillpool_skills", "Skills registered and routable")
        self.training = TrainingMetrics(self.registry)  # the same series `skillpool worker --metrics-port` exports
        self.labelled = counter(
            "skillpool_labelled_requests_total",
            "Auto-routed requests that named the skill they expect (metadata.expected_skill), by top-1 correct",
            "expected_skill",
            "correct",
        )
        self.routing_accuracy = gauge(
            "skillpool_routing_accuracy", "Share of a skill's held-out probe prompts routed to it (top-1)", "skill"
        )
        self.fallback_clusters = gauge(
            "skillpool_fallback_clusters", "Live clusters of recent requests that fell back to the base model"
        )
        self.fallback_largest_cluster = gauge(
            "skillpool_fallback_largest_cluster",
            "Recent (decayed, half-life 1 h) size of the largest fallback cluster: demand no skill serves",
        )
        self.skill_eval = gauge(
            "skillpool_skill_eval_score", "Held-out score of each skill at training time", "skill", "metric"
        )
        self._engine = EngineCollector()
        self.registry.register(self._engine)
        self.catalog.update(self._engine.catalog)
        self._adapters = AdapterCollector(self.replica)
        self.registry.register(self._adapters)
        self.catalog.update(self._adapters.catalog)
        self.catalog.update(self.training.catalog)

    def watch_engine(self, engine: Engine) -> None:
        """Read this engine's health, queue and resident adapters at every scrape."""
        self._engine.engine = self._adapters.engine = engine

    def watch_store(self, store: SkillStore) -> None:
        """Read the skill store's adapter reads per tier (its disk cache, the store itself) at every scrape."""
        self._adapters.store = store

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        self.catalog[name.removesuffix("_total") + "_total"] = ("counter", labels)  # as the client exposes it
        return Counter(name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        self.catalog[name] = ("gauge", labels)
        return Gauge(name, doc, labels, registry=self.registry)

    def _histogram(self, name: str, doc: str, *labels: str, buckets: Sequence[float] = _LATENCY) -> Histogram:
        self.catalog[name] = ("histogram", labels)
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)


class EngineCollector:
    """The engine's state, read when Prometheus scrapes: cheaper than keeping gauges current, and never stale.
    `engine_last_step_age_seconds` grows only when the loop is stuck: an idle loop still completes iterations."""

    _FAMILIES = (
        ("skillpool_queue_depth", "gauge", "Requests waiting for the engine"),
        ("skillpool_requests_running", "gauge", "Requests in the engine's running batch"),
        ("skillpool_resident_skills", "gauge", "Skills whose adapter weights are loaded in the engine now"),
        ("skillpool_engine_up", "gauge", "1 while the engine's loop is alive, 0 once it died (restart the server)"),
        (
            "skillpool_engine_last_step_age_seconds",
            "gauge",
            "Seconds since the engine's loop last completed an iteration",
        ),
    )

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.catalog: Catalog = {
            name + ("_total" if kind == "counter" else ""): (kind, ()) for name, kind, _ in self._FAMILIES
        }

    def describe(self) -> Iterable[Metric]:
        return [_family(name, kind, doc, None) for name, kind, doc in self._FAMILIES]

    def collect(self) -> Iterator[Metric]:
        if self.engine is None:
            return
        stats = self.engine.stats()
        values = (
            stats["waiting"],
            stats["running"],
            stats["resident_skills"],
            1.0 if self.engine.healthy() else 0.0,
            self.engine.last_step_age(),
        )
        for (name, kind, doc), value in zip(self._FAMILIES, values):
            yield _family(name, kind, doc, float(value))


class AdapterCollector:
    """Adapter lookups per tier that answered them, and adapters loaded into each tier, with this process' `replica`
    label, read at every scrape: `gpu` (an engine slot) and `host` (host memory) from the engine's stats where it
    keeps them, `disk` (the node's cache of an object store) and `store` (read from the store) from the skill
    store. A lookup the engine misses is read from the store, through the disk cache when it is remote. A
    cluster's ingress also exports every engine replica's tiers under that replica's id (its engine has
    `replica_stats`); every ingress exports the same series, so sum them per (tier, replica) with max."""

    HITS = ("skillpool_adapter_hits", "Adapter lookups, by the tier that answered them (gpu, host, disk, store)")
    LOADS = ("skillpool_adapter_loads", "Adapters loaded into a tier (gpu: an engine slot; disk: downloaded)")
    _ENGINE = {"gpu": ("adapter_hits", "adapter_loads"), "host": ("host_adapter_hits", "host_adapter_loads")}
    _STORE = {t: (f"{t}_adapter_hits", f"{t}_adapter_loads") for t in ("disk", "store")}  # an engine replica's

    def __init__(self, replica: str) -> None:
        self.replica = replica
        self.engine: Engine | None = None
        self.store: SkillStore | None = None
        self.catalog: Catalog = {
            name + "_total": ("counter", ("tier", "replica")) for name, _ in (self.HITS, self.LOADS)
        }

    def describe(self) -> Iterable[Metric]:
        return [CounterMetricFamily(name, doc, labels=("tier", "replica")) for name, doc in (self.HITS, self.LOADS)]

    @staticmethod
    def _tiers(stats: dict[str, int], names: dict[str, tuple[str, str]]) -> tuple[dict[str, float], dict[str, float]]:
        hits = {tier: float(stats[hit]) for tier, (hit, _) in names.items() if hit in stats}
        loads = {tier: float(stats[load]) for tier, (_, load) in names.items() if load in stats}
        return hits, loads

    def collect(self) -> Iterator[Metric]:
        per_replica: dict[str, tuple[dict[str, float], dict[str, float]]] = {}
        hits: dict[str, float] = {}
        loads: dict[str, float] = {}
        replica_stats = getattr(self.engine, "replica_stats", None)
        if callable(replica_stats):  # an ingress: the engine replicas hold the adapters
            for name, stats in replica_stats().items():
                per_replica[name] = self._tiers(stats, {**self._ENGINE, **self._STORE})
        elif self.engine is not None:
            hits, loads = self._tiers(self.engine.stats(), self._ENGINE)
        if self.store is not None:
            store_hits, store_loads = self.store.tiers.snapshot()
            tiers = ("disk", "store") if self.store.remote else ("store",)
            hits.update({tier: store_hits.get(tier, 0) for tier in tiers})
            loads.update({tier: store_loads.get(tier, 0) for tier in tiers if tier != "store"})
        per_replica.setdefault(self.replica, (hits, loads))
        for i, (name, doc) in enumerate((self.HITS, self.LOADS)):
            family = CounterMetricFamily(name, doc, labels=("tier", "replica"))
            for replica, values in per_replica.items():
                for tier in TIERS:
                    if tier in values[i]:
                        family.add_metric([tier, replica], float(values[i][tier]))
            yield family


def _family(name: str, kind: str, doc: str, value: float | None) -> Metric:
    if kind == "counter":
        return CounterMetricFamily(name, doc, value=value)
    return GaugeMetricFamily(name, doc, value=value)
