"""The console page (server/console): served at /console from the installed package's files, every response under
/console with the CSP and nosniff, a page with no inline script or style and no HTML parsing of data, and `/console/`
(as every route with a slash added) redirected with a relative Location, whatever the Host header."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from html.parser import HTMLParser
from importlib.resources import files
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from skillpool.server.app import create_app
from skillpool.server.auth import KeyRing
from skillpool.server.console import CSP, install_console, static_dir

ROOT = Path(__file__).resolve().parents[2]
STATIC = static_dir()
SCRIPTS = sorted(STATIC.glob("*.js"))


@pytest.fixture(scope="module")
def page_client() -> TestClient:
    app = FastAPI()
    install_console(app)
    return TestClient(app)


def test_the_files_are_the_installed_packages() -> None:
    assert STATIC == Path(str(files("skillpool.server.console").joinpath("static")))
    assert {p.name for p in STATIC.iterdir()} >= {"index.html", "console.js", "console.css"}


def test_package_data_ships_every_file(tmp_path: Path) -> None:
    """What pyproject's package-data globs match is what a wheel carries: every file the page needs."""
    if sys.version_info < (3, 11):
        pytest.skip("tomllib is Python 3.11+")
    import tomllib

    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "skillpool.server.console" in cfg["packages"]
    globs = cfg["package-data"]["skillpool.server.console"]
    shipped = {p for g in globs for p in STATIC.parent.glob(g)}
    assert set(STATIC.iterdir()) <= shipped, set(STATIC.iterdir()) - shipped


def test_page_and_its_files_carry_the_csp(page_client: TestClient) -> None:
    paths = ["/console", *(f"/console/static/{p.name}" for p in STATIC.iterdir()), "/console/static/missing.js"]
    for path in paths:
        r = page_client.get(path)
        assert r.status_code == (404 if "missing" in path else 200), path
        assert r.headers["content-security-policy"] == CSP, path
        assert r.headers["x-content-type-options"] == "nosniff", path
    assert page_client.get("/console").text == (STATIC / "index.html").read_text()
    assert page_client.get("/console/static/console.js").headers["content-type"].startswith("text/javascript")


def test_the_policy_allows_no_inline_script_and_no_other_origin() -> None:
    directives = dict(d.strip().split(" ", 1) for d in CSP.split(";"))
    assert directives["script-src"] == "'self'" and directives["style-src"] == "'self'"
    assert directives["default-src"] == "'self'" and directives["object-src"] == "'none'"
    assert "unsafe" not in CSP and "http" not in CSP and "*" not in CSP


def test_only_the_page_is_served_not_the_package(page_client: TestClient) -> None:
    assert page_client.get("/console/static/%2e%2e/__init__.py").status_code == 404
    assert page_client.get("/console/static/..%2f__init__.py").status_code == 404
    assert page_client.get("/v1/models").headers.get("content-security-policy") is None  # the APIs are not the page's


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[dict[str, str | None]] = []
        self.inline: list[str] = []
        self.bad_attrs: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.bad_attrs += [f"{tag}.{k}" for k, _ in attrs if k.startswith("on") or k == "style"]
        if tag == "style":
            self.bad_attrs.append("<style>")
        if tag == "script":
            self.scripts.append(dict(attrs))
            self._in_script = True

    def handle_endtag(self, tag: str) -> None:
        self._in_script = self._in_script and tag != "script"

    def handle_data(self, data: str) -> None:
        if self._in_script and data.strip():
            self.inline.append(data)


def test_index_has_no_inline_script_or_style() -> None:
    page = _Page()
    page.feed((STATIC / "index.html").read_text())
    assert page.scripts == [{"type": "module", "src": "/console/static/console.js"}]
    assert page.inline == [] and page.bad_attrs == []


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_never_parse_html_and_import_only_their_own_files(script: Path) -> None:
    text = script.read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in text, f"{script.name} uses {sink}"
    assert not re.search(r"setAttribute\(\s*[\"']style", text), script.name  # the CSP refuses inline styles
    for target in re.findall(r"^import .* from \"(.+)\";$", text, re.M):
        assert target.startswith("./") and (STATIC / target[2:]).is_file(), f"{script.name} imports {target}"


def test_the_server_serves_the_console_without_a_key(components) -> None:  # type: ignore[no-untyped-def]
    """The page holds nothing of the pool: it loads without a key, and the APIs it calls still want one."""
    with TestClient(create_app(components, KeyRing(admin_key="k-console-admin"))) as client:
        page = client.get("/console")
        assert page.status_code == 200 and page.headers["content-security-policy"] == CSP
        assert client.get("/v1/models", headers={"authorization": "Bearer wrong"}).status_code == 401
        assert "/console" not in client.get("/openapi.json").json()["paths"]


hosts = st.one_of(
    st.sampled_from(["evil.example", "evil.example:8443", "[::1]:9", "127.0.0.1:8000", "a@b.example", ""]),
    st.from_regex(r"[a-z0-9.-]{1,30}(:[0-9]{1,5})?", fullmatch=True),
)
# text queries, escapes included (a query that is not UTF-8 text is a 400 before any redirect: test_request_text.py)
queries = st.one_of(st.just(""), st.from_regex(r"([a-z0-9=&]|%[2-7][0-9A-F]){1,20}", fullmatch=True))


@pytest.fixture(scope="module")
def app_client(components) -> Iterator[TestClient]:  # type: ignore[no-untyped-def]
    with TestClient(create_app(components)) as client:
        yield client


@given(host=hosts, path=st.sampled_from(["/console/", "/console//", "/healthz/", "/v1/models/"]), query=queries)
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
def test_a_slash_redirect_stays_on_the_host_it_was_asked_of(
    app_client: TestClient, host: str, path: str, query: str
) -> None:
    """Whatever the Host header says, the redirect's Location is a path on this server: never that host."""
    url = path + (f"?{query}" if query else "")
    r = app_client.get(url, headers={"host": host} if host else {}, follow_redirects=False)
    assert r.status_code == 307, r.text
    location = r.headers["location"]
    assert location == path.rstrip("/") + (f"?{query}" if query else ""), location
    assert location.startswith("/") and not location.startswith(("//", "/\\"))
    assert not host or host not in location or host in path + query
    assert app_client.get(location, follow_redirects=False).status_code != 307  # it lands on the route


def test_a_path_that_reads_as_another_host_is_not_redirected_there(app_client: TestClient) -> None:
    for path in ("//evil.example/", "/\\evil.example/", "//evil.example/console/"):
        r = app_client.get(path, follow_redirects=False)
        assert r.status_code == 404 or not r.headers.get("location", "/").startswith(("//", "/\\")), r.headers
