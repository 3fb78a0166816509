"""The README is a front door that must stay true: its server-start command starts a server, and its Python
snippet gets an answer from it through the real `openai` client, with the routing decision attached.

The command and the snippet are read from README.md, not copied here: the server runs the README's own
`.venv/bin/skillpool serve ...` line (port and data dir swapped for a free port and a temporary folder), and the
snippet's `base_url`, `model`, messages and its read of the routing field are taken from its code. Also: the
README stays at most 250 lines and every relative link in it points at a file that exists.

SKILLPOOL_README_SKILLPOOL replaces the command's executable where `.venv/bin/skillpool` is not installed (a
worktree sharing another environment), e.g. `SKILLPOOL_README_SKILLPOOL="/path/python -m skillpool.cli.main"`.
CI leaves it unset and runs the README's command as written.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 250
STARTUP_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def readme() -> str:
    return README.read_text(encoding="utf-8")


def serve_command(text: str) -> list[str]:
    """The first inline-code `… skillpool serve …` command that names no engine (the quickstart's)."""
    for code in re.findall(r"`([^`\n]+)`", text):
        argv = shlex.split(code)
        if len(argv) >= 2 and Path(argv[0]).name == "skillpool" and argv[1] == "serve" and "--engine" not in argv:
            return argv
    raise AssertionError("README.md gives no `skillpool serve ...` command to start the server")


def with_arg(argv: list[str], flag: str, value: str) -> list[str]:
    """argv with `flag`'s value replaced (`--flag V` or `--flag=V`); the flag must be there."""
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return [*argv[: i + 1], value, *argv[i + 2 :]]
        if a.startswith(flag + "="):
            return [*argv[:i], f"{flag}={value}", *argv[i + 1 :]]
    raise AssertionError(f"the README's server command {shlex.join(argv)!r} has no {flag}")


def executable(argv: list[str]) -> list[str]:
    """The README command's executable, resolved from the repository root, or the override's words."""
    if override := os.environ.get("SKILLPOOL_README_SKILLPOOL"):
        return [*shlex.split(override), *argv[1:]]
    exe = Path(argv[0]) if Path(argv[0]).is_absolute() else ROOT / argv[0]
    if not os.access(exe, os.X_OK):
        pytest.fail(
            f"the README's server command runs {argv[0]!r}, which is not installed at {exe}: run `bash setup.sh` "
            "first (or set SKILLPOOL_README_SKILLPOOL to a command that runs skillpool, e.g. "
            "'/path/python -m skillpool.cli.main')"
        )
    return [str(exe), *argv[1:]]


def python_snippet(text: str) -> str:
    """The first ```python block that creates an OpenAI client and a chat completion (the "Use it" snippet)."""
    for code in re.findall(r"```python\n(.*?)```", text, re.S):
        if "OpenAI(" in code and "chat.completions.create(" in code:
            return str(code)
    raise AssertionError("README.md has no ```python snippet that sends a chat with the openai client")


def snippet_call(snippet: str) -> tuple[dict, dict]:
    """The keyword arguments, as literals, of the snippet's `OpenAI(...)` and `chat.completions.create(...)`."""
    client_kw: dict = {}
    chat_kw: dict = {}
    for node in ast.walk(ast.parse(snippet)):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name == "OpenAI":
            client_kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
        elif name.endswith("chat.completions.create"):
            chat_kw = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
    assert "base_url" in client_kw and "model" in chat_kw and "messages" in chat_kw, snippet
    return client_kw, chat_kw


def test_readme_is_short() -> None:
    n = len(readme().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; at most {MAX_LINES}: detail goes to docs/"


def test_readme_relative_links_point_at_files() -> None:
    text = re.sub(r"```.*?```", "", readme(), flags=re.S)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets, "README.md links to nothing"
    broken = []
    for t in targets:
        if urlsplit(t).scheme or t.startswith(("#", "mailto:")):
            continue
        path = t.split("#", 1)[0]
        if path and not (README.parent / path).exists():
            broken.append(t)
    assert not broken, f"README.md links to missing files: {broken}"


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The README's server command on a free port and a fresh data dir; yields the base URL once /readyz is 200."""
    tmp = tmp_path_factory.mktemp("readme")
    port = free_port()
    argv = with_arg(with_arg(serve_command(readme()), "--port", str(port)), "--data-dir", str(tmp / "data"))
    cmd = executable(argv)
    log_path = tmp / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"}
        )
    url = f"http://127.0.0.1:{port}"

    def tail() -> str:
        return log_path.read_text(errors="replace")[-3000:]

    try:
        deadline = time.time() + STARTUP_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"`{shlex.join(cmd)}` exited with {proc.returncode}; its log ends:\n{tail()}")
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail(f"`{shlex.join(cmd)}` was not ready (/readyz) within {STARTUP_S}s; its log ends:\n{tail()}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_readme_server_answers_the_readme_snippet(readme_server: str) -> None:
    from openai import OpenAI

    snippet = python_snippet(readme())
    client_kw, chat_kw = snippet_call(snippet)
    documented = urlsplit(client_kw["base_url"])
    assert documented.port == 8000 and documented.path == "/v1", client_kw  # what the serve command's --port gives
    client_kw["base_url"] = f"{readme_server}{documented.path}"
    client = OpenAI(**client_kw, max_retries=0, timeout=300)
    chat_kw.setdefault("max_tokens", 32)  # the snippet's call as written, bounded so a slow CPU stays quick
    r = client.chat.completions.create(**chat_kw)
    answer = r.choices[0].message.content
    assert answer and answer.strip(), r
    assert 'r.model_extra["skillpool"]' in snippet  # the snippet reads the routing decision from this field
    decision = r.model_extra["skillpool"]
    assert decision["reason"] in ("matched", "forced", "base", "below_threshold", "format_mismatch", "no_skills")
    assert isinstance(decision["route"], list), decision
    print(f"\nREADME chat: {answer!r} {decision}")
