"""The metric names follow the conventions the dashboards and alert rules rely on (skillpool_ prefix, base
units, _total counters, latency buckets), and each app gets its own registry."""

from __future__ import annotations

from prometheus_client import generate_latest

from skillpool.server.metrics import _LATENCY, Metrics
from skillpool.trainer.jobs.job import Job
from skillpool.trainer.loop import Progress
from skillpool.trainer.records import JobStatus


def test_names_types_and_buckets_follow_the_conventions() -> None:
    metrics = Metrics()
    metrics.request_seconds.labels("chat").observe(0.1)  # a labelled family has buckets once it has a child
    families = {f.name: f for f in metrics.registry.collect()}
    assert families and all(name.startswith("skillpool_") for name in families)
    latency = set()
    for name, family in families.items():
        if family.type == "counter":  # the client exposes a counter's sample as NAME_total
            assert not name.endswith("_total")
        if family.type == "histogram" and name.endswith("_seconds"):
            bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
            assert bounds[:-1] == [float(b) for b in _LATENCY], name
            latency.add(name)
    assert {"skillpool_request_duration_seconds", "skillpool_time_to_first_token_seconds"} <= latency
    text = generate_latest(metrics.registry).decode()
    for line in (
        "# TYPE skillpool_requests_total counter",
        "# TYPE skillpool_request_duration_seconds histogram",
        "# TYPE skillpool_skills gauge",
        'skillpool_batch_size_bucket{le="128.0"} 0.0',
        'skillpool_router_score_bucket{le="-0.2"} 0.0',
    ):
        assert line in text


def test_labels_and_the_training_observer() -> None:
    metrics = Metrics()  # a second app in one process: no clash with the first registry
    metrics.requests.labels("chat", "200").inc()
    metrics.route_decisions.labels(skill="sql", reason="top1").inc(2)
    training = metrics.training
    training.training_progress("sql", Progress(1, 30, None, 120.0, None))
    training.training_progress("sql", Progress(2, 30, 0.25, 130.0, None))
    training.training_progress("sql", Progress(3, 30, None, 140.0, None))  # no loss this time: the last one stays
    value = metrics.registry.get_sample_value
    assert value("skillpool_requests_total", {"endpoint": "chat", "status": "200"}) == 1.0
    assert value("skillpool_route_decisions_total", {"skill": "sql", "reason": "top1"}) == 2.0
    assert value("skillpool_training_loss", {"skill": "sql"}) == 0.25
    assert value("skillpool_training_tokens_per_second", {"skill": "sql"}) == 140.0
    assert (
        value("skillpool_training_step", {"skill": "sql"}),
        value("skillpool_training_steps", {"skill": "sql"}),
    ) == (
        3.0,
        30.0,
    )
    assert value("skillpool_trainer_up", {"queue": "local"}) is None  # nothing until a queue is watched
    assert value("skillpool_engine_up") is None  # nor until an engine is
    training.job_ended(Job(id="job-1", skill="sql", method="isolated", config={}, status=JobStatus.FAILED))
    assert value("skillpool_training_jobs_total", {"status": "failed"}) == 1.0
    for name in ("step", "steps", "loss", "tokens_per_second"):  # the job is over: its progress is gone
        assert value(f"skillpool_training_{name}", {"skill": "sql"}) is None
