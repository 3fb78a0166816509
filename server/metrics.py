"""Prometheus metrics (skillpool_ prefix, base units, _total counters), one registry per app."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_BATCH_ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
_COSINE = tuple(i / 10 for i in range(-2, 11))


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
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
        self.queue_depth = gauge("skillpool_queue_depth", "Requests waiting for the engine")
        self.running = gauge("skillpool_requests_running", "Requests in the engine's running batch")
        self.skills = gauge("skillpool_skills", "Skills registered and routable")
        self.training_jobs = counter("skillpool_training_jobs_total", "Training jobs finished, by status", "status")
        self.training_queue = gauge("skillpool_training_jobs_pending", "Training jobs queued or running")
        self.trainer_up = gauge(  # labelled, so a server without a trainer (Redis workers train) exports none
            "skillpool_trainer_up",
            "1 while this server's trainer thread runs, 0 once it died (uploads queue but never train)",
            "queue",
        )
        self.training_loss = gauge("skillpool_training_loss", "Latest smoothed training loss", "skill")
        self.training_tokens_per_s = gauge("skillpool_training_tokens_per_second", "Training throughput", "skill")
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
        self.resident_skills = gauge(
            "skillpool_resident_skills", "Skills whose adapter weights are loaded in the engine now"
        )

    def _counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)

    def _histogram(self, name: str, doc: str, *labels: str, buckets: Sequence[float] = _LATENCY) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def training_progress(self, skill: str, loss: float | None, tokens_per_s: float) -> None:
        """trainer.jobs.runner.TrainingObserver: a job's latest loss and throughput as gauges."""
        if loss is not None:
            self.training_loss.labels(skill).set(loss)
        self.training_tokens_per_s.labels(skill).set(tokens_per_s)
