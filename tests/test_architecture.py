"""docs/design/architecture.md matches the code: every package and subpackage appears on it, every module its
package table names lives in that package, and every other path it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "design" / "architecture.md"
PACKAGES = ("runtime", "lora", "adapters_store", "router", "trainer", "server", "evaluation", "cli")
_PATH = re.compile(r"(?<![\w./-])([a-z_]+(?:/[a-z_]+)*(?:/|\.py))(?![\w/-])")


def text() -> str:
    return PAGE.read_text(encoding="utf-8")


def subpackages() -> list[Path]:
    return [p.parent for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("__init__.py"))]


def table() -> dict[str, str]:
    """The package table: package -> the row's 'owns' cell."""
    return dict(re.findall(r"^\| `([a-z_]+)/` \| (.*) \|$", text(), re.M))


def resolves(path: str) -> bool:
    """A path as the page writes it: from the repository root, or from a package (`chat/serving.py` in server/)."""
    bases = [ROOT, *subpackages()]
    return any((base / path.rstrip("/")).exists() for base in bases)


def test_every_package_and_subpackage_appears() -> None:
    assert list(table()) == list(PACKAGES)
    page = text()
    missing = [str(p.relative_to(ROOT)) for p in subpackages() if f"{p.name}/" not in page]
    assert not missing, f"packages the page does not name: {missing}"


def test_each_package_rows_modules_live_in_that_package() -> None:
    wrong = []
    for pkg, cell in table().items():
        for name in re.findall(r"`([a-z_]+(?:/[a-z_]+)*(?:\.py|/))`", cell):
            if not (ROOT / pkg / name.rstrip("/")).exists():
                wrong.append(f"{pkg}/{name}")
    assert not wrong, f"named in the package table but not in that package: {wrong}"


def test_every_path_the_page_names_exists() -> None:
    paths = set(_PATH.findall(text()))
    assert len(paths) > 40  # the pattern finds the page's paths
    gone = sorted(p for p in paths if not resolves(p))
    assert not gone, f"paths on the page that do not exist: {gone}"


def test_a_stale_path_is_caught() -> None:
    assert resolves("server/routing.py") and resolves("chat/serving.py") and resolves("engines/")
    assert not resolves("server/no_such_module.py") and not resolves("adapters_store/lora_bank.py")
