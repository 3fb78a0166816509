"""End to end through the official `openai` client only: the real SmolLM2 + MiniLM behind `skillpool serve`.

files.create → fine_tuning.jobs.create → retrieve until succeeded → list_events → checkpoints.list → chat
with fine_tuned_model (and `auto` routes to it) → a second job cancelled → a bad file fails its job naming
the line → models.delete retires the skill (404 when forced, `auto` no longer routes to it) → rollback
restores it. Every object is re-validated strictly against the `openai` package's own types.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from skillpool.evaluation.process import ServerProcess
from tests.conftest import strict, wait_fine_tuning
from tests.datasets import dataset_dir, rows, user_text

pytestmark = pytest.mark.slow
BASE = "SmolLM2-135M-Instruct"
# Small on purpose (2 CPU cores): 60 rows, one epoch. The quality gate has its own e2e test, so this one
# registers the skill with force (the admin's metadata setting) and checks that the gate's numbers are reported.
TRAIN_ROWS = 60
# one wording beside each row: at 2 (the default) these 60 rows already pass the gate, and force is what is tested
SETTINGS = {
    "force": "true",
    "config": json.dumps({"max_eval_examples": 8, "probe_size": 4, "max_seq_len": 256, "prompt_variant_copies": 1}),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[ServerProcess]:  # type: ignore[no-untyped-def]
    dataset_dir("long_sequence", "agnews")  # skips with a message naming SKILLPOOL_DATASETS when it is unset
    with ServerProcess(tmp_path_factory.mktemp("ft-e2e") / "data") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def jsonl(items: list[dict[str, Any]]) -> bytes:
    return "\n".join(json.dumps(x) for x in items).encode()


def wait(client, job_id: str, timeout: float = 1500):  # type: ignore[no-untyped-def]
    return wait_fine_tuning(client, job_id, timeout, poll_s=2)


def routed(client, text: str) -> str:  # type: ignore[no-untyped-def]
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": text}], temperature=0, max_tokens=4
    )
    strict(raw.parse())
    return str(raw.headers.get("x-skillpool-route", ""))


def test_fine_tuning_lifecycle_through_the_openai_client(client, server: ServerProcess) -> None:  # type: ignore[no-untyped-def]
    import openai
    from openai.types import Model

    train = rows("long_sequence", "agnews", "train", TRAIN_ROWS)
    upload = strict(client.files.create(file=("agnews.jsonl", jsonl(train)), purpose="fine-tune"))
    assert upload.purpose == "fine-tune" and upload.bytes == len(jsonl(train))
    assert upload.id in [strict(f).id for f in client.files.list()]

    job = strict(
        client.fine_tuning.jobs.create(
            model=BASE, training_file=upload.id, suffix="agnews", hyperparameters={"n_epochs": 1}, metadata=SETTINGS
        )
    )
    assert job.status in ("validating_files", "queued", "running")
    done = wait(client, job.id)
    assert done.status == "succeeded", done
    model = done.fine_tuned_model
    assert model == f"ft:{BASE}:agnews:{job.id[-8:]}" and done.trained_tokens and done.trained_tokens > 0

    events = [strict(e) for e in client.fine_tuning.jobs.list_events(job.id, limit=200).data]
    steps = [e for e in events if e.type == "metrics" and "step" in (e.data or {})]
    assert steps and steps[0].data["train_loss"] is not None and steps[0].data["tokens"] > 0
    assert any(e.message.startswith("Evaluation (exact_match") for e in events)
    assert events[0].message == "The job has successfully completed"
    assert events[-1].message == f"Created fine-tuning job: {job.id}"
    [ckpt] = [strict(c) for c in client.fine_tuning.jobs.checkpoints.list(job.id).data]
    assert ckpt.fine_tuned_model_checkpoint == model and ckpt.step_number == steps[0].data["total_steps"]

    assert model in [strict(m).id for m in client.models.list()]
    answer = strict(
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    )
    assert answer.model == model
    tests = [user_text(r) for r in rows("long_sequence", "agnews", "test", 10)]
    skill = f"agnews-{job.id[-8:]}"
    assert sum(routed(client, t).startswith(f"{skill}=") for t in tests) >= 6  # `auto` routes to the new skill

    # a second job, cancelled
    second = strict(
        client.fine_tuning.jobs.create(model=BASE, training_file=upload.id, hyperparameters={"n_epochs": 20})
    )
    strict(client.fine_tuning.jobs.cancel(second.id))
    assert wait(client, second.id).status == "cancelled"

    # a bad file fails its job, naming the line and the field
    bad = train[:20]
    bad[6] = {"instruction": "Classify.", "input": "x", "output": 3}
    bad_file = strict(client.files.create(file=("bad.jsonl", jsonl(bad)), purpose="fine-tune"))
    failed = wait(client, strict(client.fine_tuning.jobs.create(model=BASE, training_file=bad_file.id)).id)
    assert failed.status == "failed" and failed.error.code == "invalid_training_file"
    assert failed.error.param == "training_file" and "line 7: output: must be a string" in failed.error.message

    # retire: gone from the list, 404 when forced, `auto` no longer routes to it; files kept
    assert strict(client.models.delete(model)).deleted
    assert model not in [m.id for m in client.models.list()]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
    assert not any(skill in routed(client, t) for t in tests)
    assert strict(client.files.retrieve(upload.id)).id == upload.id

    # rollback (admin) restores it
    restored = client.post(f"/models/{model}/rollback", body={}, cast_to=Model)
    assert strict(restored).id == model
    assert model in [m.id for m in client.models.list()]
    assert sum(routed(client, t).startswith(f"{skill}=") for t in tests) >= 6
    info = httpx.get(f"{server.url}/v1/models/{model}", timeout=30).json()
    assert [v["version"] for v in info["versions"]] == [1] and info["quality"]["forced"]
