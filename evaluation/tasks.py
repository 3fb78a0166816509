"""Task folders, the benchmark layout every `skillpool eval` reads: <name>/train.jsonl and <name>/test.jsonl.

One reader (task_lines) and one --tasks flag (add_task_folders) for both evaluations; the routed text of a
row (task_text) and the routing task; the datasets setting (SKILLPOOL_DATASETS) and the instruction paraphrase
sets (packaged in paraphrases/, or a JSON file).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

from skillpool.router.texts import route_text

DATASETS_SETTING = "SKILLPOOL_DATASETS"


def datasets_root() -> Path | None:
    """The benchmark datasets folder (GROUP/TASK/{train,test}.jsonl) that SKILLPOOL_DATASETS names; None when unset.

    The one place tests and load_tests learn where the datasets are: tests skip without it, benchmarks stop."""
    value = os.environ.get(DATASETS_SETTING, "").strip()
    return Path(value).expanduser() if value else None


def dataset_folder(group: str, task: str) -> Path:
    """<datasets>/<group>/<task>; a ValueError naming SKILLPOOL_DATASETS when it is unset or lacks the folder."""
    root = datasets_root()
    if root is None:
        raise ValueError(f"{DATASETS_SETTING} is not set: point it at the benchmark datasets folder (GROUP/TASK/)")
    path = root / group / task
    if not path.is_dir():
        raise ValueError(f"{path} not found: {DATASETS_SETTING}={root} has no {group}/{task} task folder")
    return path


def task_lines(folder: Path, split: str) -> list[str]:
    """The non-empty lines of <folder>/<split>.jsonl (split on \\n, not splitlines: U+2028 may be in JSON)."""
    path = folder / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found (a task folder holds train.jsonl and test.jsonl)")
    return [line for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]


def add_task_folders(p: argparse.ArgumentParser) -> None:
    """The --tasks flag every `skillpool eval` takes."""
    p.add_argument(
        "--tasks",
        type=Path,
        nargs="+",
        required=True,
        help="task folders (train.jsonl, test.jsonl), learned in this order",
    )


TEXT_MODES = ("with-instruction", "input-only", "system-message")


@dataclass
class Task:
    """A task as `eval routing` sees it: the routed texts of its rows."""

    name: str
    train: list[str]
    test: list[str]
    train_inputs: list[str] | None = None  # the input part of each training row (no instruction)
    train_answers: list[str] | None = None


def task_text(row: dict[str, Any], mode: str, instruction: str | None = None) -> str:
    """The routed text of a benchmark row: instruction + input as one user turn (`with-instruction`), the
    instruction as a system message (`system-message`, joined by the server's own route_text), or the
    input alone. `instruction` replaces the row's own; a '{input}' in it marks where the input goes."""
    inp = str(row.get("input", ""))
    if mode == "input-only":
        return inp or str(row.get("instruction", ""))
    instr = str(row.get("instruction", "")) if instruction is None else instruction
    if mode == "system-message":
        system = instr.replace("{input}", "").strip()
        return route_text([{"role": "system", "content": system}, {"role": "user", "content": inp}])
    if "{input}" in instr:
        return instr.replace("{input}", inp)
    return "\n".join(p for p in (instr, inp) if p)


def paraphrase_sets() -> list[str]:
    """The names of the packaged paraphrase sets (paraphrases/NAME.json beside this module)."""
    folder = files("skillpool.evaluation") / "paraphrases"
    return sorted(f.name.removesuffix(".json") for f in folder.iterdir() if f.name.endswith(".json"))


def paraphrase_source(text: str) -> str:
    """The --instructions type: a packaged set's name or a JSON file's path, kept as given (and recorded so)."""
    if text in paraphrase_sets() or Path(text).is_file():
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is neither a packaged paraphrase set ({', '.join(paraphrase_sets())}) nor a JSON file"
    )


def load_paraphrases(source: str | Path) -> dict[str, list[str]]:
    """{task folder name: [instruction paraphrases]} from a packaged set's name or a JSON file (keys starting
    with '_' are comments)."""
    name = str(source)
    try:
        if name in paraphrase_sets():
            text = (files("skillpool.evaluation") / "paraphrases" / f"{name}.json").read_text(encoding="utf-8")
        else:
            text = Path(source).read_text(encoding="utf-8")
        data = json.loads(text)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--instructions {name}: cannot read a JSON object ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"--instructions {name}: expected an object of task name -> list of instructions")
    out = {k: v for k, v in data.items() if not k.startswith("_")}
    for k, v in out.items():
        if not isinstance(v, list) or not v or not all(isinstance(x, str) and x.strip() for x in v):
            raise ValueError(f"--instructions {name}: {k!r} must be a non-empty list of non-empty strings")
    return out


def load_task(
    folder: Path,
    mode: str,
    train_limit: int | None,
    test_limit: int | None,
    paraphrases: list[str] | None = None,
) -> Task:
    """Training texts always carry the row's own instruction (what the skill was uploaded with); test
    rows get paraphrase i mod n when paraphrases are given (deterministic, every paraphrase used)."""
    if mode not in TEXT_MODES:
        raise ValueError(f"text mode must be one of {', '.join(TEXT_MODES)}, got {mode!r}")

    def read(split: str, limit: int | None) -> list[dict[str, Any]]:
        return [json.loads(line) for line in task_lines(folder, split)][:limit]

    train, test = read("train", train_limit), read("test", test_limit)
    train_mode = "input-only" if mode == "input-only" else "with-instruction"
    return Task(
        folder.name,
        [task_text(r, train_mode) for r in train],
        [task_text(r, mode, paraphrases[i % len(paraphrases)] if paraphrases else None) for i, r in enumerate(test)],
        [str(r.get("input") or r.get("instruction", "")) for r in train],
        [str(r.get("output", "")) for r in train],
    )
