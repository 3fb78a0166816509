"""Skill store: atomic versioned writes, reload, and name safety."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from skillpool.adapters_store.names import InvalidSkillName, validate_skill_name
from skillpool.adapters_store.store import SkillDraft, SkillStore


def write_fake_peft(folder: Path) -> None:
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]})
    )
    save_file(
        {
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 8),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.ones(8, 2),
        },
        str(folder / "adapter_model.safetensors"),
    )


def draft(name: str = "agnews", writer=write_fake_peft) -> SkillDraft:  # type: ignore[no-untyped-def]
    return SkillDraft(
        name=name,
        write_adapter=writer,
        router_tensors={"centroid_keys": torch.eye(3), "threshold": torch.tensor([0.4])},
        meta={"base_model": {"id": "m", "fingerprint": "f"}, "eval": {"metric": "exact_match", "score": 0.9}},
        replay=[{"messages": [{"role": "user", "content": "hi"}], "answer": "x", "route_text": "hi"}],
        probe=[],
    )


def test_write_then_reload_from_a_new_store(tmp_path: Path) -> None:
    rec = SkillStore(tmp_path).write(draft())
    assert rec.version == 1 and rec.path == tmp_path / "skills" / "agnews" / "v1"
    again = SkillStore(tmp_path).get("agnews")
    assert again is not None and again.meta["eval"]["score"] == 0.9 and again.meta["name"] == "agnews"
    assert torch.equal(again.router_tensors()["centroid_keys"], torch.eye(3))
    assert again.replay()[0]["answer"] == "x"
    adapter = again.adapter()
    f = adapter.modules["model.layers.0.self_attn.q_proj"]
    assert f.rank == 2 and f.scaling == 2.0


def test_pseudo_inputs_round_trip_and_old_skills_without_them_still_load(tmp_path: Path) -> None:
    store = SkillStore(tmp_path)
    d = draft()
    d.pseudo = ["Classify: stocks fell", "Classify: the team won"]
    rec = store.write(d)
    assert SkillStore(tmp_path).get("agnews").pseudo() == d.pseudo  # type: ignore[union-attr]
    old = store.write(draft())  # no pseudo inputs given: an empty list, like replay
    assert old.pseudo() == []
    (rec.path / "pseudo.json").unlink()  # a skill written before pseudo.json existed
    again = SkillStore(tmp_path).get("agnews", version=rec.version)
    assert again is not None and again.pseudo() == [] and again.replay()[0]["answer"] == "x"


def test_new_upload_of_a_name_is_a_new_version_and_latest_wins(tmp_path: Path) -> None:
    store = SkillStore(tmp_path)
    store.write(draft())
    store.write(draft())
    store.write(draft("sst-2"))
    assert [(r.name, r.version) for r in store.list_latest()] == [("agnews", 2), ("sst-2", 1)]
    assert store.get("agnews", version=1) is not None
    assert store.get("agnews", version=3) is None


def test_failed_write_leaves_nothing_behind(tmp_path: Path) -> None:
    store = SkillStore(tmp_path)

    def broken(folder: Path) -> None:
        (folder / "adapter_config.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        store.write(draft(writer=broken))
    with pytest.raises(FileNotFoundError):
        store.write(draft(writer=lambda folder: None))
    assert store.list_latest() == []
    assert list((tmp_path / "tmp").iterdir()) == []
    assert not (tmp_path / "skills" / "agnews").exists() or not any((tmp_path / "skills" / "agnews").iterdir())


def test_half_written_folders_are_invisible_and_cleaned(tmp_path: Path) -> None:
    store = SkillStore(tmp_path)
    (tmp_path / "tmp" / "agnews-leftover").mkdir()
    (tmp_path / "skills" / "agnews" / "v7").mkdir(parents=True)  # no meta.json: never completed
    assert store.list_latest() == []
    store.clean_tmp()
    assert list((tmp_path / "tmp").iterdir()) == []
    assert store.write(draft()).version == 1


@pytest.mark.parametrize(
    "bad", ["", "../etc", "a/b", "Upper", "-x", "x-", "auto", "base", "a" * 65, "a..b", "sp ace", "abc\n", "\nabc"]
)
def test_bad_names_are_rejected(bad: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidSkillName):
        validate_skill_name(bad)
    with pytest.raises(InvalidSkillName):
        SkillStore(tmp_path).write(draft(bad))


@pytest.mark.parametrize("good", ["agnews", "sst-2", "task002_quoref", "a", "v1.2"])
def test_good_names_pass(good: str) -> None:
    assert validate_skill_name(good) == good


def test_local_model_dir_is_resolved_and_fingerprinted(tiny_base, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from skillpool.runtime.base_model import resolve_base_model

    bm = resolve_base_model(tiny_base.path)
    assert bm.path == tiny_base.path and bm.model_id == tiny_base.path.name and bm.fingerprint == tiny_base.fingerprint
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_base_model(tmp_path)


def test_packaged_default_model_is_converted_once(smollm) -> None:  # type: ignore[no-untyped-def]
    from skillpool.runtime.base_model import resolve_base_model

    assert smollm.model_id == "SmolLM2-135M-Instruct"
    assert (smollm.path / "model.safetensors").is_file() and (smollm.path / "tokenizer.json").is_file()
    config = json.loads((smollm.path / "config.json").read_text())
    assert config["model_type"] == "llama" and "quantization_config" not in config
    assert resolve_base_model() == smollm  # the cached conversion is reused


def test_two_stores_on_one_folder_never_overwrite_a_version(tmp_path: Path) -> None:
    """A server and a worker (two processes) writing the same skill get distinct versions."""
    a, b = SkillStore(tmp_path), SkillStore(tmp_path)
    (tmp_path / "skills" / "agnews" / "v1").mkdir(parents=True)  # another writer's complete v1 appears ...
    (tmp_path / "skills" / "agnews" / "v1" / "meta.json").write_text("{}")
    assert a.write(draft()).version == 2
    (tmp_path / "skills" / "agnews" / "v3").mkdir()  # ... and one not yet visible to _versions (no meta.json)
    (tmp_path / "skills" / "agnews" / "v3" / "x").write_text("busy")
    assert b.write(draft()).version == 4
    assert (tmp_path / "skills" / "agnews" / "v3" / "x").read_text() == "busy"


def test_staged_files_wait_for_their_job_and_a_failed_stage_leaves_nothing(tmp_path: Path) -> None:
    store = SkillStore(tmp_path)
    store.stage("job-1", write_fake_peft)
    folder = store.staged("job-1")
    assert folder is not None and (folder / "adapter_config.json").is_file()
    assert store.staged("job-2") is None and store.list_latest() == []  # staged files are no skill
    store.clean_tmp()  # this process is alive: what it staged stays for its job
    assert store.staged("job-1") == folder
    store.unstage("job-1")
    assert store.staged("job-1") is None

    def fails(folder: Path) -> None:
        (folder / "part").write_text("x")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        store.stage("job-3", fails)
    assert list(store.tmp_dir.iterdir()) == []
    with pytest.raises(ValueError):
        store.stage("../x", write_fake_peft)


def test_a_skill_without_router_keys_is_stored_and_read_back(tmp_path: Path) -> None:
    keyless = draft("pinned")
    keyless.router_tensors = {}
    rec = SkillStore(tmp_path).write(keyless)
    assert SkillStore(tmp_path).get("pinned") == rec and rec.router_tensors() == {}
    assert set(rec.adapter_files()) == {"adapter_config.json", "adapter_model.safetensors"}
