"""OpenAI's fine-tuning surface on a tiny LLaMA, called with the real `openai` client over the app (its
transport is the TestClient): files, jobs, events, checkpoints, the fine-tuned model in chat and /v1/models,
retire and rollback. Every response is parsed into the `openai` package's own types."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI
from openai.types import FileDeleted, FileObject, Model, ModelDeleted
from openai.types.fine_tuning import FineTuningJob, FineTuningJobEvent
from openai.types.fine_tuning.jobs import FineTuningJobCheckpoint

from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.trainer.events import Resync
from tests.conftest import strict, wait_fine_tuning
from tests.datasets import sst2_lines

FAST = {"n_epochs": 1, "batch_size": 8}
DEFAULT_MAX_TOKENS = 4  # the conftest server's default answer length
SETTINGS = {"force": "true", "config": json.dumps({"max_seq_len": 256})}  # a random tiny model learns nothing


@pytest.fixture(scope="module")
def http(components) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    with TestClient(create_app(components)) as cl:
        yield cl


@pytest.fixture(scope="module")
def client(http: TestClient) -> OpenAI:
    return OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def wait(client: OpenAI, job_id: str, timeout: float = 300) -> FineTuningJob:
    job: FineTuningJob = wait_fine_tuning(client, job_id, timeout, poll_s=0.3)
    return job


def envelope(http: TestClient, method: str, path: str, status: int, param: str | None, **kw: Any) -> dict[str, Any]:
    r = http.request(method, path, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["param"] == param
    return dict(err)


def test_files_round_trip(client: OpenAI, http: TestClient) -> None:
    f = strict(client.files.create(file=("sst2.jsonl", sst2_lines(12)), purpose="fine-tune"))
    assert isinstance(f, FileObject) and f.purpose == "fine-tune" and f.bytes == len(sst2_lines(12))
    assert FileObject.model_validate(http.get(f"/v1/files/{f.id}").json()) == f
    assert f.id in [strict(x).id for x in client.files.list()]
    assert client.files.content(f.id).content == sst2_lines(12)
    deleted = strict(client.files.delete(f.id))
    assert isinstance(deleted, FileDeleted) and deleted.deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    envelope(http, "POST", "/v1/files", 400, "purpose", files={"file": ("a.jsonl", b"{}")}, data={"purpose": "batch"})
    envelope(http, "GET", "/v1/files/file-nope/content", 404, "file_id")


def test_job_trains_a_skill_that_chat_and_models_serve(client: OpenAI, http: TestClient, components) -> None:  # type: ignore[no-untyped-def]
    f = client.files.create(file=("sst2.jsonl", sst2_lines(40)), purpose="fine-tune")
    valid = client.files.create(file=("valid.jsonl", b"\n".join(sst2_lines(52).splitlines()[40:])), purpose="fine-tune")
    job = strict(
        client.fine_tuning.jobs.create(
            model="tiny-llama",
            training_file=f.id,
            validation_file=valid.id,
            suffix="sst",
            seed=7,
            hyperparameters=FAST,
            metadata=SETTINGS,
        )
    )
    assert job.status in ("validating_files", "queued", "running") and job.error is None
    FineTuningJob.model_validate(http.get(f"/v1/fine_tuning/jobs/{job.id}").json())
    done = wait(client, job.id)
    assert done.status == "succeeded", done
    short = job.id[-8:]
    assert done.fine_tuned_model == f"ft:tiny-llama:sst:{short}" and done.trained_tokens and done.trained_tokens > 0
    assert done.seed == 7 and done.hyperparameters.n_epochs == 1 and done.hyperparameters.batch_size == 8
    assert done.finished_at and done.training_file == f.id and done.validation_file == valid.id

    events = [strict(e) for e in client.fine_tuning.jobs.list_events(job.id, limit=100).data]
    assert all(isinstance(e, FineTuningJobEvent) for e in events)
    messages = [e.message for e in reversed(events)]  # listed newest first
    assert messages[0] == f"Created fine-tuning job: {job.id}" and messages[-1] == "The job has successfully completed"
    assert any(m.startswith("Validating training file") for m in messages)
    assert "Fine-tuning job started" in messages
    steps = [e for e in events if e.type == "metrics" and e.data and "step" in e.data]  # type: ignore[operator]
    assert steps and all(e.data["train_loss"] is not None for e in steps)  # type: ignore[index]
    gate = [e for e in events if e.message.startswith("Evaluation")]
    assert gate and "quality gate failed (forced)" in gate[0].message
    assert gate[0].data["quality"]["new"]["n"] == 12  # type: ignore[index]  # the validation file is the held-out split
    assert components.store.get(f"sst-{short}").meta["samples"]["train"] == 40  # and all 40 training rows trained
    page = client.fine_tuning.jobs.list_events(job.id, limit=2)
    assert len(page.data) == 2 and page.has_more

    [ckpt] = [strict(c) for c in client.fine_tuning.jobs.checkpoints.list(job.id).data]
    assert isinstance(ckpt, FineTuningJobCheckpoint) and ckpt.fine_tuning_job_id == job.id
    assert ckpt.fine_tuned_model_checkpoint == done.fine_tuned_model and ckpt.step_number > 0

    model = done.fine_tuned_model
    assert model in [strict(m).id for m in client.models.list()]
    info = http.get(f"/v1/models/{model}").json()
    Model.model_validate(info)
    assert info["skill"] == f"sst-{short}" and info["versions"][0]["serving"] and info["quality"]["forced"]
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert raw.headers["x-skillpool-route"] == f"sst-{short}=1.00" and raw.parse().model == model

    # retire: not listed, not forced (404), not routed; rollback serves it again
    assert isinstance(strict(client.models.delete(model)), ModelDeleted)
    assert model not in [m.id for m in client.models.list()]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert f"sst-{short}" not in components.router.skills
    with pytest.raises(openai.NotFoundError):
        client.models.delete(model)
    back = http.post(f"/v1/models/{model}/rollback", json={"version": 1})
    assert back.status_code == 200 and back.json()["version"] == 1, back.text
    assert model in [m.id for m in client.models.list()] and f"sst-{short}" in components.router.skills
    envelope(http, "POST", f"/v1/models/{model}/rollback", 404, "version", json={"version": 5})
    envelope(http, "DELETE", "/v1/models/tiny-llama", 400, "model")


def test_a_resync_catches_up_with_the_store(components) -> None:  # type: ignore[no-untyped-def]
    """A retire or rollback whose event this server missed: the periodic resync follows the shared store."""
    [name] = [rec.name for rec in components.pool.records()]  # served again after the rollback above
    components.store.retire(name)  # as another server does; no event reaches this one
    components.pool.on_event(Resync())
    assert components.pool.get(name) is None and name not in components.router.skills
    components.store.activate(name)
    components.pool.on_event(Resync())
    assert components.pool.get(name) is not None and name in components.router.skills


def test_a_bad_line_fails_the_job_naming_line_and_field(client: OpenAI) -> None:
    lines = sst2_lines(12).splitlines()
    lines[2] = json.dumps(
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 5}]}
    ).encode()
    f = client.files.create(file=("bad.jsonl", b"\n".join(lines)), purpose="fine-tune")
    done = wait(client, client.fine_tuning.jobs.create(model="tiny-llama", training_file=f.id).id)
    assert done.status == "failed" and done.error is not None, done
    assert done.error.code == "invalid_training_file" and done.error.param == "training_file"
    assert "line 3: messages[1].content: must be a string" in done.error.message
    assert client.fine_tuning.jobs.list_events(done.id).data[0].level == "error"


def test_cancel_list_and_request_errors(client: OpenAI, http: TestClient) -> None:
    f = client.files.create(file=("s.jsonl", sst2_lines(200)), purpose="fine-tune")
    job = client.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=f.id,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 20}}},
    )
    cancelled = strict(client.fine_tuning.jobs.cancel(job.id))
    assert cancelled.id == job.id
    assert wait(client, job.id).status == "cancelled"
    assert client.fine_tuning.jobs.list_events(job.id).data[0].message == "Fine-tuning job cancelled"
    envelope(http, "POST", f"/v1/fine_tuning/jobs/{job.id}/cancel", 409, "fine_tuning_job_id")

    first = client.fine_tuning.jobs.list(limit=1)
    assert len(first.data) == 1 and first.has_more and first.data[0].id == job.id  # newest first
    tagged = client.fine_tuning.jobs.list(metadata={"force": "true"}).data  # only the first job carried it
    assert len(tagged) == 1 and tagged[0].id != job.id and tagged[0].metadata == SETTINGS
    assert client.fine_tuning.jobs.list(metadata={"force": "false"}).data == []
    rest = client.fine_tuning.jobs.list(limit=100, after=job.id)
    assert job.id not in [j.id for j in rest.data] and rest.data
    assert all(isinstance(strict(j), FineTuningJob) for j in rest.data)  # /tasks jobs read back in the same shape

    body = {"model": "tiny-llama", "training_file": f.id}
    envelope(http, "POST", "/v1/fine_tuning/jobs", 400, "model", json={**body, "model": "gpt-4o"})
    envelope(http, "POST", "/v1/fine_tuning/jobs", 400, "training_file", json={**body, "training_file": "file-x"})
    envelope(http, "POST", "/v1/fine_tuning/jobs", 400, "suffix", json={**body, "suffix": "Bad Suffix"})
    envelope(
        http,
        "POST",
        "/v1/fine_tuning/jobs",
        400,
        "hyperparameters.n_epochs",
        json={**body, "hyperparameters": {"n_epochs": 0}},
    )
    envelope(
        http, "POST", "/v1/fine_tuning/jobs", 400, "metadata.method", json={**body, "metadata": {"method": "magic"}}
    )
    envelope(http, "GET", "/v1/fine_tuning/jobs/job-nope", 404, "fine_tuning_job_id")


def test_with_an_admin_key_the_chat_key_cannot_upload_or_train(components, tiny_base, embedder, tmp_path) -> None:  # type: ignore[no-untyped-def]

    cfg = components.cfg.replace(data_dir=tmp_path, api_key="user", admin_key="admin")
    c = build_components(cfg, base=tiny_base, embedder=embedder)
    try:
        with TestClient(create_app(c)) as http:
            user, admin = {"authorization": "Bearer user"}, {"authorization": "Bearer admin"}
            upload = {"files": {"file": ("s.jsonl", sst2_lines(12))}, "data": {"purpose": "fine-tune"}}
            envelope(http, "POST", "/v1/files", 403, None, headers=user, **upload)
            envelope(http, "POST", "/tasks", 403, None, files=upload["files"], data={"name": "s"}, headers=user)
            f = http.post("/v1/files", headers=admin, **upload)
            assert f.status_code == 200, f.text
            body = {"model": "tiny-llama", "training_file": f.json()["id"], "metadata": {"force": "true"}}
            envelope(http, "POST", "/v1/fine_tuning/jobs", 403, None, json=body, headers=user)
            envelope(http, "DELETE", "/v1/models/anything", 403, None, headers=user)
            chat = {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert http.post("/v1/chat/completions", json=chat, headers=user).status_code == 200
            assert http.get("/v1/models", headers=user).status_code == 200  # reads stay open to the chat key
            assert http.get("/v1/models", headers=admin).status_code == 200
            assert http.get("/v1/models", headers={"authorization": "Bearer nope"}).status_code == 401
    finally:
        c.close()
