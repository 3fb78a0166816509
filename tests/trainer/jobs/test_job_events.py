"""Job events: capped metrics, terminal states with error codes, the quality gate's numbers."""

from __future__ import annotations

from skillpool.trainer.jobs.job import MAX_METRIC_EVENTS, Job, _log_gate
from skillpool.trainer.records import JobStatus


def test_metrics_events_keep_their_tail_and_messages_stay() -> None:
    job = Job(id="job-1", skill="s", method="isolated", config={})
    job.log("Created")
    for step in range(MAX_METRIC_EVENTS + 5):
        job.log(f"Step {step}", kind="metrics", data={"step": step})
    assert job.events[0]["message"] == "Created" and len(job.events) == MAX_METRIC_EVENTS + 1
    assert job.events[1]["data"] == {"step": 5} and job.events[-1]["data"] == {"step": MAX_METRIC_EVENTS + 4}
    assert Job.from_dict(job.to_dict()).events == job.events  # travels with the record


def test_finish_sets_the_error_code_and_says_so() -> None:
    job = Job(id="job-1", skill="s", method="isolated", config={})
    job.finish(JobStatus.FAILED, "line 3: output: must be a string", "invalid_training_file", "training_file")
    assert (job.error_code, job.error_param) == ("invalid_training_file", "training_file")
    assert job.events[-1]["level"] == "error" and "line 3" in job.events[-1]["message"]
    job.finish(JobStatus.FAILED, "boom")
    assert job.error_code == "training_failed" and job.error_param is None


def test_the_gate_event_names_its_numbers() -> None:
    job = Job(id="job-1", skill="s", method="isolated", config={})
    report = {
        "new": {"metric": "exact_match", "n": 10, "score": 0.8, "base_score": 0.3, "trivial_score": 0.5, "gain": 0.3},
        "earlier": {"a": {"drop": 0.02}, "b": {"drop": -0.1}},
        "passed": True,
    }
    _log_gate(job, report)
    msg = job.events[-1]["message"]
    assert msg.startswith("Evaluation (exact_match, 10 held-out examples): score=0.800, base_score=0.300")
    assert "2 earlier skill(s) re-checked, largest drop 0.020; quality gate passed" in msg
    assert job.events[-1]["data"] == {"quality": report}
