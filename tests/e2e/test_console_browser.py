"""End to end in a real browser: headless Chromium (Debian's `chromium`, driven by Playwright) on the console of a
real `skillpool serve` (SmolLM2 + MiniLM) with an admin, a train and a chat key.

The admin uploads a slice of AG News through the Upload view and watches the job's loss plot gain points while it
trains; meanwhile a wrong key sees nothing of the pool, a bad file's line numbers are shown, and a prompt, a file
name and a job error carrying markup are shown as text. Once the skill is served: the skills table shows its gate
numbers, the playground shows the route the API's header gives, and the chat and train keys see no fallback
cluster and no admin action; an address naming no view (`#constructor`) opens the Skills view. Every page load
checks the CSP on the console's responses and that nothing violated it. Each view's screenshot goes to pytest's tmp dir, and to the folder SKILLPOOL_CONSOLE_SCREENSHOTS names.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from skillpool.evaluation.process import ServerProcess
from skillpool.evaluation.tasks_client import TasksClient
from skillpool.server.console import CSP
from tests.datasets import dataset_dir, rows, user_text
from tests.e2e.console_browser import Console, chromium, screenshot

pytestmark = pytest.mark.slow
ADMIN, TRAIN, CHAT = "k-console-admin-1", "k-console-train-2", "k-console-chat-3"
KEYS = f"ops admin {ADMIN}\nalice train {TRAIN}\nbob chat {CHAT}\n"
BASE = "SmolLM2-135M-Instruct"
SKILL = "agnews"
# small on purpose (2 CPU cores): 54 training rows at batch 2 are 27 steps, enough for the plot to gain points;
# the admin's force keeps the skill whatever 6 held-out rows say (the gate has its own end-to-end test)
TRAIN_ROWS = 60
CONFIG = {
    "epochs": 1,
    "batch_size": 2,
    "prompt_variants": 0.0,
    "max_eval_examples": 8,
    "probe_size": 4,
    "max_seq_len": 256,
}
# no single quote in them: a job error quotes them with Python's repr, which would escape it
SCRIPT = "<script>window.__pwned = 1</script>"
IMG = '<img src=x onerror="window.__pwned = 2; alert(2)">'


def headers(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def jsonl(items: list[dict[str, Any]]) -> bytes:
    return "\n".join(json.dumps(x) for x in items).encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    dataset_dir("long_sequence", "agnews")  # skips with a message naming SKILLPOOL_DATASETS when it is unset
    chromium()
    folder = tmp_path_factory.mktemp("console-e2e")
    (folder / "keys").write_text(KEYS)
    with ServerProcess(folder / "data", ["--api-keys-file", str(folder / "keys")]) as s:
        yield s


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    pw = pytest.importorskip("playwright.sync_api", reason="Playwright is in the test extra: pip install -e .[test]")
    with pw.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium(), headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("console-screenshots")


@pytest.fixture
def console(browser: Any, server: ServerProcess) -> Iterator[Console]:
    c = Console(browser, server.url)
    yield c
    c.close()


@dataclass
class Training:
    page: Any
    job_id: str


@pytest.fixture(scope="module")
def training(browser: Any, server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Training]:
    """The admin uploads AG News through the Upload view; the page then follows the job."""
    c = Console(browser, server.url)
    page = c.open(ADMIN, "upload")
    path = tmp_path_factory.mktemp("upload") / f"{SKILL}.jsonl"
    path.write_bytes(jsonl(rows("long_sequence", "agnews", "train", TRAIN_ROWS)))
    page.get_by_label("Dataset file (JSONL)").set_input_files(str(path))
    page.get_by_label("Skill name").fill(SKILL)
    page.get_by_label("Config (JSON)").fill(json.dumps(CONFIG))
    page.get_by_label(re.compile("^Force")).check()
    page.get_by_role("button", name="Upload and train").click()
    page.get_by_test_id("job-status").wait_for()
    job_id = page.get_by_test_id("job-detail").get_attribute("data-job")
    assert job_id and job_id.startswith("job-")
    yield Training(page, job_id)
    c.close()


@pytest.fixture(scope="module")
def skill(training: Training, server: ServerProcess) -> str:
    job = TasksClient(server.url, ADMIN).follow(training.job_id, progress=False, poll_s=0.5, timeout_s=1200)
    assert job["status"] == "succeeded", job
    return SKILL


def test_loss_plot_gains_points_while_training(training: Training, shots: Path) -> None:
    page = training.page
    plot, status = page.get_by_test_id("loss-plot"), page.get_by_test_id("job-status")
    seen: list[int] = []  # the plot's point count at each look while the page said "running"
    deadline = time.time() + 900
    while time.time() < deadline and status.text_content() in ("queued", "running"):
        if status.text_content() == "running":
            seen.append(int(plot.get_attribute("data-points") or 0))
            if len(set(seen)) == 3:  # it gained points twice while it ran: enough (the job trains on)
                screenshot(page, "jobs", shots)
                break
        page.wait_for_timeout(700)
    assert seen == sorted(seen), seen  # never loses a point
    assert len(set(seen)) >= 3, f"the plot did not gain points while the job ran: {seen}"


def test_wrong_key_shows_nothing_of_the_pool(console: Console) -> None:
    page = console.open("k-not-a-key")
    page.get_by_test_id("auth-error").wait_for()
    assert "refused" in page.get_by_test_id("auth-error").text_content()
    assert page.locator("#app").is_hidden() and page.locator("#app *").count() == 0
    body = page.locator("body").inner_text()
    assert BASE not in body and SKILL not in body
    calls = console.watch(page).api_calls()
    assert calls and all(r.status == 401 for r in calls), [(r.url, r.status) for r in calls]


def test_bad_line_upload_shows_its_line_number(console: Console, server: ServerProcess, shots: Path) -> None:
    good = rows("long_sequence", "agnews", "train", 20)
    lines = [json.dumps(r) for r in good]
    lines[6] = json.dumps({**good[6], "output": 3})
    lines[11] = '{"instruction": "Classify.", "input": "x", "output": '
    body = "\n".join(lines).encode()
    api = httpx.post(
        server.url + "/tasks", headers=headers(TRAIN), files={"file": ("bad.jsonl", body)}, data={"name": "bad"}
    )
    assert api.status_code == 400
    errors = api.json()["error"]["errors"]
    expected = [e["line"] for e in errors]
    assert expected == [7, 12]

    page = console.open(TRAIN, "upload")
    page.get_by_label("Dataset file (JSONL)").set_input_files(
        files=[{"name": "bad.jsonl", "mimeType": "application/jsonl", "buffer": body}]
    )
    page.get_by_label("Skill name").fill("bad")
    page.get_by_role("button", name="Upload and train").click()
    listed = page.get_by_test_id("bad-lines").get_by_role("listitem")
    listed.first.wait_for()
    assert [int(x) for x in listed.evaluate_all("items => items.map(i => i.dataset.line)")] == expected
    assert page.get_by_test_id("bad-line-number").all_text_contents() == [f"Line {n}" for n in expected]
    for item, e in zip(listed.all(), errors):  # each with its field and reason, as the API gives them
        assert item.text_content().endswith(f"{e['field']}: {e['message']}" if e["field"] else e["message"])
    screenshot(page, "upload", shots)


def test_prompt_file_name_and_job_error_render_as_text(console: Console, server: ServerProcess) -> None:
    """Markup in a prompt, an uploaded file's name and a job's error is shown as the text it is, never run."""
    # a fine-tuning job whose file names a role carrying markup: it fails, and its error quotes that role
    good = rows("long_sequence", "agnews", "train", 12)
    chat_rows: list[dict[str, Any]] = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": r["output"]}]} for r in good
    ]
    chat_rows[2] = {"messages": [{"role": IMG, "content": "hi"}, {"role": "assistant", "content": "World"}]}
    f = httpx.post(
        server.url + "/v1/files",
        headers=headers(ADMIN),
        files={"file": ("xss.jsonl", jsonl(chat_rows))},
        data={"purpose": "fine-tune"},
    ).json()
    job = httpx.post(
        server.url + "/v1/fine_tuning/jobs", headers=headers(ADMIN), json={"model": BASE, "training_file": f["id"]}
    ).json()
    failed = TasksClient(server.url, ADMIN).follow(job["id"], progress=False, poll_s=0.5, timeout_s=120)
    assert failed["status"] == "failed" and IMG in failed["error"]

    page = console.open(ADMIN, "playground")
    prompt = f"Say hi. {SCRIPT} {IMG}"
    page.get_by_label("Model").select_option(BASE)
    page.get_by_label("Max tokens").fill("4")
    page.get_by_label("Prompt").fill(prompt)
    page.get_by_role("button", name="Send").click()
    page.get_by_test_id("timings").filter(has_text="total").wait_for()
    assert page.get_by_test_id("prompt-text").text_content() == prompt

    page.get_by_role("tab", name="Upload").click()
    bad = jsonl([{"messages": [{"role": SCRIPT, "content": "hi"}, {"role": "assistant", "content": "x"}]}])
    page.get_by_label("Dataset file (JSONL)").set_input_files(
        files=[{"name": f"{IMG}.jsonl", "mimeType": "application/jsonl", "buffer": bad}]
    )
    assert IMG in page.get_by_test_id("upload-file-name").text_content()
    page.get_by_label("Skill name").fill("xss")
    page.get_by_role("button", name="Upload and train").click()
    page.get_by_test_id("bad-lines").wait_for()
    assert SCRIPT in page.get_by_test_id("bad-lines").text_content()

    page.get_by_role("tab", name="Jobs").click()
    page.get_by_role("button", name=f"Open job {job['id']}").click()
    page.get_by_test_id("job-error").filter(has_text=IMG).wait_for()
    assert any(IMG in t for t in page.get_by_test_id("job-row-error").all_text_contents())
    # the markup made no element: the page has no image at all, and its one script is its own module
    assert page.locator("img").count() == 0
    assert page.locator("script").evaluate_all("s => s.map(x => x.getAttribute('src'))") == [
        "/console/static/console.js"
    ]
    assert page.evaluate("window.__pwned") is None  # Console.check also asserts no dialog opened


def test_every_console_response_carries_the_csp(console: Console, server: ServerProcess) -> None:
    page = console.open(ADMIN)
    for view in ("Jobs", "Upload", "Routing", "Playground", "Skills"):
        page.get_by_role("tab", name=view).click()
        page.get_by_role("tab", name=view, selected=True).wait_for()  # the view is shown
    mine = [r for r in console.watch(page).responses if r.url.startswith(server.url + "/console")]
    kinds = {r.request.resource_type for r in mine}
    assert {"document", "script", "stylesheet"} <= kinds, kinds
    for r in mine:
        assert r.all_headers().get("content-security-policy") == CSP, r.url
    assert len([r for r in mine if r.request.resource_type == "script"]) >= 5  # the entry module and its imports


def test_skills_table_lists_the_skill_with_gate_numbers(
    skill: str, console: Console, server: ServerProcess, shots: Path
) -> None:
    texts = [user_text(r) for r in rows("long_sequence", "agnews", "test", 3)] + ["Write a haiku about rain."]
    for text in texts:  # some traffic: the table shows each skill's share of it
        chat = {"model": "auto", "messages": [{"role": "user", "content": text}], "max_tokens": 2}
        assert httpx.post(f"{server.url}/v1/chat/completions", headers=headers(CHAT), json=chat, timeout=120).is_success
    info = httpx.get(f"{server.url}/v1/models/{skill}", headers=headers(CHAT), timeout=30).json()
    gate = info["quality"]["new"]
    page = console.open(ADMIN)
    row = page.locator(f'[data-testid="skill-row"][data-skill="{skill}"]')
    row.wait_for()
    usage = httpx.get(f"{server.url}/v1/skillpool/routing?window=3600", headers=headers(CHAT), timeout=30).json()
    assert (
        f"Last hour: {usage['requests']} routed requests; {usage['fallbacks']} fell back"
        in page.get_by_test_id("fallback-summary").text_content()
    )
    routed = next((s["requests"] for s in usage["skills"] if s["skill"] == skill), 0)
    assert row.get_by_test_id("routing-share").text_content().endswith(f"({routed})")
    assert row.get_by_test_id("skill-rows").text_content() == str(info["versions"][0]["samples"]["train"])
    assert row.get_by_test_id("gate-score").text_content() == f"{gate['score']:.3f}"
    assert row.get_by_test_id("gate-base").text_content() == f"{gate['base_score']:.3f}"
    assert row.get_by_test_id("gate-trivial").text_content() == f"{gate['trivial_score']:.3f}"
    assert row.get_by_test_id("gate-metric").text_content() == f"{gate['metric']} (n={gate['n']})"
    assert row.get_by_test_id("skill-method").text_content() == "isolated"
    assert row.get_by_test_id("skill-version").text_content() == "v1 of 1"
    screenshot(page, "skills", shots)


def test_playground_shows_the_route_the_header_gives(
    skill: str, console: Console, server: ServerProcess, shots: Path
) -> None:
    text = user_text(rows("long_sequence", "agnews", "test", 1)[0])
    page = console.open(CHAT, "playground")
    page.get_by_label("Max tokens").fill("4")
    page.get_by_label("Prompt").fill(text)
    page.get_by_role("button", name="Send").click()  # auto, streamed
    page.get_by_test_id("timings").filter(has_text="total").wait_for()
    shown = page.get_by_test_id("route").text_content()
    api = httpx.post(
        server.url + "/v1/chat/completions",
        headers=headers(CHAT),
        json={"model": "auto", "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0},
        timeout=120,
    )
    assert api.status_code == 200
    assert shown == api.headers["x-skillpool-route"]
    assert page.get_by_test_id("route-reason").text_content() == api.json()["skillpool"]["reason"]
    screenshot(page, "playground", shots)


def test_chat_and_train_keys_see_no_fallback_cluster_and_no_admin_action(
    skill: str, console: Console, server: ServerProcess, shots: Path
) -> None:
    asked = "What is the capital of France? Answer in one word."
    r = httpx.post(
        server.url + "/v1/chat/completions",
        headers=headers(CHAT),
        json={"model": "auto", "messages": [{"role": "user", "content": asked}], "max_tokens": 2},
        timeout=120,
    )
    assert r.headers["x-skillpool-route"] == "base"  # a fallback: demand no skill serves

    admin = console.open(ADMIN, "routing")
    admin.get_by_test_id("cluster-row").filter(has_text=asked).wait_for()
    screenshot(admin, "routing", shots)
    admin.get_by_role("tab", name="Skills").click()
    admin.get_by_role("button", name=f"Retire {skill}").wait_for()

    for key in (CHAT, TRAIN):
        page = console.open(key, "skills")
        row = page.locator(f'[data-testid="skill-row"][data-skill="{skill}"]')
        row.wait_for()
        assert row.get_by_role("button", name=re.compile("Retire|Roll back")).count() == 0
        page.get_by_role("tab", name="Routing").click()
        page.get_by_role("heading", name="Routing accuracy").wait_for()
        assert page.get_by_test_id("fallback-clusters").count() == 0
        assert asked not in page.locator("body").inner_text()
        served = [x for x in console.watch(page).responses if "/fallback_clusters" in x.url and x.status == 200]
        assert served == [], "the server gave the fallback clusters to a non-admin key"


def test_a_view_the_page_does_not_have_opens_the_skills_view(console: Console) -> None:
    """Every name an object inherits (`#constructor`, `#__proto__`, `#toString`, ...) and names of no view at all
    open the Skills view: the page never goes blank (Console checks that no page error was thrown)."""
    inherited = console.open(CHAT).evaluate("Object.getOwnPropertyNames(Object.prototype)")
    assert {"constructor", "__proto__", "toString"} <= set(inherited)
    for view in [*inherited, "prototype", "nope", "Skills", "skills/1", "%E2%80%A8"]:
        page = console.open(CHAT, view)
        page.get_by_test_id("view-skills").wait_for(state="visible", timeout=15_000)
        assert page.evaluate("location.hash") == "#skills", view
        assert page.get_by_role("tab", name="Skills").get_attribute("aria-selected") == "true", view
