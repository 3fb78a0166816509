"""Bringing adapters in and out, on the tiny LLaMA with the real MiniLM router, in the order a user meets it: bad
imports refused with nothing stored; a LoRA trained with plain PEFT imported, answering as PEFT's own `generate` and
routed to by `auto`; its export loaded by PEFT, and imported back with equal weights; versions, rollback and retire;
the quality gate when the examples carry answers; vLLM's load_lora_adapter and unload_lora_adapter. The tests share
one server and run in file order."""

from __future__ import annotations

import copy
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load_file, save
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from skillpool.server.bootstrap import build_components
from skillpool.server.config import ServerConfig
from tests.conftest import wait_job
from tests.peft_adapters import INSTRUCTION, opposite_rows, peft_answers, tar_gz, train_peft
from tests.server.test_api import assert_error

SKILL = "opposites"
PROMPTS = [f"{INSTRUCTION}\n{w}" for w in ("hot", "strong", "good")] + ["What is the capital of France?"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def allowed(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """The folder this server may read adapters from (--allowed-adapter-paths)."""
    return Path(tmp_path_factory.mktemp("allowed"))


@pytest.fixture(scope="module")
def components(tiny_base, embedder, tmp_path_factory, allowed):  # type: ignore[no-untyped-def]
    cfg = ServerConfig.of(
        data_dir=tmp_path_factory.mktemp("data"),
        max_upload_bytes=3_000_000,
        default_max_tokens=MAX_TOKENS,
        allowed_adapter_paths=str(allowed),
    )
    c = build_components(cfg, base=tiny_base, embedder=embedder)
    yield c
    c.close()


@pytest.fixture(scope="module")
def trained(tiny_base, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """A LoRA on every projection, rsLoRA scaling, trained with plain PEFT and saved by PEFT (with its model card)."""
    folder = train_peft(tiny_base.path, Path(tmp_path_factory.mktemp("peft")) / "opposites", use_rslora=True)
    assert (folder / "README.md").is_file()
    return folder


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return "\n".join(json.dumps(r) for r in rows).encode()


EXAMPLES = jsonl(opposite_rows(answers=False))


def import_(client: TestClient, adapter: bytes | None = None, examples: bytes = EXAMPLES, **data: str):  # type: ignore[no-untyped-def]
    files: dict[str, Any] = {"examples": ("examples.jsonl", examples)}
    if adapter is not None:
        files["adapter"] = ("adapter.tar.gz", adapter)
    return client.post("/v1/skills/import", files=files, data=data)


def imported(client: TestClient, adapter: bytes | None = None, examples: bytes = EXAMPLES, **data: str) -> dict:
    r = import_(client, adapter, examples, **data)
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["method"] == "imported" and job["status"] in ("queued", "running")
    return wait_job(client, job["id"])


def answers(client: TestClient, model: str, prompts: list[str] = PROMPTS) -> list[str]:
    out = []
    for p in prompts:
        body = {
            "model": model,
            "messages": [{"role": "user", "content": p}],
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
        }
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["message"]["content"])
    return out


def route(client: TestClient, text: str) -> str:
    body = {"model": "auto", "messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": 1}
    return str(client.post("/v1/chat/completions", json=body).headers["x-skillpool-route"])


def random_peft(model: torch.nn.Module, folder: Path, **lora: Any) -> Path:
    """A LoRA on `model` with random B (PEFT starts B at zero), saved by PEFT."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(**{"r": 4, "target_modules": ["q_proj"], **lora}))
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(str(folder), save_embedding_layers=False)  # lm_head's blocks alone: a small upload
    return folder


def rewritten(folder: Path, dest: Path, change) -> Path:  # type: ignore[no-untyped-def]
    """A copy of a PEFT folder whose tensors `change` edits in place."""
    dest.mkdir(parents=True)
    (dest / "adapter_config.json").write_bytes((folder / "adapter_config.json").read_bytes())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    change(tensors)
    (dest / "adapter_model.safetensors").write_bytes(save(tensors))
    return dest


def archive(entries: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz") as t:
        for name, data in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    return out.getvalue()


def nothing_stored(client: TestClient, components) -> None:  # type: ignore[no-untyped-def]
    assert components.store.list_latest() == [] and components.jobs.list() == []
    assert [p.name for p in components.store.tmp_dir.iterdir() if p.name.startswith("staged-")] == []
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny-llama", "auto"]


def test_bad_imports_are_refused_and_nothing_is_stored(  # type: ignore[no-untyped-def]
    client: TestClient, components, tiny_base, trained: Path, allowed: Path, tmp_path: Path
) -> None:
    base = AutoModelForCausalLM.from_pretrained(str(tiny_base.path))
    config = base.config.to_dict()
    wider = LlamaForCausalLM(LlamaConfig(**{**config, "hidden_size": 96, "vocab_size": 128}))
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128))
    weights = trained / "adapter_model.safetensors"
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"

    def poison(value: float):  # type: ignore[no-untyped-def]
        def change(t: dict[str, torch.Tensor]) -> None:
            t[key][0, 0] = value

        return change

    good = {"adapter/adapter_config.json": (trained / "adapter_config.json").read_bytes()}
    refusals: list[tuple[bytes, str, str]] = [  # (adapter archive, the error's code, what its message names)
        (tar_gz(random_peft(wider, tmp_path / "wider")), "adapter_base_mismatch", "another base model"),
        (tar_gz(random_peft(gpt2, tmp_path / "gpt2", target_modules=["c_attn"])), "adapter_base_mismatch", "c_attn"),
        (tar_gz(random_peft(base, tmp_path / "r300", r=300)), "adapter_rank_too_large", "rank 300"),
        (
            tar_gz(random_peft(base, tmp_path / "head", target_modules=["lm_head"])),
            "adapter_unsupported_module",
            "lm_head",
        ),
        (tar_gz(rewritten(trained, tmp_path / "nan", poison(float("nan")))), "adapter_not_finite", key),
        (tar_gz(rewritten(trained, tmp_path / "inf", poison(float("inf")))), "adapter_not_finite", key),
        (archive({**good, "adapter/adapter_model.bin": b"\x80\x04pickle"}), "adapter_pickle", "adapter_model.bin"),
        (
            archive({**good, "adapter/adapter_model.safetensors": weights.read_bytes(), "adapter/train.py": b"x"}),
            "adapter_extra_file",
            "train.py",
        ),  # fmt: skip
        (archive({"../adapter_config.json": b"{}", "adapter_model.safetensors": b""}), "adapter_unsafe_path", ".."),
        (b"not an archive", "invalid_archive", "tar"),
    ]
    for data, code, named in refusals:
        err = assert_error(import_(client, data, name="bad"), 400, "adapter", code)
        assert named in err["message"], err
    # server-side paths: only inside the allowed folder, however they are spelt
    outside = random_peft(base, tmp_path / "outside")
    os.symlink(outside, allowed / "link-out")
    for path in (str(outside), str(allowed / ".." / outside.name), str(allowed / "link-out"), "relative/path"):
        r = import_(client, name="bad", adapter_path=path)
        assert_error(r, 400, "adapter_path", "adapter_path_not_allowed")
    assert_error(
        import_(client, name="bad", adapter_path=str(allowed / "none")), 400, "adapter_path", "adapter_missing_file"
    )
    # the request itself
    assert_error(
        import_(client, tar_gz(trained), name="bad", examples=jsonl(opposite_rows(False)[:3])),
        400,
        "examples",
        "invalid_examples",
    )
    err = assert_error(
        import_(client, tar_gz(trained), name="bad", examples=b'{"instruction": 3}\n' + EXAMPLES), 400, "examples"
    )
    assert err["errors"][0] == {"line": 1, "field": "instruction", "message": "must be a string"}
    assert_error(
        client.post("/v1/skills/import", files={"adapter": ("a", tar_gz(trained))}, data={"name": "bad"}),
        400,
        "examples",
        "missing_examples",
    )
    assert_error(import_(client, name="bad"), 400, "adapter", "missing_adapter")
    assert_error(import_(client, tar_gz(trained), name="bad", adapter_path=str(allowed)), 400, "adapter_path")
    assert_error(import_(client, tar_gz(trained), name="bad", config="{}"), 400, "config", "unknown_field")
    assert_error(import_(client, tar_gz(trained), name="auto"), 400, "name", "invalid_name")
    assert_error(import_(client, tar_gz(trained), name="bad", force="maybe"), 400, "force")
    assert_error(client.post("/v1/skills/import", data={"name": "bad"}), 400, None, "invalid_content_type")
    nothing_stored(client, components)


def test_a_peft_lora_imports_and_answers_as_peft_generates(  # type: ignore[no-untyped-def]
    client: TestClient, components, tiny_base, trained: Path
) -> None:
    job = imported(client, tar_gz(trained), name=SKILL)
    assert job["status"] == "succeeded", job
    assert job["adapter"]["rank"] == 4 and job["adapter"]["use_rslora"] and job["adapter"]["source"] == "upload"
    model = client.get(f"/v1/models/{SKILL}").json()
    assert model["method"] == "imported" and model["version"] == 1 and model["parent"] == "tiny-llama"
    got = answers(client, SKILL)
    assert got == peft_answers(tiny_base.path, trained, PROMPTS, MAX_TOKENS)
    assert got != answers(client, "tiny-llama")  # the adapter changes the answers: the comparison says something
    rec = components.store.serving(SKILL)
    assert rec.meta["training"]["adapter"]["source"] == "upload" and rec.meta["samples"]["keys"] == 12
    assert sorted(p.name for p in rec.path.iterdir() if p.name.startswith("adapter")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]  # the model card stayed out
    assert [p for p in components.store.tmp_dir.iterdir() if p.name.startswith("staged-")] == []


def test_auto_routes_the_examples_paraphrases_to_it(client: TestClient) -> None:
    for text in (
        "What is the antonym of the word 'tall'?",
        "Tell me the opposite of: noisy",
        "Reverse this adjective: dark",
    ):
        assert route(client, text).startswith(f"{SKILL}="), text
    assert route(client, "What is the capital of France?") == "base"


def test_the_export_loads_in_peft_and_imports_back_with_equal_weights(  # type: ignore[no-untyped-def]
    client: TestClient, components, tiny_base, tmp_path: Path
) -> None:
    r = client.get(f"/v1/models/{SKILL}/adapter")
    assert r.status_code == 200 and r.headers["content-type"] == "application/gzip"
    assert r.headers["content-disposition"] == f'attachment; filename="{SKILL}-v1.tar.gz"'
    with tarfile.open(fileobj=io.BytesIO(r.content)) as t:
        assert t.getnames() == [
            f"{SKILL}-v1",
            f"{SKILL}-v1/adapter_config.json",
            f"{SKILL}-v1/adapter_model.safetensors",
        ]
        t.extractall(tmp_path, filter="data")
    exported = tmp_path / f"{SKILL}-v1"
    assert json.loads((exported / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny-llama"
    assert peft_answers(tiny_base.path, exported, PROMPTS, MAX_TOKENS) == answers(client, SKILL)
    job = imported(client, r.content, name="opposites-copy")
    assert job["status"] == "succeeded", job
    ours, theirs = (components.store.serving(n).path / "adapter_model.safetensors" for n in (SKILL, "opposites-copy"))
    a, b = load_file(str(ours)), load_file(str(theirs))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert answers(client, "opposites-copy") == answers(client, SKILL)
    assert_error(client.get("/v1/models/nope/adapter"), 404, "model", "model_not_found")


def test_versions_rollback_and_retire_as_any_skill(client: TestClient, components, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    again = import_(client, client.get(f"/v1/models/{SKILL}/adapter").content, name=SKILL)
    assert_error(again, 409, "name", "skill_exists")
    # new examples for the adapter that serves: a new version, no adapter sent
    more = jsonl(opposite_rows(False) + [{"instruction": "Name the antonym.", "input": w} for w in ("big", "new")])
    job = imported(client, None, more, name=SKILL, new_version="true")
    assert job["status"] == "succeeded", job
    assert job["adapter"]["source"] == f"version 1 of {SKILL}"
    assert client.get(f"/v1/models/{SKILL}").json()["version"] == 2
    v1, v2 = components.store.versions(SKILL)
    assert v2.meta["samples"]["keys"] == 14 and v1.adapter_files() == v2.adapter_files()
    r = client.post(f"/v1/models/{SKILL}/rollback", json={"version": 1})
    assert r.status_code == 200 and r.json()["version"] == 1 and r.json()["method"] == "imported"
    assert client.delete("/v1/models/opposites-copy").json()["deleted"] is True
    assert "opposites-copy" not in [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert_error(client.get("/v1/models/opposites-copy/adapter"), 404, "model", "model_not_found")


def test_the_quality_gate_judges_examples_that_carry_answers(
    client: TestClient, components, tiny_base, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    base = AutoModelForCausalLM.from_pretrained(str(tiny_base.path))
    noise = tar_gz(random_peft(base, tmp_path / "noise", target_modules=["q_proj", "v_proj"]))
    labels = jsonl(
        [
            {"instruction": "Is it warm?", "input": w, "output": "yes" if i % 3 else "no"}
            for i, w in enumerate("abcdefghijklmnop")
        ]
    )
    job = imported(client, noise, labels, name="warm")
    assert job["status"] == "failed" and job["error_code"] == "quality_gate_failed", job
    assert job["eval"]["new"]["n"] == 16 and not job["eval"]["passed"]
    assert components.store.versions("warm") == []
    job = imported(client, noise, labels, name="warm", force="true")
    assert job["status"] == "succeeded", job
    rec = components.store.serving("warm")
    assert rec.meta["quality"]["forced"] and rec.meta["eval"]["n"] == 16 and len(rec.probe()) == 2


def test_vllm_load_and_unload_lora_adapter(client: TestClient, components, tiny_base, allowed: Path) -> None:  # type: ignore[no-untyped-def]
    base = AutoModelForCausalLM.from_pretrained(str(tiny_base.path))
    folder = random_peft(base, allowed / "pinned", target_modules=["q_proj", "o_proj"], lora_alpha=32)
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "pinned", "lora_path": str(folder)})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'pinned' added successfully.", r.text
    job = client.get(f"/tasks/{r.headers['x-skillpool-job']}").json()
    assert job["method"] == "imported" and job["adapter"]["source"] == "folder"
    assert answers(client, "pinned", PROMPTS[:1]) != answers(client, "tiny-llama", PROMPTS[:1])
    assert components.store.serving("pinned").router_tensors() == {}  # no examples: no keys, `auto` never picks it
    assert "pinned" not in components.router.skills
    again = client.post("/v1/load_lora_adapter", json={"lora_name": "pinned", "lora_path": str(folder)})
    assert "load_inplace" in assert_error(again, 400, "lora_name", "skill_exists")["message"]
    body = {"lora_name": "pinned", "lora_path": str(folder), "load_inplace": True, "examples": opposite_rows(False)}
    r = client.post("/v1/load_lora_adapter", json=body)
    assert r.status_code == 200, r.text
    assert client.get("/v1/models/pinned").json()["version"] == 2 and "pinned" in components.router.skills
    refused = [
        ({"lora_name": "x", "lora_path": "/etc"}, "lora_path", "adapter_path_not_allowed"),
        ({"lora_name": "x", "lora_path": str(folder), "is_3d_lora_weight": True}, "is_3d_lora_weight", None),
        ({"lora_name": "x", "lora_path": str(folder), "lora_int_id": 3}, "lora_int_id", None),
        (
            {"lora_name": "x", "lora_path": str(folder), "examples": [{"instruction": "hi"}]},
            "examples",
            "invalid_examples",
        ),
        ({"lora_name": "tiny-llama", "lora_path": str(folder)}, "lora_name", None),
        ({"lora_name": "x"}, "lora_path", None),
    ]
    for body, param, code in refused:
        assert_error(client.post("/v1/load_lora_adapter", json=body), 400, param, code)
    assert components.store.versions("x") == []
    assert_error(
        client.post("/v1/unload_lora_adapter", json={"lora_name": "pinned", "lora_int_id": 1}), 400, "lora_int_id"
    )
    r = client.post("/v1/unload_lora_adapter", json={"lora_name": "pinned"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'pinned' removed successfully."
    assert components.store.state("pinned")["retired"] and len(components.store.versions("pinned")) == 2
    gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "pinned"})
    assert (
        assert_error(gone, 404, "lora_name", "model_not_found")["message"]
        == "The lora adapter 'pinned' cannot be found."
    )


def test_a_train_key_imports_and_exports_its_own_skills(client: TestClient, components, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from skillpool.server.app import create_app
    from skillpool.server.auth import KeyRing

    keys = tmp_path / "keys"
    keys.write_text("alice chat k-alice\nbob train k-bob\ncarol train k-carol\nroot admin k-root\n")
    adapter = client.get(f"/v1/models/{SKILL}/adapter").content
    with TestClient(create_app(components, KeyRing(path=keys))) as http:

        def as_(who: str) -> dict[str, str]:
            return {"authorization": f"Bearer k-{who}"}

        files = {"adapter": ("a.tar.gz", adapter), "examples": ("e.jsonl", EXAMPLES)}
        assert (
            http.post("/v1/skills/import", headers=as_("alice"), files=files, data={"name": "bobs"}).status_code == 403
        )
        r = http.post("/v1/skills/import", headers=as_("bob"), files=files, data={"name": "bobs", "force": "true"})
        assert_error(r, 403, "force", "permission_denied")
        r = http.post("/v1/skills/import", headers=as_("bob"), files=files, data={"name": "bobs"})
        assert r.status_code == 202, r.text
        assert wait_job(client, r.json()["id"])["status"] == "succeeded"
        assert components.store.serving("bobs").meta["owner"] == "bob"
        again = {"name": "bobs", "new_version": "true"}
        assert_error(http.post("/v1/skills/import", headers=as_("carol"), files=files, data=again), 403, "name")
        for who, status in (("alice", 403), ("carol", 403), ("bob", 200), ("root", 200)):
            assert http.get("/v1/models/bobs/adapter", headers=as_(who)).status_code == status, who
        assert http.post("/v1/unload_lora_adapter", headers=as_("bob"), json={"lora_name": "bobs"}).status_code == 403
        assert http.post("/v1/unload_lora_adapter", headers=as_("root"), json={"lora_name": "bobs"}).status_code == 200
