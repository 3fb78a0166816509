"""Prometheus metrics (skillpool_ prefix, base units, _total counters), one registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("skillpool_requests_total", "HTTP requests", ["endpoint", "status"], registry=r)
        self.request_seconds = Histogram(
            "skillpool_request_duration_seconds",
            "End-to-end request latency",
            ["endpoint"],
            buckets=_LATENCY,
            registry=r,
        )
        self.ttft = Histogram(
            "skillpool_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY, registry=r
        )
        self.inter_token = Histogram(
            "skillpool_inter_token_seconds",
            "Mean time between generated tokens per request",
            buckets=_LATENCY,
            registry=r,
        )
        self.tokens = Counter("skillpool_tokens_total", "Tokens processed", ["kind"], registry=r)
        self.route_decisions = Counter(
            "skillpool_route_decisions_total",
            "Requests routed, per skill (top-1) and reason",
            ["skill", "reason"],
            registry=r,
        )
        self.route_weight = Counter(
            "skillpool_route_weight_total", "Sum of mix weights given to each skill", ["skill"], registry=r
        )
        self.fallbacks = Counter(
            "skillpool_route_fallbacks_total", "Auto-routed requests served by the base model", ["reason"], registry=r
        )
        self.router_seconds = Histogram(
            "skillpool_router_latency_seconds", "Router latency per batch", buckets=_LATENCY, registry=r
        )
        self.routing_wait = Histogram(
            "skillpool_routing_wait_seconds",
            "Per auto-routed request: arrival at the routing stage to its route (window, queue and embedding)",
            buckets=_LATENCY,
            registry=r,
        )
        self.router_cpu = Counter(
            "skillpool_router_cpu_seconds",
            "CPU time the routing stage's thread spent routing (embedding included when it runs on that thread)",
            registry=r,
        )
        self.router_score = Histogram(
            "skillpool_router_score",
            "Best key cosine score per routed request",
            buckets=[i / 10 for i in range(-2, 11)],
            registry=r,
        )
        self.batch_size = Histogram(
            "skillpool_batch_size", "Rows in each engine decode step", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r
        )
        self.queue_depth = Gauge("skillpool_queue_depth", "Requests waiting for the engine", registry=r)
        self.running = Gauge("skillpool_requests_running", "Requests in the engine's running batch", registry=r)
        self.skills = Gauge("skillpool_skills", "Skills registered and routable", registry=r)
        self.training_jobs = Counter(
            "skillpool_training_jobs_total", "Training jobs finished, by status", ["status"], registry=r
        )
        self.training_queue = Gauge("skillpool_training_jobs_pending", "Training jobs queued or running", registry=r)
        self.trainer_up = Gauge(  # labelled, so a server without a trainer (Redis workers train) exports none
            "skillpool_trainer_up",
            "1 while this server's trainer thread runs, 0 once it died (uploads queue but never train)",
            ["queue"],
            registry=r,
        )
        self.training_loss = Gauge("skillpool_training_loss", "Latest smoothed training loss", ["skill"], registry=r)
        self.training_tokens_per_s = Gauge(
            "skillpool_training_tokens_per_second", "Training throughput", ["skill"], registry=r
        )
        self.labelled = Counter(
            "skillpool_labelled_requests_total",
            "Auto-routed requests that named the skill they expect (metadata.expected_skill), by top-1 correct",
            ["expected_skill", "correct"],
            registry=r,
        )
        self.routing_accuracy = Gauge(
            "skillpool_routing_accuracy",
            "Share of a skill's held-out probe prompts routed to it (top-1)",
            ["skill"],
            registry=r,
        )
        self.fallback_clusters = Gauge(
            "skillpool_fallback_clusters",
            "Live clusters of recent requests that fell back to the base model",
            registry=r,
        )
        self.fallback_largest_cluster = Gauge(
            "skillpool_fallback_largest_cluster",
            "Recent (decayed, half-life 1 h) size of the largest fallback cluster: demand no skill serves",
            registry=r,
        )
        self.skill_eval = Gauge(
            "skillpool_skill_eval_score",
            "Held-out score of each skill at training time",
            ["skill", "metric"],
            registry=r,
        )
        self.resident_skills = Gauge(
            "skillpool_resident_skills", "Skills whose adapter weights are loaded in the engine now", registry=r
        )

    def training_progress(self, skill: str, loss: float | None, tokens_per_s: float) -> None:
        """trainer.runner.TrainingObserver: a job's latest loss and throughput as gauges."""
        if loss is not None:
            self.training_loss.labels(skill).set(loss)
        self.training_tokens_per_s.labels(skill).set(tokens_per_s)
