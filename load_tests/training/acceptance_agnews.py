"""The end-to-end acceptance run, through the real server and the openai client.

1. start `skillpool serve` on a fresh data dir; 2. upload the first 300 rows of Long Sequence AG News
and time the job; 3. score AG News test prompts with model=auto (route rate, first-word exact
match) and with the base model; 4. upload a second task (SST-2) and re-score AG News; 5. check that
a malformed upload gets 400 with line numbers; 6. restart and check both skills are served.

    .venv/bin/python -m load_tests.training.acceptance_agnews [--train 300] [--test 200] [--second sst-2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
from openai import OpenAI

from load_tests.common.datasets import rows, user_text
from skillpool.evaluation.process import ServerProcess
from skillpool.evaluation.tasks_client import TasksClient
from skillpool.trainer.scoring import first_word_match
from tests.chat import ask

BASE = "SmolLM2-135M-Instruct"


def score(client: OpenAI, model: str, test: list[dict], skill: str) -> tuple[float, float]:
    out = ask(client, model, [user_text(r) for r in test])
    acc = sum(first_word_match(a, r["output"]) for (a, _), r in zip(out, test)) / len(test)
    routed = sum(h.startswith(skill + "=") for _, h in out) / len(test)
    return acc, routed


def learn(url: str, task: str, n: int, config: dict) -> tuple[dict, float]:
    body = "\n".join(json.dumps(r) for r in rows("long_sequence", task, "train", n)).encode()
    t0 = time.time()
    job = TasksClient(url).train(task, body, config=config)
    return job, time.time() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", type=int, default=300)
    ap.add_argument("--test", type=int, default=200)
    ap.add_argument("--second", default="sst-2")
    ap.add_argument("--config", default="{}", help="training hyperparameters (JSON)")
    ap.add_argument("--data-dir", type=Path, default=None)
    args = ap.parse_args()
    config = json.loads(args.config)
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="skillpool-accept-")) / "data"
    test = rows("long_sequence", "agnews", "test", args.test)
    results: dict = {"train_rows": args.train, "test_rows": len(test), "config": config}

    with ServerProcess(data_dir) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        results["base_acc"], _ = score(client, BASE, test, "agnews")
        print(f"base model on AG News: {results['base_acc']:.3f}", flush=True)

        job, secs = learn(srv.url, "agnews", args.train, config)
        assert job["status"] == "succeeded", job
        results["agnews_train_s"], results["agnews_job_eval"] = round(secs, 1), job["eval"]
        print(f"agnews learned in {secs:.0f}s, held-out eval {job['eval']}", flush=True)
        results["auto_acc"], results["route_rate"] = score(client, "auto", test, "agnews")
        print(
            f"auto on AG News: accuracy {results['auto_acc']:.3f}, routed to agnews {results['route_rate']:.3f}",
            flush=True,
        )

        job2, secs2 = learn(srv.url, args.second, args.train, config)
        assert job2["status"] == "succeeded", job2
        results["second_train_s"], results["second_job_eval"] = round(secs2, 1), job2["eval"]
        results["auto_acc_after_second"], results["route_rate_after_second"] = score(client, "auto", test, "agnews")
        second_test = rows("long_sequence", args.second, "test", 100)
        results["second_auto_acc"], results["second_route_rate"] = score(client, "auto", second_test, args.second)
        print(
            f"after {args.second}: AG News accuracy {results['auto_acc_after_second']:.3f} "
            f"(routed {results['route_rate_after_second']:.3f}); {args.second} accuracy {results['second_auto_acc']:.3f} "
            f"(routed {results['second_route_rate']:.3f})",
            flush=True,
        )

        bad = (
            b'{"instruction": "x", "output": "y"}\n{oops\n{"instruction": "x", "output": ""}\n'
            + b'{"instruction": "x", "output": "y"}\n' * 10
        )
        r = TasksClient(srv.url).submit("broken", bad)
        err = r.json()["error"]
        results["malformed_status"], results["malformed_lines"] = (
            r.status_code,
            [e["line"] for e in err.get("errors", [])],
        )
        print(f"malformed upload: {r.status_code} {err['message']}", flush=True)

    with ServerProcess(data_dir) as srv:
        results["after_restart"] = [m["id"] for m in httpx.get(srv.url + "/v1/models", timeout=10).json()["data"]]
    print(f"after restart: {results['after_restart']}")
    results["agnews_drop_points"] = round(100 * (results["auto_acc"] - results["auto_acc_after_second"]), 1)
    print(json.dumps(results, indent=2))
    ok = (
        results["route_rate"] >= 0.95
        and results["auto_acc"] >= 0.80
        and results["agnews_train_s"] < 900
        and results["agnews_drop_points"] <= 2
        and results["malformed_status"] == 400
        and {"agnews", args.second} <= set(results["after_restart"])
    )
    print("ACCEPTANCE", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
