"""End to end: the quality gate refuses a broken upload (SST-2 with its labels shuffled) on the real SmolLM2
and leaves the pool as it was; the intact upload of the same task (the shared server's sst-2, tests/e2e/conftest.py)
passed the same gate. It runs in the server's default dtype (`--dtype auto`: bfloat16 on a CPU with AVX-512 BF16
or AMX); that the trainer and the engine compute alike in float32 and bfloat16 is the dtype tests' job
(tests/trainer, tests/lora, tests/server/engines)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest

from skillpool.cli.main import main
from tests.chat import ask
from tests.datasets import rows, user_text
from tests.e2e.conftest import SST2_CONFIG, SST2_ROWS, Sst2Server

pytestmark = pytest.mark.slow


def test_shuffled_labels_are_refused_and_the_pool_is_unchanged(
    sst2_server: Sst2Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from openai import OpenAI

    srv, ok = sst2_server.server, sst2_server.job
    assert ok["eval"]["score"] >= ok["eval"]["bar"] and ok["eval"]["gain_lower_bound"] > 0 and ok["eval"]["n"] == 50
    # the broken upload: SST-2's next 200 training rows, their labels shuffled
    broken = rows("long_sequence", "sst-2", "train", 2 * SST2_ROWS)[SST2_ROWS:]
    labels = [r["output"] for r in broken]
    random.Random(0).shuffle(labels)
    broken = [{**r, "output": y} for r, y in zip(broken, labels)]
    probe = [user_text(r) for r in rows("long_sequence", "sst-2", "test", 24)]
    client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    before = ask(client, "auto", probe)

    # through `skillpool upload`, which follows the job and exits 1 when it fails
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in broken))
    capsys.readouterr()
    config = json.dumps(SST2_CONFIG)
    assert main(["upload", str(path), "--name", "sst-2-shuffled", "--url", srv.url, "--config", config]) == 1
    job = json.loads(capsys.readouterr().out)
    with capsys.disabled():
        print(json.dumps(job["eval"], indent=1))  # the numbers, for the record
    assert job["status"] == "failed" and job["error"].startswith("quality gate:"), job
    report = job["eval"]
    assert not report["passed"] and report["reasons"]
    new = report["new"]  # it learned no better than the most frequent label, give or take noise
    assert new["score"] < new["bar"] or new["gain_lower_bound"] <= 0, report
    assert report["earlier"]["sst-2"]["n"] == 20

    models = [m["id"] for m in httpx.get(srv.url + "/v1/models", timeout=30).json()["data"]]
    assert "sst-2" in models and "sst-2-shuffled" not in models
    data_dir = srv.data_dir
    assert not (data_dir / "skills" / "sst-2-shuffled").exists() and not list((data_dir / "tmp").iterdir())
    after = ask(client, "auto", probe)
    assert [h for _, h in after] == [h for _, h in before]  # same routes: nothing of the broken skill is served
    # same answers, up to a rare greedy tie flipped by a different batch composition
    assert sum(a == b for (a, _), (b, _) in zip(after, before)) >= len(probe) - 2
