"""Who may do what (server.auth) over the real app on a tiny LLaMA: every role on every endpoint in three
setups (admin key only; user + admin keys; a keys file with chat, train and admin keys), file and job
ownership, new versions of another key's skill, and refused requests counted in /metrics."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from skillpool.server.app import create_app
from skillpool.server.auth import KeyRing
from skillpool.trainer.service import TERMINAL, Job, JobStatus, new_job_id
from tests.adapters_store.test_store import draft
from tests.conftest import until
from tests.datasets import sst2_lines

KEYS_FILE = """# NAME ROLE KEY
alice chat  k-alice-0001
bob   train k-bob-00002
carol train k-carol-003   # a second trainer: bob's files and jobs are not hers

root  admin k-root-00004
"""
BEARER = {
    "alice": "k-alice-0001",
    "bob": "k-bob-00002",
    "carol": "k-carol-003",
    "root": "k-root-00004",
    "user": "k-user-00005",
    "unknown": "k-nobody-006",
}
NO_FILE, NO_JOB = "file-" + "0" * 24, "job-" + "0" * 20
CHAT = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
BAD_JSONL = b"not json\n"
DEFAULT_MAX_TOKENS = 2  # the conftest server's default answer length

# (method, path, request keywords) -> status for: no key (when chat is open), a chat key, the train key that
# owns {file} and {job} (bob), another train key (carol), an admin key. A role below the need: 403; no key
# where one is needed, or an unknown key: 401; another key's file or job: 404, as if it did not exist.
MATRIX: list[tuple[str, str, dict[str, Any], tuple[int, int, int, int, int]]] = [
    ("POST", "/v1/chat/completions", {"json": CHAT}, (200, 200, 200, 200, 200)),
    ("GET", "/v1/models", {}, (200, 200, 200, 200, 200)),
    ("GET", "/v1/models/tiny-llama", {}, (200, 200, 200, 200, 200)),
    ("DELETE", "/v1/models/tiny-llama", {}, (401, 403, 403, 403, 400)),
    ("POST", "/v1/models/nope/rollback", {}, (401, 403, 403, 403, 404)),
    ("GET", "/v1/skillpool/fallback_clusters", {}, (401, 403, 403, 403, 200)),
    (
        "POST",
        "/v1/files",
        {"files": {"file": ("a.jsonl", BAD_JSONL)}, "data": {"purpose": "x"}},
        (401, 403, 400, 400, 400),
    ),
    ("GET", "/v1/files", {}, (401, 200, 200, 200, 200)),
    ("GET", "/v1/files/{file}", {}, (401, 404, 200, 404, 200)),
    ("GET", "/v1/files/{file}/content", {}, (401, 404, 200, 404, 200)),
    ("DELETE", f"/v1/files/{NO_FILE}", {}, (401, 403, 404, 404, 404)),
    (
        "POST",
        "/v1/fine_tuning/jobs",
        {"json": {"model": "tiny-llama", "training_file": NO_FILE}},
        (401, 403, 400, 400, 400),
    ),
    (
        "POST",
        "/v1/fine_tuning/jobs",
        {"json": {"model": "tiny-llama", "training_file": "{file}", "metadata": {"force": "true"}}},
        (401, 403, 403, 400, 200),  # force is the admin's; carol may not even name bob's file
    ),
    ("GET", "/v1/fine_tuning/jobs", {}, (401, 200, 200, 200, 200)),
    ("GET", "/v1/fine_tuning/jobs/{job}", {}, (401, 404, 200, 404, 200)),
    ("GET", "/v1/fine_tuning/jobs/{job}/events", {}, (401, 404, 200, 404, 200)),
    ("GET", "/v1/fine_tuning/jobs/{job}/checkpoints", {}, (401, 404, 200, 404, 200)),
    ("POST", "/v1/fine_tuning/jobs/{job}/cancel", {}, (401, 403, 409, 404, 409)),
    ("POST", "/tasks", {"data": {"name": "new-skill"}, "files": {"x": ("x", b"")}}, (401, 403, 400, 400, 400)),
    (
        "POST",
        "/tasks",
        {"data": {"name": "new-skill", "force": "true"}, "files": {"file": ("a.jsonl", BAD_JSONL)}},
        (401, 403, 403, 403, 400),
    ),
    ("GET", "/tasks", {}, (401, 200, 200, 200, 200)),
    (
        "POST",
        "/v1/skills/import",
        {"data": {"name": "new-skill"}, "files": {"x": ("x", b"")}},
        (401, 403, 400, 400, 400),
    ),
    (
        "POST",
        "/v1/skills/import",
        {"data": {"name": "new-skill", "force": "true"}, "files": {"examples": ("e.jsonl", BAD_JSONL)}},
        (401, 403, 403, 403, 400),
    ),
    ("POST", "/v1/load_lora_adapter", {"json": {"lora_name": "x", "lora_path": "/x"}}, (401, 403, 400, 400, 400)),
    ("POST", "/v1/unload_lora_adapter", {"json": {"lora_name": "nope"}}, (401, 403, 403, 403, 404)),
    ("GET", "/v1/models/nope/adapter", {}, (404, 404, 404, 404, 404)),
    ("GET", "/tasks/{job}", {}, (401, 404, 200, 404, 200)),
    ("DELETE", "/tasks/{job}", {}, (401, 403, 409, 404, 409)),
]
COLUMN = {"anonymous": 0, "chat": 1, "owner": 2, "other": 3, "admin": 4}
# setup -> (the KeyRing, its callers: caller -> (bearer name or None, matrix column))
SETUPS: dict[str, tuple[dict[str, Any], dict[str, tuple[str | None, str]]]] = {
    "admin-only": (
        {"admin_key": BEARER["root"]},
        {"anonymous": (None, "anonymous"), "unknown": ("unknown", "-"), "admin": ("root", "admin")},
    ),
    "user+admin": (
        {"api_key": BEARER["user"], "admin_key": BEARER["root"]},
        {"anonymous": (None, "-"), "unknown": ("unknown", "-"), "chat": ("user", "chat"), "admin": ("root", "admin")},
    ),
    "keys-file": (
        {"path": "KEYS_FILE"},
        {
            "anonymous": (None, "-"),
            "unknown": ("unknown", "-"),
            "chat": ("alice", "chat"),
            "owner": ("bob", "owner"),
            "other": ("carol", "other"),
            "admin": ("root", "admin"),
        },
    ),
}


@pytest.fixture(scope="module")
def owned(components) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """A file and a finished job that bob's key created."""
    f = components.files.create("bob.jsonl", "fine-tune", BAD_JSONL, owner="bob")
    job = Job(id=new_job_id(), skill="bobs", method="isolated", config={}, status=JobStatus.FAILED, owner="bob")
    components.jobs.add(job)
    return {"file": f.id, "job": job.id}


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    path = Path(tmp_path_factory.mktemp("keys")) / "keys"
    path.write_text(KEYS_FILE)
    return path


@pytest.fixture(scope="module", params=list(SETUPS))
def setup(request, components, keys_file: Path) -> Iterator[tuple[str, TestClient]]:  # type: ignore[no-untyped-def]
    kw = dict(SETUPS[request.param][0])
    if "path" in kw:
        kw["path"] = keys_file
    with TestClient(create_app(components, KeyRing(**kw))) as http:
        yield request.param, http


def headers(bearer: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {BEARER[bearer]}"} if bearer else {}


def fill(value: Any, ids: dict[str, str]) -> Any:
    if isinstance(value, str):
        return value.format(**ids) if "{" in value else value
    if isinstance(value, dict):
        return {k: fill(v, ids) for k, v in value.items()}
    return value


@pytest.mark.parametrize("row", MATRIX, ids=[f"{m} {p}" for m, p, _, _ in MATRIX])
def test_every_role_on_every_endpoint(setup, owned, row) -> None:  # type: ignore[no-untyped-def]
    name, http = setup
    method, path, kw, statuses = row
    for caller, (bearer, column) in SETUPS[name][1].items():
        want = statuses[COLUMN[column]] if column in COLUMN else 401
        r = http.request(method, fill(path, owned), headers=headers(bearer), **fill(kw, owned))
        assert r.status_code == want, f"{name} {caller}: {method} {path} -> {r.status_code} {r.text[:300]}"
        if want in (401, 403):
            err = r.json()["error"]
            assert err["code"] == ("invalid_api_key" if want == 401 else "permission_denied"), err
            assert want == 401 or " role " in err["message"], err  # a 403 names the role it needs


def test_files_and_jobs_belong_to_their_key(components, keys_file: Path) -> None:  # type: ignore[no-untyped-def]
    with TestClient(create_app(components, KeyRing(path=keys_file))) as http:
        upload = {"files": {"file": ("mine.jsonl", BAD_JSONL)}, "data": {"purpose": "fine-tune"}}
        f = http.post("/v1/files", headers=headers("bob"), **upload).json()["id"]
        body = {"model": "tiny-llama", "training_file": f}
        job = http.post("/v1/fine_tuning/jobs", headers=headers("bob"), json=body).json()["id"]

        def listed(who: str, path: str) -> set[str]:
            return {x["id"] for x in http.get(path, headers=headers(who)).json()["data"]}

        for path, mine in (("/v1/files", f), ("/v1/fine_tuning/jobs", job), ("/tasks", job)):
            assert mine in listed("bob", path) and mine in listed("root", path), path
            assert mine not in listed("carol", path) and mine not in listed("alice", path), path
        record = json.loads((components.cfg.storage.data_dir / "jobs" / f"{job}.json").read_text())
        assert record["owner"] == "bob" and BEARER["bob"] not in json.dumps(record)  # the name, never the key
        assert json.loads((components.files.dir / f"{f}.json").read_text())["owner"] == "bob"
        assert http.get(f"/v1/files/{f}/content", headers=headers("bob")).content == BAD_JSONL
        assert http.delete(f"/v1/files/{f}", headers=headers("carol")).status_code == 404
        assert http.delete(f"/v1/files/{f}", headers=headers("bob")).status_code == 200
        assert http.get(f"/v1/files/{f}", headers=headers("root")).status_code == 404  # gone


def test_a_train_key_extends_only_its_own_skills(components, keys_file: Path) -> None:  # type: ignore[no-untyped-def]
    rec = components.store.write(draft("bobs-skill"))
    meta = json.loads((rec.path / "meta.json").read_text())
    (rec.path / "meta.json").write_text(json.dumps({**meta, "owner": "bob"}))  # as bob's job would record it
    with TestClient(create_app(components, KeyRing(path=keys_file))) as http:

        def new_version(who: str, flag: str = "true") -> Any:
            data = {"name": "bobs-skill", "new_version": flag}
            return http.post("/tasks", headers=headers(who), data=data, files={"file": ("a.jsonl", BAD_JSONL)})

        r = new_version("carol")
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied", r.text
        assert new_version("carol", "false").status_code == 409  # an existing name: skill_exists, as ever
        for who in ("bob", "root"):  # past the check: the bad dataset is what stops them
            assert new_version(who).json()["error"]["code"] == "invalid_dataset"


def test_a_trained_skill_records_the_key_that_created_it(components, keys_file: Path) -> None:  # type: ignore[no-untyped-def]
    with TestClient(create_app(components, KeyRing(path=keys_file))) as http:
        data = {"name": "roots-skill", "force": "true", "config": json.dumps({"epochs": 1, "max_seq_len": 256})}
        r = http.post("/tasks", headers=headers("root"), data=data, files={"file": ("s.jsonl", sst2_lines(12))})
        assert r.status_code == 202, r.text
        job = r.json()["id"]
        until(lambda: http.get(f"/tasks/{job}", headers=headers("root")).json()["status"] in TERMINAL, 300)
        assert http.get(f"/tasks/{job}", headers=headers("root")).json()["status"] == "succeeded"
        assert components.store.versions("roots-skill")[0].meta["owner"] == "root"
        again = {"name": "roots-skill", "new_version": "true"}
        r = http.post("/tasks", headers=headers("bob"), data=again, files={"file": ("a.jsonl", BAD_JSONL)})
        assert r.status_code == 403, r.text


def test_refused_requests_are_counted(components) -> None:  # type: ignore[no-untyped-def]
    def count(status: str) -> float:
        text = http.get("/metrics").text
        line = f'skillpool_requests_total{{endpoint="/v1/files/{{file_id}}",status="{status}"}}'
        return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(line))

    with TestClient(create_app(components, KeyRing("k-user-00005", "k-root-00004"))) as http:
        http.headers["authorization"] = f"Bearer {BEARER['root']}"  # /metrics: the admin may read it
        before = count("401"), count("403")
        assert http.get(f"/v1/files/{NO_FILE}", headers=headers("unknown")).status_code == 401
        assert http.delete(f"/v1/files/{NO_FILE}", headers=headers("user")).status_code == 403
        assert (count("401"), count("403")) == (before[0] + 1, before[1] + 1)


def test_rollback_takes_no_bool_for_a_version(components) -> None:  # type: ignore[no-untyped-def]
    with TestClient(create_app(components)) as http:
        r = http.post("/v1/models/bobs-skill/rollback", json={"version": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "version", r.text


def test_without_keys_everyone_may_do_everything(components, owned) -> None:  # type: ignore[no-untyped-def]
    with TestClient(create_app(components)) as http:  # single-tenant, as before keys: any bearer is ignored
        assert http.get(f"/v1/files/{owned['file']}", headers=headers("unknown")).status_code == 200
        assert http.get("/v1/skillpool/fallback_clusters").status_code == 200
        assert http.post("/v1/models/nope/rollback").status_code == 404


SCRAPER = "k-scrape-0007"  # --metrics-api-key: a key with role metrics, named metrics


@pytest.mark.parametrize("opened", [False, True])
def test_metrics_needs_a_metrics_or_admin_key_unless_the_operator_opens_it(
    components, keys_file: Path, opened: bool
) -> None:  # type: ignore[no-untyped-def]
    ring = KeyRing(path=keys_file, metrics_key=SCRAPER, open_metrics=opened)
    with TestClient(create_app(components, ring)) as http:
        http.post("/v1/chat/completions", json=CHAT, headers=headers("alice"))  # a series to show
        callers = {None: 401, "unknown": 401, "alice": 403, "bob": 403, "root": 200}
        for bearer, status in [*callers.items(), ("scraper", 200)]:
            auth = {"authorization": f"Bearer {SCRAPER}"} if bearer == "scraper" else headers(bearer)
            r = http.get("/metrics", headers=auth)
            want = 200 if opened else status
            assert r.status_code == want, (bearer, opened, r.text[:200])
            assert ("skillpool_requests_total" in r.text) == (want == 200)  # a refusal shows no series
            if want != 200 and bearer != "unknown":  # an unknown key is refused as such, whatever it asks
                err = r.json()["error"]
                assert "role metrics or admin" in err["message"] and err["code"] in (
                    "invalid_api_key",
                    "permission_denied",
                )


def test_without_keys_metrics_is_open(components) -> None:  # type: ignore[no-untyped-def]
    with TestClient(create_app(components)) as http:
        assert http.get("/metrics").status_code == 200


@pytest.mark.parametrize("row", MATRIX, ids=[f"{m} {p}" for m, p, _, _ in MATRIX])
def test_a_metrics_key_may_do_nothing_more_than_no_key(components, owned, row) -> None:  # type: ignore[no-untyped-def]
    """Beside an admin key alone (chat open to callers without a key) and beside chat keys (nothing open)."""
    method, path, kw, statuses = row
    for ring, anonymous in (
        (KeyRing(admin_key=BEARER["root"], metrics_key=SCRAPER), statuses[0]),
        (KeyRing(BEARER["user"], BEARER["root"], metrics_key=SCRAPER), 401),
    ):
        with TestClient(create_app(components, ring)) as http:
            r = http.request(
                method, fill(path, owned), headers={"authorization": f"Bearer {SCRAPER}"}, **fill(kw, owned)
            )
            assert r.status_code == (403 if anonymous == 401 else anonymous), (method, path, r.text[:300])
