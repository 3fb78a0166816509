"""evaluation/tasks.py: the one datasets setting (SKILLPOOL_DATASETS) and the packaged paraphrase sets."""

from __future__ import annotations

import argparse
import json
from importlib.resources import files
from pathlib import Path

import pytest

from skillpool.evaluation.tasks import (
    DATASETS_SETTING,
    dataset_folder,
    datasets_root,
    load_paraphrases,
    paraphrase_sets,
    paraphrase_source,
)


def test_unset_the_setting_gives_no_root_and_a_folder_request_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DATASETS_SETTING, raising=False)
    assert DATASETS_SETTING == "SKILLPOOL_DATASETS" and datasets_root() is None
    with pytest.raises(ValueError, match="SKILLPOOL_DATASETS is not set"):
        dataset_folder("long_sequence", "agnews")
    monkeypatch.setenv(DATASETS_SETTING, "  ")  # blank is unset
    assert datasets_root() is None


def test_a_set_root_gives_its_task_folders_and_names_a_missing_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "long_sequence" / "agnews").mkdir(parents=True)
    monkeypatch.setenv(DATASETS_SETTING, str(tmp_path))
    assert datasets_root() == tmp_path
    assert dataset_folder("long_sequence", "agnews") == tmp_path / "long_sequence" / "agnews"
    with pytest.raises(ValueError, match=r"SKILLPOOL_DATASETS=.* has no long_sequence/yelp task folder"):
        dataset_folder("long_sequence", "yelp")


def test_the_paraphrase_sets_are_package_data_and_load_by_name() -> None:
    folder = files("skillpool.evaluation") / "paraphrases"
    assert paraphrase_sets() == ["long_sequence", "superni"]
    assert all((folder / f"{name}.json").is_file() for name in paraphrase_sets())
    long_sequence = load_paraphrases("long_sequence")
    assert len(long_sequence) == 12 and all(len(v) >= 3 for v in long_sequence.values())
    assert not any(k.startswith("_") for k in long_sequence)  # the "_about" comment is left out
    assert "task363_sst2_polarity_classification" in load_paraphrases("superni")


def test_the_instructions_type_takes_a_name_or_a_file_and_lists_the_names_otherwise(tmp_path: Path) -> None:
    own = tmp_path / "mine.json"
    own.write_text(json.dumps({"agnews": ["Which section is this story from?"]}))
    assert paraphrase_source("superni") == "superni" and paraphrase_source(str(own)) == str(own)
    assert load_paraphrases(str(own)) == {"agnews": ["Which section is this story from?"]}
    with pytest.raises(argparse.ArgumentTypeError, match=r"packaged paraphrase set \(long_sequence, superni\)"):
        paraphrase_source("long-sequence")
    with pytest.raises(argparse.ArgumentTypeError, match="nor a JSON file"):
        paraphrase_source(str(tmp_path / "missing.json"))
