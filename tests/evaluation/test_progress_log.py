"""The progress log: complete lines, appended by several processes at once without interleaving."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

from skillpool.evaluation.progress_log import ProgressLog, log_path, read_log


def test_each_step_is_one_line_with_means_rows_and_extras(tmp_path: Path) -> None:
    path = log_path(tmp_path / "out" / "kif.json")
    assert path == tmp_path / "out" / "kif.progress.jsonl"
    path.parent.mkdir()
    path.write_text('{"side": "from an earlier run"}\n')
    log = ProgressLog.fresh(path)
    assert path.read_text() == ""  # a rerun starts its own log
    log.scored("kif", "yelp", {"yelp": [100.0, 0.0, 0.0, 100.0]}, routed_to_own_skill={"yelp": 75.0})
    log.scored("forced", "yelp", {"yelp": [100.0, 100.0, 0.0, 100.0]})
    first, second = read_log(path)
    assert first["side"] == "kif" and first["after"] == "yelp"
    assert first["scores"] == {"yelp": 50.0} and first["rows"] == {"yelp": [100.0, 0.0, 0.0, 100.0]}
    assert first["routed_to_own_skill"] == {"yelp": 75.0}
    assert second["side"] == "forced" and second["scores"] == {"yelp": 75.0}


def test_a_log_without_a_path_writes_nothing(tmp_path: Path) -> None:
    ProgressLog().scored("seq", "a", {"a": [1.0]})
    assert list(tmp_path.iterdir()) == []


def _write_many(path: Path, side: str) -> None:
    log = ProgressLog(path)
    for i in range(40):  # lines of ~16 KB: far over a pipe's atomic size, as 5 tasks x 200 rows are
        log.scored(side, f"t{i}", {f"t{i}": [float(i % 2) * 100] * 2000})


def test_sides_in_separate_processes_never_interleave_their_lines(tmp_path: Path) -> None:
    path = tmp_path / "run.progress.jsonl"
    ProgressLog.fresh(path)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_write_many, args=(path, side)) for side in ("kif", "seq", "mtl", "single")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    lines = read_log(path)  # a torn line would not parse
    assert len(lines) == 160
    for side in ("kif", "seq", "mtl", "single"):
        mine = [r for r in lines if r["side"] == side]
        assert [r["after"] for r in mine] == [f"t{i}" for i in range(40)]
        assert all(len(r["rows"][r["after"]]) == 2000 for r in mine)
    assert len({r["pid"] for r in lines}) == 4
