"""The user documentation stays navigable and short: every relative link in README.md and docs/**/*.md points at
a file that exists and, with a #anchor, at a heading of that file (GitHub's slug rules); every page stays
within its own line budget (a reader's attention per page, not a total that pages trade against each other)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# lines a page may hold: a page that outgrows its budget should split by topic, not lose content to stay under it
BUDGETS = {
    "README.md": 240,
    "docs/benchmarks.md": 400,
    "docs/operations.md": 320,
    "docs/serving.md": 360,
}
DEFAULT_BUDGET = 250

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[(?:[^\]\n]|\][^(\n])*?\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _prose(text: str) -> str:
    """The text without fenced code blocks (their '#' lines are comments, their brackets code)."""
    return _FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercased, punctuation but '-' and '_' removed, spaces
    turned into hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor, with GitHub's -1, -2 … for repeated headings."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, title in _HEADING.findall(_prose(page.read_text(encoding="utf-8"))):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """`target (why)` for each relative link of `page` that does not resolve."""
    text = _INLINE_CODE.sub("", _prose(page.read_text(encoding="utf-8")))
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    return broken


def test_slug_follows_github() -> None:
    assert slug("Upload with `skillpool upload` or `/tasks`") == "upload-with-skillpool-upload-or-tasks"
    assert slug("On a GPU") == "on-a-gpu"
    assert slug("Quality gate, versions and names") == "quality-gate-versions-and-names"
    assert slug("`auto` against what it routes to") == "auto-against-what-it-routes-to"


def test_a_broken_link_is_caught(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\n## Part one\n", encoding="utf-8")
    page = tmp_path / "b.md"
    page.write_text(
        "# B\n\n[fine](a.md#part-one) [gone](missing.md) [bad anchor](a.md#part-two) [self](#b)\n"
        "```bash\n# a comment, not a heading; [not](a link.md)\n```\n`[code](nope.md)` [web](https://example.com)\n",
        encoding="utf-8",
    )
    assert broken_links(page) == ["missing.md (no such file)", "a.md#part-two (no heading #part-two in a.md)"]


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert not broken_links(page), f"{page.relative_to(ROOT)} has broken links: {broken_links(page)}"


def test_every_page_stays_within_its_budget() -> None:
    lines = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines()) for p in pages()}
    over = {page: n for page, n in lines.items() if n > BUDGETS.get(page, DEFAULT_BUDGET)}
    assert not over, f"pages over their line budget (tests/test_docs.py BUDGETS): {over}"
    assert set(BUDGETS) <= set(lines), f"budgets for pages that do not exist: {set(BUDGETS) - set(lines)}"


_COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")
_FIGURE = re.compile(r"\d(?:[\d,]*\.\d+)? ?(?:×|ms\b|tokens/s|GiB\b)")


def undated_sections(text: str) -> list[str]:
    """The `## ` sections of a benchmarks page that give measured figures without the commit they were measured at
    (or say they are not recorded yet)."""
    out = []
    for section in re.split(r"^(?=## )", _prose(text), flags=re.M):
        title = section.splitlines()[0] if section.strip() else ""
        if _FIGURE.search(section) and not _COMMIT.search(section) and "not recorded" not in section:
            out.append(title)
    return out


@pytest.mark.parametrize("page", ["benchmarks.md", "scale-out.md", "structured-outputs.md"])
def test_every_measured_figure_names_its_commit(page: str) -> None:
    """The pages that report runs (other pages' figures are settings, formulas or links to these)."""
    assert undated_sections((ROOT / "docs" / page).read_text()) == []


def test_an_undated_figure_is_caught() -> None:
    assert undated_sections("## A\n\n0.93× at 957db60\n\n## B\n\n19.2 tokens/s\n") == ["## B"]
