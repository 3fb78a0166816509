"""`skillpool import DIR --name NAME --examples FILE` against a real server (uvicorn on a free port, the tiny LLaMA):
a folder PEFT saved is imported and followed to its end (exit 0), only its two PEFT files travel, and a refused
import exits 1 with the server's message."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from skillpool.cli.main import main
from skillpool.evaluation.import_adapter import pack
from skillpool.lora.peft_archive import read_tar
from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.server.config import ServerConfig
from tests.conftest import served
from tests.peft_adapters import opposite_rows, train_peft


@pytest.fixture(scope="module")
def server(tiny_base, embedder, tmp_path_factory) -> Iterator[tuple[str, object]]:  # type: ignore[no-untyped-def]
    c = build_components(ServerConfig.of(data_dir=tmp_path_factory.mktemp("data")), base=tiny_base, embedder=embedder)
    with served(create_app(c)) as url:
        yield url, c
    c.close()


def test_a_peft_folder_is_imported_and_followed_to_its_end(server, tiny_base, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    url, c = server
    folder = train_peft(tiny_base.path, tmp_path / "my-adapter", steps=2)
    assert read_tar(pack(folder), 10**8).keys() == {"adapter_config.json", "adapter_model.safetensors"}
    examples = tmp_path / "examples.jsonl"
    examples.write_text("\n".join(json.dumps(r) for r in opposite_rows(answers=False)))
    args = ["import", str(folder), "--name", "opposites", "--examples", str(examples), "--url", url]
    assert main(args) == 0
    job = json.loads(capsys.readouterr().out)
    assert job["status"] == "succeeded" and job["method"] == "imported" and job["skill"] == "opposites"
    assert c.store.serving("opposites").meta["training"]["method"] == "imported"
    assert main(args) == 1  # the name exists now: the server's 409 is printed
    assert "skill_exists" in capsys.readouterr().err
    (folder / "adapter_model.safetensors").unlink()
    assert main([*args[:3], "other", *args[4:]]) == 1
    assert "adapter_missing_file" in capsys.readouterr().err
    assert main(["import", str(tmp_path / "nowhere"), "--name", "x", "--examples", str(examples), "--url", url]) == 1
