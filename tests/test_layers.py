"""Layer contracts: runtime <- lora <- adapters_store <- router <- trainer <- server <- evaluation <- cli (the dispatcher), read from
the source (function-level imports included), and `skillpool worker` loads no `skillpool.server` module."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYERS = [
    "runtime",
    "lora",
    "adapters_store",
    "router",
    "trainer",
    "server",
    "evaluation",
    "cli",
]  # each may import only leftwards


def _module_file(module: str) -> Path | None:
    """The source file of `skillpool.<folder>...`, or None for anything else."""
    parts = module.split(".")
    if parts[0] != "skillpool" or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    base = REPO.joinpath(*parts[1:])
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def _imports(f: Path) -> Iterator[str]:
    """Every skillpool module `f` imports, anywhere in it; `from pkg import name` also yields pkg.name."""
    package = ["skillpool", *f.relative_to(REPO).parent.parts]
    for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            yield module
            yield from (f"{module}.{a.name}" for a in node.names)


def _sources() -> Iterator[tuple[str, Path]]:
    for layer in LAYERS:
        for f in sorted((REPO / layer).rglob("*.py")):
            yield layer, f


def test_packages_import_only_the_layers_below_them() -> None:
    wrong = [
        f"{f.relative_to(REPO)} imports {m}"
        for layer, f in _sources()
        for m in _imports(f)
        if m.startswith("skillpool.") and m.split(".")[1] in LAYERS
        if LAYERS.index(m.split(".")[1]) > LAYERS.index(layer)
    ]
    assert not wrong, "\n".join(wrong)


def test_the_worker_command_reaches_no_server_module_in_its_source() -> None:
    """The static closure of trainer.jobs.worker (imports inside functions too: what `run` loads when it runs)."""
    seen, todo = set(), ["skillpool.trainer.jobs.worker"]
    while todo:
        module = todo.pop()
        f = _module_file(module)
        if module in seen or f is None:
            continue
        seen.add(module)
        todo.extend(_imports(f))
    assert "skillpool.trainer.jobs.worker" in seen
    assert not [m for m in seen if m.startswith("skillpool.server")], sorted(seen)


def test_skillpool_worker_loads_no_server_module() -> None:
    """A fresh interpreter: the dispatcher builds `worker`'s parser and imports what its run imports."""
    code = (
        "import sys\n"
        "from skillpool.cli.main import main\n"
        "try:\n    main(['worker', '--help'])\nexcept SystemExit:\n    pass\n"
        "import skillpool.trainer.jobs.worker, skillpool.trainer.jobs.runner, skillpool.trainer.jobs.redis_queue\n"
        "import skillpool.trainer.bus\n"
        "import skillpool.trainer.skill_trainer, skillpool.router.build\n"
        "print(sorted(m for m in sys.modules if m.startswith('skillpool.server')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_product_tests_never_import_the_benchmarks() -> None:
    """The benchmarks may use the tests' fixtures (tests/synthetic.py), never the other way round: tests of the
    product stay runnable when load_tests/ changes. Only tests/load_tests/, the benchmarks' own tests, import it."""
    wrong = []
    for f in sorted((REPO / "tests").rglob("*.py")):
        if f.is_relative_to(REPO / "tests" / "load_tests"):
            continue
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            wrong += [f"{f.relative_to(REPO)} imports {n}" for n in names if n.split(".")[0] == "load_tests"]
    assert not wrong, "\n".join(wrong)
