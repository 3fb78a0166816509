"""load_tests/gpu_session.sh refuses a call it cannot run before it starts any engine: GPU time is never spent on
a typo in the last call's command. (Its parts themselves are rehearsed by test_gpu_acceptance and
test_bench_vllm_mixes in the vllm tier.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "load_tests" / "gpu_session.sh"


def session(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def base_config(tmp_path: Path) -> Path:
    folder = tmp_path / "base-config"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--rehearse", "mixes"], "unknown argument mixes (parts: mix, serve, route, answers, answers-before)"),
        (["--rehearse"], "name at least one part: mix, serve, route, answers, answers-before"),
        (["--serve"], "unknown argument --serve"),
    ],
)
def test_a_wrong_part_is_refused_before_anything_runs(
    tmp_path: Path, base_config: Path, args: list[str], says: str
) -> None:
    out = tmp_path / "out"
    run = session(str(out), "--base-config", str(base_config), *args)
    assert run.returncode == 2
    assert says in run.stderr
    assert not out.exists()


def test_a_missing_base_config_is_refused_before_anything_runs(tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = session(str(out), "--base-config", str(tmp_path / "nowhere"), "mix")
    assert run.returncode == 2
    assert f"no SmolLM2 config in {tmp_path / 'nowhere'} (--base-config)" in run.stderr
    assert not out.exists()


def test_the_answers_parts_need_the_carried_tasks(tmp_path: Path, base_config: Path) -> None:
    out, empty = tmp_path / "out", tmp_path / "datasets"
    empty.mkdir()
    for part in ("answers", "answers-before"):
        run = session(str(out), "--base-config", str(base_config), "--datasets", str(empty), "mix", part)
        assert run.returncode == 2
        assert f"no task folders in {empty} (--datasets)" in run.stderr
        assert not out.exists()
