"""A server the end-to-end tests share: training a skill on the real SmolLM2 is the costliest thing they do, so
the tests that need an SST-2 skill served (the quality gate's, lm-eval's) take it from one upload."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from skillpool.evaluation.process import ServerProcess
from tests.datasets import dataset_dir, rows

# 200 rows, 60 held out: the noise on the gate's gain is about 0.07; the rows as uploaded, as the default prompt
# variants would double the training time (lm-eval asks them as uploaded, too)
SST2_ROWS = 200
SST2_CONFIG = {"epochs": 2, "eval_fraction": 0.3, "prompt_variants": 0.0}


@dataclass(frozen=True)
class Sst2Server:
    server: ServerProcess
    job: dict[str, Any]  # the upload's job as it ended (succeeded)


# package scope: the server stops once tests/e2e is done, not at the end of the whole run
@pytest.fixture(scope="package")
def sst2_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sst2Server]:
    """`skillpool serve` in its defaults with one skill, `sst-2`, learned through /tasks from SST-2's first 200
    training rows. Tests may add skills, not change or remove this one."""
    from skillpool.evaluation.tasks_client import TasksClient
    from skillpool.trainer.records import TERMINAL

    dataset_dir("long_sequence", "sst-2")  # skips with a message naming SKILLPOOL_DATASETS when it is unset
    body = "\n".join(json.dumps(r) for r in rows("long_sequence", "sst-2", "train", SST2_ROWS)).encode()
    with ServerProcess(Path(tmp_path_factory.mktemp("sst2")) / "data") as srv:
        tasks = TasksClient(srv.url)
        job = tasks.wait_for(tasks.upload("sst-2", body, config=SST2_CONFIG)["id"], TERMINAL, 3600)
        assert job["status"] == "succeeded", job
        yield Sst2Server(srv, job)
