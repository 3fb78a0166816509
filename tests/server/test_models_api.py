"""/v1/models and the skill lifecycle over a store with damaged records: a server starts whatever meta.json is
damaged, serves each skill's newest readable version, and rolls back to any readable one (a damaged one is a 409)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from fastapi.testclient import TestClient

from skillpool.adapters_store.store import SkillStore
from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.server.config import ServerConfig
from tests.server.test_metrics_series import store_skill


def test_a_server_starts_past_damaged_records_and_rolls_back_to_readable_versions(
    tiny_base, embedder, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    writer = SimpleNamespace(base=tiny_base, store=SkillStore(tmp_path))
    for _ in range(4):
        store_skill(writer, embedder, "reviews", "accuracy", 0.5)
    for v, damage in ((4, b'{"name": "rev'), (2, b"")):  # the served version and an older one
        (tmp_path / "skills" / "reviews" / f"v{v}" / "meta.json").write_bytes(damage)
    c = build_components(ServerConfig.of(data_dir=tmp_path), base=tiny_base, embedder=embedder)
    try:
        with TestClient(create_app(c)) as http:
            model = http.get("/v1/models/reviews").json()
            assert model["version"] == 3, model  # the newest it can read
            assert [v["version"] for v in model["versions"]] == [1, 3]
            for version, status in ((1, 200), (2, 409), (3, 200), (4, 409), (None, 200)):
                r = http.post("/v1/models/reviews/rollback", json={} if version is None else {"version": version})
                assert r.status_code == status, (version, r.text)
                if status == 409:
                    err = r.json()["error"]
                    assert err["code"] == "version_unreadable" and err["param"] == "version", err
                else:
                    assert r.json()["version"] == (version or 3)
            chat = {"model": "reviews", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            assert http.post("/v1/chat/completions", json=chat).status_code == 200
    finally:
        c.close()
