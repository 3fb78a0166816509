"""deploy/README.md's metrics table is the code's: every metric a server or a worker registers is a row with its
type and labels, and each row names a metric that process exports."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from skillpool.trainer.jobs.local_queue import LocalJobQueue
from skillpool.trainer.service import Catalog, TrainingMetrics

README = Path(__file__).resolve().parents[2] / "deploy" / "README.md"


def table() -> dict[str, tuple[str, tuple[str, ...], set[str]]]:
    """Per row: the metric's type, its labels and the processes its "Exported by" cell names."""
    section = README.read_text(encoding="utf-8").split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, tuple[str, ...], set[str]]] = {}
    for line in section.splitlines():
        if not line.startswith("| `skillpool_"):
            continue
        name, kind, labels, _meaning, by = (c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1])
        assert name.count("`") == 2 and name.strip("`") not in rows, f"one metric per row, once: {line}"
        rows[name.strip("`")] = (kind, tuple(re.findall(r"`(\w+)`", labels)), {p.strip() for p in by.split(",")})
    assert rows, "no metrics table under '## Metrics' in deploy/README.md"
    return rows


def exposed(registry: CollectorRegistry) -> dict[str, str]:
    """The names a scrape of `registry` shows, with their types (a counter's with the _total the client adds)."""
    return {f.name + ("_total" if f.type == "counter" else ""): f.type for f in registry.collect()}


def documented(process: str) -> Catalog:
    return {name: (kind, labels) for name, (kind, labels, by) in table().items() if process in by}


def test_the_server_s_metrics_are_the_table_s(client: TestClient, components) -> None:  # type: ignore[no-untyped-def]
    assert client.get("/metrics").status_code == 200
    catalog = components.metrics.catalog
    assert exposed(components.metrics.registry) == {n: kind for n, (kind, _) in catalog.items()}
    assert documented("server") == catalog


def test_the_worker_s_metrics_are_the_table_s(tmp_path: Path) -> None:
    metrics = TrainingMetrics(CollectorRegistry())  # as `skillpool worker` builds it, watching a queue
    queue = LocalJobQueue(tmp_path, runner=lambda *a: None, on_success=lambda r: None)  # type: ignore[arg-type,return-value]  # never runs a job
    metrics.watch(queue, "local")
    try:
        assert exposed(metrics.registry) == {n: kind for n, (kind, _) in metrics.catalog.items()}
        assert documented("worker") == metrics.catalog
    finally:
        queue.close()


def test_every_row_is_exported_by_someone() -> None:
    assert all(by and by <= {"server", "worker"} for _, _, by in table().values())
