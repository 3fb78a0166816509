"""The one job intake (server.intake) behind /tasks and /v1/fine_tuning/jobs, over the real app on a tiny LLaMA:
who may loosen the quality gate, and how many jobs the queue admits when uploads come at once, on the in-process
queue (whose trainer runs the first job) and on Redis (a server that only enqueues)."""

from __future__ import annotations

import json
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skillpool.server.app import create_app
from skillpool.server.auth import KeyRing
from skillpool.server.bootstrap import build_components
from skillpool.server.components import Components
from skillpool.server.config import ServerConfig
from skillpool.trainer.config import GATE_FIELDS, TrainConfig
from skillpool.trainer.service import TERMINAL
from tests.conftest import until
from tests.datasets import sst2_lines

BAD_JSONL = b"not json\n"  # a dataset that fails after every check of the request itself
TRAIN, ADMIN, OTHER = "k-train-0001", "k-admin-0002", "k-carol-0003"
KEYS = f"bob train {TRAIN}\nroot admin {ADMIN}\ncarol train {OTHER}\n"
# which way each of the gate's settings lets more through, as docs/skills.md#quality-gate describes them
LOOSER = {
    "quality_min_gain": "lower",
    "quality_z": "lower",
    "quality_max_drop": "higher",
    "eval_fraction": "lower",  # 0 holds no row out: the held-out check is skipped
    "max_eval_examples": "lower",  # fewer held-out rows: a lucky few pass the noise bound
}
RANGE: dict[str, tuple[float, float]] = {  # what TrainConfig accepts
    "quality_min_gain": (-1.0, 1.0),
    "quality_z": (0.0, 10.0),
    "quality_max_drop": (0.0, 1.0),
    "eval_fraction": (0.0, 0.999),
    "max_eval_examples": (1, 100_000),
}


@pytest.fixture(scope="module")
def http(components, tmp_path_factory) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(KEYS)
    with TestClient(create_app(components, KeyRing(path=keys))) as cl:
        yield cl


@pytest.fixture(scope="module")
def bobs_file(http: TestClient) -> str:
    upload = {"files": {"file": ("bad.jsonl", BAD_JSONL)}, "data": {"purpose": "fine-tune"}}
    r = http.post("/v1/files", headers={"authorization": f"Bearer {TRAIN}"}, **upload)
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def test_every_setting_of_the_gate_is_listed() -> None:
    assert set(GATE_FIELDS) == set(LOOSER)


@st.composite
def gate_values(draw: st.DrawFn) -> tuple[str, float | int, bool]:
    """(field, a value TrainConfig accepts, whether it is looser than the default)."""
    field = draw(st.sampled_from(sorted(LOOSER)))
    lo, hi = RANGE[field]
    default = getattr(TrainConfig(), field)
    if isinstance(default, int):
        value: float | int = draw(st.one_of(st.integers(int(lo), int(hi)), st.sampled_from([int(lo), default])))
    else:
        value = draw(st.one_of(st.floats(lo, hi), st.sampled_from([lo, hi, default])))
    looser = value < default if LOOSER[field] == "lower" else value > default
    return field, value, looser


def _send(http: TestClient, endpoint: str, bearer: str, config: dict[str, Any], file_id: str) -> Any:
    headers = {"authorization": f"Bearer {bearer}"}
    if endpoint == "/tasks":
        data = {"name": "gate-probe", "config": json.dumps(config)}
        return http.post("/tasks", headers=headers, data=data, files={"file": ("a.jsonl", BAD_JSONL)})
    body = {"model": "tiny-llama", "training_file": file_id, "metadata": {"config": json.dumps(config)}}
    return http.post("/v1/fine_tuning/jobs", headers=headers, json=body)


@given(setting=gate_values(), endpoint=st.sampled_from(["/tasks", "/v1/fine_tuning/jobs"]))
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_a_train_key_may_tighten_the_gate_but_only_the_admin_may_loosen_it(
    http: TestClient, bobs_file: str, setting: tuple[str, float | int, bool], endpoint: str
) -> None:
    field, value, looser = setting
    param = ("config." if endpoint == "/tasks" else "metadata.config.") + field
    r = _send(http, endpoint, TRAIN, {"epochs": 1, field: value}, bobs_file)
    if looser:
        assert r.status_code == 403, (field, value, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["code"] == "permission_denied" and "role admin" in err["message"], err
    else:  # past the intake's checks: what stops /tasks is the bad dataset, a fine-tuning job is created
        assert r.status_code == (400 if endpoint == "/tasks" else 200), (field, value, r.text)
        assert endpoint != "/tasks" or r.json()["error"]["code"] == "invalid_dataset", r.text
    admin = _send(http, endpoint, ADMIN, {"epochs": 1, field: value}, bobs_file)
    assert admin.status_code == (400 if endpoint == "/tasks" else 200), admin.text


def test_the_train_keys_refusal_names_the_first_loosened_field_and_creates_no_job(
    http: TestClient, components, bobs_file: str
) -> None:  # type: ignore[no-untyped-def]
    before = {j.id for j in components.jobs.list()}
    loose = {"quality_min_gain": -1, "quality_z": 0, "quality_max_drop": 1}  # the gate off, all three at once
    for endpoint in ("/tasks", "/v1/fine_tuning/jobs"):
        r = _send(http, endpoint, TRAIN, loose, bobs_file)
        assert r.status_code == 403 and r.json()["error"]["param"].endswith("config.quality_min_gain"), r.text
    assert {j.id for j in components.jobs.list()} == before


# --- the queue's room ------------------------------------------------------------------------------------------
LONG = {"epochs": 100, "max_seq_len": 64}  # the in-process trainer's first job runs for the whole burst


@pytest.fixture(scope="module", params=["local", "redis"])
def queue(
    request, components, tiny_base, embedder, redis_url, tmp_path_factory
) -> Iterator[tuple[Components, TestClient]]:  # type: ignore[no-untyped-def]
    folder = tmp_path_factory.mktemp("room")
    (folder / "keys").write_text(KEYS)
    c = components
    if request.param == "redis":
        cfg = ServerConfig.of(
            data_dir=folder / "data",
            redis_url=redis_url,
            redis_prefix=f"room-{uuid.uuid4().hex[:8]}",
            run_trainer=False,
        )
        c = build_components(cfg, base=tiny_base, embedder=embedder)
    kept = c.cfg
    try:
        with TestClient(create_app(c, KeyRing(path=folder / "keys"))) as cl:
            yield c, cl
    finally:
        _end_every_job(c)
        c.cfg = kept
        if c is not components:
            c.close()


def _end_every_job(c: Components) -> None:
    for job in c.jobs.list():
        if job.status not in TERMINAL:
            c.jobs.cancel(job.id)
    until(lambda: all(j.status in TERMINAL for j in c.jobs.list()), 60)


def _upload(http: TestClient, bearer: str, endpoint: str, file_id: str) -> Any:
    headers = {"authorization": f"Bearer {bearer}"}
    if endpoint == "/tasks":
        data = {"name": f"room-{uuid.uuid4().hex[:8]}", "config": json.dumps(LONG)}
        return http.post("/tasks", headers=headers, data=data, files={"file": ("s.jsonl", sst2_lines(12))})
    body = {"model": "tiny-llama", "training_file": file_id, "hyperparameters": {"n_epochs": 100}}
    return http.post("/v1/fine_tuning/jobs", headers=headers, json=body)


@pytest.mark.parametrize(
    ("senders", "limit", "per_key"),
    [
        ({"bob": 5}, 2, None),
        ({"bob": 9}, 4, None),
        ({"bob": 3, "carol": 3}, 1, None),
        ({"bob": 5, "carol": 4}, 6, 2),  # a share each: neither key fills the queue
        ({"bob": 2, "carol": 6}, 3, 2),
    ],
)
def test_uploads_at_once_admit_as_many_jobs_as_fit_and_the_rest_get_429_with_retry_after(
    queue: tuple[Components, TestClient], senders: dict[str, int], limit: int, per_key: int | None
) -> None:
    c, http = queue
    _end_every_job(c)
    c.cfg = c.cfg.replace(max_pending_jobs=limit, max_pending_jobs_per_key=per_key)
    bearer = {"bob": TRAIN, "carol": OTHER}
    files = {}
    for who in senders:  # each key's own file for its fine-tuning jobs
        r = http.post(
            "/v1/files",
            headers={"authorization": f"Bearer {bearer[who]}"},
            files={"file": ("s.jsonl", sst2_lines(12))},
            data={"purpose": "fine-tune"},
        )
        files[who] = r.json()["id"]
    sends = [(who, ("/tasks", "/v1/fine_tuning/jobs")[i % 2]) for who, n in senders.items() for i in range(n)]
    start, answers = threading.Barrier(len(sends)), []

    def send(who: str, endpoint: str) -> None:
        start.wait()
        answers.append((who, _upload(http, bearer[who], endpoint, files[who])))

    threads = [threading.Thread(target=send, args=s) for s in sends]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(answers) == len(sends)
    admitted = Counter(who for who, r in answers if r.status_code in (200, 202))
    refused = [r for _, r in answers if r.status_code not in (200, 202)]
    share = {who: min(n, per_key or n) for who, n in senders.items()}
    assert sum(admitted.values()) == min(limit, sum(share.values())), [r.text for _, r in answers]
    assert per_key is None or all(n <= per_key for n in admitted.values()), admitted
    for r in refused:
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_jobs", r.text
        assert int(r.headers["retry-after"]) > 0
    pending = [j for j in c.jobs.list() if j.status not in TERMINAL]
    assert len(pending) == sum(admitted.values())  # a refused upload left no job behind
