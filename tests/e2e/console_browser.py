"""The console in a real browser: Debian's chromium driven by Playwright, and the checks every page must pass
(tests/e2e/test_console_browser.py): no dialog, no CSP violation, no page error, and the CSP on every console
document and script."""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from skillpool.server.console import CSP

# every console response's CSP violation, recorded by the page itself (an init script is not subject to the CSP)
RECORD_CSP = (
    "window.__csp = []; document.addEventListener('securitypolicyviolation', "
    "(e) => window.__csp.push(e.violatedDirective + ' ' + e.blockedURI));"
)


def chromium() -> str:
    found = shutil.which("chromium") or ("/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None)
    if found is None:
        pytest.skip("no Chromium for the console's browser tests: install it with `bash setup.sh --browser`")
    return found


def screenshot(page: Any, name: str, folder: Path) -> None:
    """The view as a PNG in `folder`, and in the folder SKILLPOOL_CONSOLE_SCREENSHOTS names when it is set."""
    page.wait_for_timeout(300)  # the last poll's redraw
    page.screenshot(path=str(folder / f"console-{name}.png"))
    if out := os.environ.get("SKILLPOOL_CONSOLE_SCREENSHOTS"):
        Path(out).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder / f"console-{name}.png", Path(out) / f"console-{name}.png")


@dataclass
class Watch:
    """What one page did that the console must never do, and the responses it got."""

    dialogs: list[str] = field(default_factory=list)
    csp: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    responses: list[Any] = field(default_factory=list)
    keyed: int = 0  # responses[keyed:] came after the key was entered

    def api_calls(self) -> list[Any]:
        return [r for r in self.responses[self.keyed :] if "/v1/" in r.url or "/tasks" in r.url]


class Console:
    """Pages on the console, each in a fresh browser context (its own sessionStorage), checked when closed."""

    def __init__(self, browser: Any, url: str) -> None:
        self.browser, self.url = browser, url
        self.pages: list[tuple[Any, Any, Watch]] = []

    def open(self, key: str | None, view: str = "skills") -> Any:
        context = self.browser.new_context(viewport={"width": 1280, "height": 800})
        context.add_init_script(RECORD_CSP)
        page, watch = context.new_page(), Watch()

        def dialog(d: Any) -> None:
            watch.dialogs.append(d.message)
            d.dismiss()

        page.on("dialog", dialog)
        page.on("console", lambda m: watch.csp.append(m.text) if "Content Security Policy" in m.text else None)
        page.on("pageerror", lambda e: watch.errors.append(str(e)))
        page.on("response", lambda r: watch.responses.append(r))
        self.pages.append((context, page, watch))
        page.goto(f"{self.url}/console#{view}")
        if key is not None:  # as a user does: the key form, which reloads the page with the key in sessionStorage
            page.get_by_label("API key").fill(key)
            watch.keyed = len(watch.responses)
            with page.expect_navigation():
                page.get_by_role("button", name="Use key").click()
        # a locator, not wait_for_function: that one evaluates a string in the page, which the CSP refuses
        page.get_by_test_id("who").filter(has_text=re.compile(r"\S")).wait_for()
        return page

    def watch(self, page: Any) -> Watch:
        return next(w for _, p, w in self.pages if p is page)

    def check(self) -> None:
        for _, page, watch in self.pages:
            assert watch.dialogs == [], f"the page opened dialogs: {watch.dialogs}"
            assert watch.csp == [] and page.evaluate("window.__csp") == [], (watch.csp, page.evaluate("window.__csp"))
            assert watch.errors == [], watch.errors
            assert page.evaluate("window.__pwned") is None
            for r in watch.responses:
                if r.url.startswith(f"{self.url}/console") and r.request.resource_type in ("document", "script"):
                    h = r.all_headers()
                    assert h.get("content-security-policy") == CSP, (r.url, h)
                    assert h.get("x-content-type-options") == "nosniff", (r.url, h)

    def close(self) -> None:
        try:
            self.check()
        finally:
            for context, _, _ in self.pages:
                context.close()
