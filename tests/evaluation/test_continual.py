"""`skillpool eval continual` end to end on the tiny model: a real server process, real uploads, real HTTP."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from skillpool.cli.main import main
from skillpool.evaluation import continual_sequence
from skillpool.evaluation.baselines import logged_result
from skillpool.evaluation.continual import _reference_single
from skillpool.evaluation.continual_task import Task
from skillpool.evaluation.progress_log import ProgressLog, read_log
from skillpool.trainer.config import TrainConfig
from tests.datasets import dataset_dir

CONFIG = json.dumps({"epochs": 1, "max_seq_len": 192})


def run(tmp: Path, tiny_base, method: str, *extra: str) -> dict:  # type: ignore[no-untyped-def]
    out = tmp / f"{method}.json"
    args = [
        "eval",
        "continual",
        "--tasks",
        str(dataset_dir("long_sequence", "sst-2")),
        str(dataset_dir("long_sequence", "qqp")),
        "--method",
        method,
        "--train-limit",
        "24",
        "--test-limit",
        "6",
        "--json",
        str(out),
        "--config",
        CONFIG,
        "--force",
        "--model",
        str(tiny_base.path),
        "--max-new-tokens",
        "4",
        "--data-dir",
        str(tmp / method),
        *extra,
    ]
    assert main(args) == 0
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def lower_triangular(m: list) -> bool:  # type: ignore[type-arg]
    return all((m[j][i] is None) == (i > j) for j in range(len(m)) for i in range(len(m)))


@pytest.mark.slow  # two server processes and four short trainings: about 2.5 minutes
def test_isolated_run_with_baselines_and_plots(tiny_base, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    r = run(tmp_path, tiny_base, "isolated", "--plots", str(tmp_path / "plots"))
    assert r["tasks"] == ["sst-2", "qqp"] and lower_triangular(r["matrix"])
    assert all(0 <= v <= 100 for row in r["matrix"] for v in row if v is not None)
    assert [j["status"] for j in r["jobs"]] == ["succeeded", "succeeded"]
    assert set(r["baselines"]) == {"oracle", "seq", "mtl"}
    oracle = r["baselines"]["oracle"]["matrix"]
    # isolated blocks are trained alone: the oracle diagonal is the single-task reference, so oracle FWT is 0
    assert r["single_task"] == {"sst-2": oracle[0][0], "qqp": oracle[1][1]}
    assert r["baselines"]["oracle"]["FWT"] == pytest.approx(0.0)
    assert r["FWT"] == pytest.approx(((r["matrix"][0][0] - oracle[0][0]) + (r["matrix"][1][1] - oracle[1][1])) / 2)
    assert r["BWT"] == pytest.approx(r["matrix"][1][0] - r["matrix"][0][0])
    assert r["auto_minus_forced"] == {n: r["matrix"][1][i] - oracle[1][i] for i, n in enumerate(r["tasks"])}
    assert lower_triangular(r["baselines"]["seq"]["matrix"]) and r["baselines"]["seq"]["BWT"] is not None
    mtl = r["baselines"]["mtl"]
    assert mtl["matrix"][0] == [None, None] and mtl["AP"] is not None and mtl["BWT"] is None
    # per-row scores of every final row: they average to it, and carry the intervals
    rows = r["row_scores"]
    assert set(rows) == {"auto", "oracle", "seq", "mtl"}
    for name, final in [("auto", r["matrix"][-1])] + [(n, b["matrix"][-1]) for n, b in r["baselines"].items()]:
        assert [len(x) for x in rows[name]] == [6, 6]
        assert [sum(x) / 6 for x in rows[name]] == pytest.approx(final)
        assert all(v in (0.0, 100.0) for x in rows[name] for v in x)  # exact match: right or wrong
    for m in [r, *r["baselines"].values()]:
        assert m["AP_ci95"][0] <= m["AP"] <= m["AP_ci95"][1]
    # FWT's paired interval: the diagonal's rows against the trained-alone rows (the oracle's, for isolated)
    assert r["single_task_rows"] == dict(zip(r["tasks"], rows["oracle"]))
    assert [sum(x) / 6 for x in r["diagonal_rows"]["auto"]] == pytest.approx([r["matrix"][i][i] for i in range(2)])
    assert [sum(x) / 6 for x in r["diagonal_rows"]["seq"]] == pytest.approx(
        [r["baselines"]["seq"]["matrix"][i][i] for i in range(2)]
    )
    assert r["baselines"]["oracle"]["FWT_ci95"] == [0.0, 0.0]  # the same rows on both sides
    log = read_log(tmp_path / "isolated.progress.jsonl")  # in one process, in order: the server's side, then seq, mtl
    assert log[0]["side"] == "run" and log[0]["setup"]["tasks"] == ["sst-2", "qqp"]  # what --resume checks
    assert [(x["side"], x["after"]) for x in log[1:]] == [
        ("isolated", "sst-2"),
        ("forced", "sst-2"),
        ("isolated", "qqp"),
        ("forced", "qqp"),
        ("seq", "sst-2"),
        ("seq", "qqp"),
        ("mtl", "qqp"),
    ]
    assert {x["after"]: x["rows"][x["after"]] for x in log if x["side"] == "forced"} == r["single_task_rows"]
    for m in [r, r["baselines"]["seq"]]:
        assert m["FWT_ci95"][0] <= m["FWT"] <= m["FWT_ci95"][1]
    assert "FWT_ci95" not in r["baselines"]["mtl"]  # mtl has no diagonal
    assert set(r["vs_baselines"]) == set(r["baselines"])
    for name, d in r["vs_baselines"].items():
        assert d["AP_diff"] == pytest.approx(r["AP"] - r["baselines"][name]["AP"])
        assert d["ci95"][0] <= d["AP_diff"] <= d["ci95"][1]
    t = r["time"]
    assert t["train_tokens"] > 0 and t["train_tokens_per_s"] > 0 and t["baseline_train_tokens"] > 0 and t["total_s"] > 0
    assert (tmp_path / "plots" / "score_matrix.png").stat().st_size > 0 and (
        tmp_path / "plots" / "task_curves.png"
    ).exists()
    # another method reuses this run's single-task scores for FWT
    kif = run(tmp_path, tiny_base, "kif", "--baselines", "", "--reference", str(tmp_path / "isolated.json"))
    assert kif["single_task"] == r["single_task"] and kif["baselines"] == {}
    assert kif["single_task_rows"] == r["single_task_rows"]  # the reference's rows carry FWT's interval over
    assert kif["FWT_ci95"][0] <= kif["FWT"] <= kif["FWT_ci95"][1]
    assert kif["jobs"][1]["status"] == "succeeded"
    with pytest.raises(SystemExit, match="another train_limit"):
        main(
            [
                "eval",
                "continual",
                "--tasks",
                str(dataset_dir("long_sequence", "sst-2")),
                "--method",
                "kif",
                "--train-limit",
                "12",
                "--json",
                str(tmp_path / "x.json"),
                "--reference",
                str(tmp_path / "isolated.json"),
                "--config",
                CONFIG,
                "--model",
                str(tiny_base.path),
                "--baselines",
                "",
                "--data-dir",
                str(tmp_path / "x"),
            ]
        )


@pytest.mark.slow  # the server's sequence beside three baseline processes on the tiny model: about a minute
def test_parallel_sides_train_the_baselines_beside_the_server_and_log_every_step(
    tiny_base, tmp_path: Path, capfd
) -> None:  # type: ignore[no-untyped-def]
    # no --reference: the trained-alone rows are trained here too, as a third side
    r = run(tmp_path, tiny_base, "kif", "--baselines", "seq,mtl", "--parallel")
    assert r["config"]["parallel"] is True and set(r["baselines"]) == {"seq", "mtl"}
    rows = r["single_task_rows"]
    assert set(rows) == {"sst-2", "qqp"} and all(len(x) == 6 for x in rows.values())
    assert r["single_task"] == {n: pytest.approx(sum(x) / 6) for n, x in rows.items()}
    assert r["FWT_ci95"][0] <= r["FWT"] <= r["FWT_ci95"][1]
    assert lower_triangular(r["baselines"]["seq"]["matrix"]) and r["baselines"]["mtl"]["AP"] is not None
    assert r["time"]["baseline_train_tokens"] > 0  # the children's training is counted
    # the progress log holds every step, as measured, by the side that measured it
    log = read_log(tmp_path / "kif.progress.jsonl")
    by = {side: [x for x in log if x["side"] == side] for side in ("kif", "forced", "seq", "mtl", "single")}
    assert sum(map(len, by.values())) == len(log) - 1  # and the setup line
    assert [x["after"] for x in by["kif"]] == ["sst-2", "qqp"] == [x["after"] for x in by["seq"]]
    for j, step in enumerate(by["kif"]):
        assert step["scores"] == {n: pytest.approx(r["matrix"][j][i]) for i, n in enumerate(r["tasks"][: j + 1])}
        assert step["routed_to_own_skill"] == dict(zip(r["tasks"], r["routed_to_own_skill"][j][: j + 1]))
    assert by["kif"][-1]["rows"] == dict(zip(r["tasks"], r["row_scores"]["auto"]))
    assert {x["after"]: x["rows"][x["after"]] for x in by["single"]} == rows
    assert [x["scores"] for x in by["seq"]][-1] == {
        n: pytest.approx(v) for n, v in zip(r["tasks"], r["baselines"]["seq"]["matrix"][-1])
    }
    assert by["mtl"][0]["rows"] == dict(zip(r["tasks"], r["row_scores"]["mtl"]))
    # each baseline side ran in a process of its own, not in the one that drove the server
    side_pids = {by[s][0]["pid"] for s in ("seq", "mtl", "single")}
    assert len(side_pids) == 3 and by["kif"][0]["pid"] not in side_pids
    out = capfd.readouterr().out  # the sides print each step, as the server's side does
    for line in ("after qqp: sst-2", "seq after qqp: sst-2", "single after qqp: qqp", "mtl after qqp: sst-2"):
        assert line in out, line


def reference_args(tmp: Path, ref: dict) -> tuple[Path, argparse.Namespace]:  # type: ignore[type-arg]
    path = tmp / "ref.json"
    path.write_text(json.dumps(ref))
    return path, argparse.Namespace(train_limit=4, test_limit=3, train_config=TrainConfig())


def task(name: str, n_test: int) -> Task:
    return Task(name, b"", [], [{"messages": [], "answer": "a"}] * n_test, "exact_match")


def test_a_reference_gives_single_task_scores_and_their_rows_where_it_kept_them(tmp_path: Path) -> None:
    config = {"train_limit": 4, "test_limit": 3, "train_config": TrainConfig().to_dict()}
    rows = {"a": [100.0, 0.0, 0.0], "b": [100.0, 100.0, 0.0]}
    path, args = reference_args(tmp_path, {"config": config, "single_task": {"a": 33.3, "b": 66.7}})
    tasks = [task("a", 3), task("b", 3)]
    assert _reference_single(path, tasks, args) == ([33.3, 66.7], None)  # an older JSON: FWT without interval
    path, args = reference_args(
        tmp_path, {"config": config, "single_task": {"a": 33.3, "b": 66.7}, "single_task_rows": rows}
    )
    assert _reference_single(path, tasks, args) == ([33.3, 66.7], [rows["a"], rows["b"]])
    with pytest.raises(SystemExit, match="scored 3 test rows of b, this run has 2"):
        _reference_single(path, [task("a", 3), task("b", 2)], args)
    with pytest.raises(SystemExit, match="no single-task score for \\['c'\\]"):
        _reference_single(path, [task("c", 3)], args)
    path, args = reference_args(tmp_path, {"config": {**config, "test_limit": 5}, "single_task": {}})
    with pytest.raises(SystemExit, match="another test_limit"):
        _reference_single(path, tasks, args)
    # a reference recorded before prompt_variant_copies existed trained as copies 1 does, and only as that
    one = TrainConfig(prompt_variant_copies=1)
    older = {k: v for k, v in one.to_dict().items() if k != "prompt_variant_copies"}
    older_ref = {"config": {**config, "train_config": older}, "single_task": {"a": 33.3, "b": 66.7}}
    path, args = reference_args(tmp_path, older_ref)
    args.train_config = one
    assert _reference_single(path, tasks, args) == ([33.3, 66.7], None)
    args.train_config = TrainConfig(prompt_variant_copies=2)
    with pytest.raises(SystemExit, match="another train_config"):
        _reference_single(path, tasks, args)


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    base = ["eval", "continual", "--tasks", str(tmp_path), "--json", str(tmp_path / "o.json")]
    with pytest.raises(SystemExit, match="--config: config.rank"):
        main([*base, "--config", '{"rank": 0}'])
    with pytest.raises(SystemExit, match="unknown \\['nope'\\]"):
        main([*base, "--baselines", "seq,nope"])


def test_bad_server_args_are_refused_before_a_server_starts(tmp_path: Path) -> None:
    base = ["eval", "continual", "--tasks", str(tmp_path), "--json", str(tmp_path / "o.json")]
    with pytest.raises(SystemExit, match="--server-args: No closing quotation"):
        main([*base, "--server-args=--max-batch-size '64"])
    # what the run sets itself, whole, with "=" or as a prefix argparse would expand ("=" below: argparse reads
    # a lone "--data-dir=..." as a flag of its own)
    for flag, name in [
        ("--port 9000", "--port"),
        ("--data-dir=/x", "--data-dir"),
        ("--data /x", "--data"),
        ("--model /m", "--model"),
        ("--router-mode sapt", "--router-mode"),
    ]:
        with pytest.raises(SystemExit, match=f"--server-args: {name}: the run sets --port and --data-dir itself"):
            main([*base, f"--server-args={flag}"])
    assert not (tmp_path / "o.json").exists()


@pytest.mark.slow  # three runs of the server on the tiny model, two short trainings and seq's two: about 30 s
def test_resume_goes_on_after_a_cut_with_what_the_cut_run_measured_and_trained(
    tiny_base, tmp_path: Path, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """A run cut after qqp was trained but before it was scored (a GPU lease ended), then resumed: sst-2's step
    comes from the log, qqp's skill from the data dir, and nothing is trained twice; seq, which the cut run never
    reached, runs whole. Resumed once more, with everything measured, it trains and scores nothing."""
    ask = continual_sequence._ask

    def cut(client, model, task, concurrency):  # type: ignore[no-untyped-def]
        if task.name == "qqp":
            raise RuntimeError("the lease ended")
        return ask(client, model, task, concurrency)

    monkeypatch.setattr(continual_sequence, "_ask", cut)
    with pytest.raises(RuntimeError, match="the lease ended"):
        run(tmp_path, tiny_base, "isolated", "--baselines", "oracle,seq")
    monkeypatch.setattr(continual_sequence, "_ask", ask)
    path = tmp_path / "isolated.progress.jsonl"
    cut_log = read_log(path)
    assert [x["side"] for x in cut_log] == ["run", "isolated", "forced"]  # sst-2's step only
    r = run(tmp_path, tiny_base, "isolated", "--baselines", "oracle,seq", "--resume")
    assert r["config"]["resumed"] == {"server_tasks": 1, "sides": [], "untimed_steps": 0}
    jobs = job_records(tmp_path / "isolated")
    assert len(jobs) == 2 and [j["finished_at"] for j in r["jobs"]] == [j["finished_at"] for j in jobs]
    log = read_log(path)
    assert log[:3] == cut_log  # kept as measured, not measured again
    assert [(x["side"], x["after"]) for x in log[3:]] == [
        ("isolated", "qqp"),
        ("forced", "qqp"),
        ("seq", "sst-2"),
        ("seq", "qqp"),
    ]
    assert r["matrix"][0][0] == pytest.approx(cut_log[1]["scores"]["sst-2"])
    assert r["row_scores"]["auto"] == [log[3]["rows"]["sst-2"], log[3]["rows"]["qqp"]]
    assert r["row_scores"]["oracle"] == [cut_log[2]["rows"]["sst-2"], log[4]["rows"]["qqp"]]
    seq = logged_result("seq", log[5:], ["sst-2", "qqp"])  # the log rebuilds what the side returned
    assert seq == (r["baselines"]["seq"]["matrix"], r["row_scores"]["seq"], r["diagonal_rows"]["seq"])
    # the times count the kept steps too: sst-2's scoring, measured by the cut run, is in eval_s
    scoring = [log[1]["eval_s"], log[3]["eval_s"]]
    assert all(x > 0 for x in scoring) and r["time"]["eval_s"] == pytest.approx(sum(scoring), abs=0.1)
    assert all(x["train_tokens"] > 0 for x in log[5:])
    assert sum(x["train_tokens"] for x in log[5:]) == r["time"]["baseline_train_tokens"]
    # resumed with every step in the log, from one whose first step predates the seconds in its lines
    del log[1]["eval_s"]
    ProgressLog.fresh(path, log[0]["setup"], log[1:])
    again = run(tmp_path, tiny_base, "isolated", "--baselines", "oracle,seq", "--resume")
    assert again["config"]["resumed"] == {"server_tasks": 2, "sides": ["seq"], "untimed_steps": 1}
    assert read_log(path) == log
    assert again["time"]["eval_s"] == pytest.approx(log[3]["eval_s"], abs=0.1)  # the timed step alone
    assert again["time"]["baseline_train_tokens"] == r["time"]["baseline_train_tokens"]  # seq's, kept
    assert again["time"]["baseline_train_s"] == pytest.approx(r["time"]["baseline_train_s"], abs=0.1)
    for key in ("matrix", "row_scores", "baselines", "routed_to_own_skill", "AP", "BWT", "vs_baselines"):
        assert again[key] == r[key], key
    # another setup is not a resume of this run
    with pytest.raises(SystemExit, match="--resume: the cut run had test_limit 6, this one 5"):
        run(tmp_path, tiny_base, "isolated", "--baselines", "oracle,seq", "--resume", "--test-limit", "5")
    assert read_log(path) == log


def job_records(data_dir: Path) -> list[dict]:  # type: ignore[type-arg]
    """The job records the server keeps under <data>/jobs (every job it ever took), in the order they finished."""
    records = [json.loads(p.read_text()) for p in (data_dir / "jobs").glob("job-*.json")]
    return sorted(records, key=lambda j: j["finished_at"] or 0)


def test_resume_needs_the_cut_runs_data_dir_and_log(tmp_path: Path) -> None:
    base = ["eval", "continual", "--tasks", str(tmp_path), "--json", str(tmp_path / "o.json"), "--resume"]
    with pytest.raises(SystemExit, match="--resume: give the cut run's --data-dir"):
        main(base)
    (tmp_path / "data").mkdir()
    with pytest.raises(SystemExit, match="--resume: no progress log .*o.progress.jsonl"):
        main([*base, "--data-dir", str(tmp_path / "data")])
