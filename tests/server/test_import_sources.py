"""Where an import may read an adapter on the server's side (server/imports/sources.py): only inside the folders and
s3:// prefixes the operator allowed, however the path is spelt (`..`, links, a sibling that shares a prefix), and from
a real S3 endpoint (moto's server) with the same file rules as a folder."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from skillpool.lora.adapter import AdapterRejected
from skillpool.server.errors import APIError
from skillpool.server.imports.sources import read_path
from tests.s3 import MotoServer, aws_env, make_bucket

FILES = {"adapter_config.json": b'{"peft_type": "LORA"}', "adapter_model.safetensors": b"weights"}


def peft_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for name, data in FILES.items():
        (folder / name).write_bytes(data)
    return folder


def not_allowed(raw: str, setting: str | None) -> str:
    with pytest.raises(APIError) as e:
        read_path(raw, setting, 1000, "lora_path")
    assert (e.value.status, e.value.param, e.value.code) == (400, "lora_path", "adapter_path_not_allowed")
    return e.value.message


def test_a_folder_is_read_only_inside_an_allowed_one(tmp_path: Path) -> None:
    allowed, other = tmp_path / "adapters", tmp_path / "adapters-private"
    inside, outside = peft_folder(allowed / "a"), peft_folder(other / "b")
    assert read_path(str(inside), f"{allowed}, s3://b/p", 1000, "lora_path") == (FILES, "folder")
    assert "--allowed-adapter-paths" in not_allowed(str(inside), None)
    for spelt in (str(outside), f"{allowed}/../adapters-private/b", "adapters/a", str(tmp_path)):
        not_allowed(spelt, str(allowed))
    os.symlink(outside, allowed / "link")
    not_allowed(str(allowed / "link"), str(allowed))  # resolved before it is compared
    (inside / "optimizer.bin").write_bytes(b"pickle")
    with pytest.raises(AdapterRejected) as e:
        read_path(str(inside), str(allowed), 1000, "lora_path")
    assert e.value.code == "adapter_pickle"


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoServer]:
    server = MotoServer()
    yield server
    server.stop()


def test_an_s3_prefix_is_read_only_under_an_allowed_one(moto: MotoServer) -> None:
    with aws_env(moto.env()):
        client = make_bucket("models")
        for name, data in FILES.items():
            client.put_object(Bucket="models", Key=f"adapters/team/a/{name}", Body=data)
        client.put_object(Bucket="models", Key="adapters/team/b/adapter_config.json", Body=b"{}")
        client.put_object(Bucket="models", Key="adapters/team/b/nested/x", Body=b"{}")
        client.put_object(Bucket="models", Key="adapters-other/a/adapter_config.json", Body=b"{}")
        assert read_path("s3://models/adapters/team/a", "s3://models/adapters", 1000, "p") == (FILES, "s3")
        assert read_path("s3://models/adapters/team/a/", "/srv,s3://models/adapters/", 1000, "p")[0] == FILES
        for url in ("s3://models/adapters-other/a", "s3://other/adapters/team/a", "s3://models/adapters/../x"):
            not_allowed(url, "s3://models/adapters")
        not_allowed("s3://models/adapters/team/a", "/srv")  # a folder allows no bucket
        with pytest.raises(AdapterRejected) as e:
            read_path("s3://models/adapters/team/b", "s3://models/adapters", 1000, "p")
        assert e.value.code == "adapter_extra_file" and "nested" in str(e.value)
        with pytest.raises(AdapterRejected) as e:
            read_path("s3://models/adapters/team/none", "s3://models/adapters", 1000, "p")
        assert e.value.code == "adapter_missing_file"
        with pytest.raises(AdapterRejected) as e:
            read_path("s3://models/adapters/team/a", "s3://models/adapters", 10, "p")
        assert e.value.code == "adapter_too_large"
