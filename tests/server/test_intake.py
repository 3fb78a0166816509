"""The one job intake (server.intake) behind /tasks and /v1/fine_tuning/jobs, over the real app on a tiny LLaMA:
who may loosen the quality gate."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skillpool.server.app import create_app
from skillpool.server.auth import KeyRing
from skillpool.trainer.config import GATE_FIELDS, TrainConfig

BAD_JSONL = b"not json\n"  # a dataset that fails after every check of the request itself
TRAIN, ADMIN = "k-train-0001", "k-admin-0002"
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
    keys.write_text(f"bob train {TRAIN}\nroot admin {ADMIN}\n")
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
