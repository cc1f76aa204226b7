"""The package's layout rules (docs/architecture.md, "Layout"), checked on the source.

- every module under :data:`MAX_LINES` lines; ``trainer/`` at most :data:`TRAINER_FILES` files;
- ``lab/`` (experiments) is imported only by ``lab/``, ``cli.py`` and ``api.py``;
- an import inside a function carries a comment saying why (an optional dependency, a cycle,
  a light ``import policygrad``), on its line or the line above;
- no module imports a private name (``_x``) of another module;
- the "who imports whom" table of docs/architecture.md is the package's import graph.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "policygrad"
MAX_LINES = 500
TRAINER_FILES = 6
LAB_IMPORTERS = ("policygrad/lab/", "policygrad/cli.py", "policygrad/api.py")


def sources() -> dict[str, str]:
    """Every module's text by its path from the repository root."""
    paths = sorted(PACKAGE.rglob("*.py"))
    return {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in paths}


def imports(text: str) -> list[tuple[ast.AST, str, list[str], bool]]:
    """``(node, imported module, names, inside a function)`` of every import of a module's text."""
    out = []

    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                out.extend((child, a.name, [], in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                out.append((child, child.module, [a.name for a in child.names], in_function))
            walk(child, inner)

    walk(ast.parse(text), False)
    return out


def unit(path_or_module: str) -> str:
    """The layout unit of a module: its subpackage (``config``), or the top-level module's name."""
    parts = path_or_module.removesuffix(".py").replace("/", ".").split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def import_graph() -> dict[str, set[str]]:
    """unit -> the other units it imports from (the package's ``__init__``/``__main__`` left out)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for path, text in sources().items():
        me = unit(path)
        if me in ("__init__", "__main__"):
            continue
        graph[me]
        for _, module, names, _ in imports(text):
            if module == "policygrad":
                targets = names
            elif module.startswith("policygrad."):
                targets = [unit(module)]
            else:
                continue
            graph[me].update(t for t in targets if t not in (me, "__version__"))
    return graph


def test_every_module_is_under_the_line_cap():
    long = {p: t.count("\n") for p, t in sources().items() if t.count("\n") >= MAX_LINES}
    assert not long, f"modules of {MAX_LINES} lines or more: {long}"


def test_the_trainer_package_is_small():
    files = sorted(p.name for p in (PACKAGE / "trainer").glob("*.py"))
    assert len(files) <= TRAINER_FILES, files


def test_lab_is_imported_only_by_the_lab_and_the_entry_points():
    found = [
        path
        for path, text in sources().items()
        if not path.startswith(LAB_IMPORTERS)
        for _, module, names, _ in imports(text)
        if module.startswith("policygrad.lab") or (module == "policygrad" and "lab" in names)
    ]
    assert not found, found


def has_reason(lines: list[str], i: int) -> bool:
    """Line ``i`` (an import) carries a comment, or the block of imports it belongs to does: the
    first line above the block (blank lines skipped) or one of its imports has a comment."""
    while i >= 0:
        line = lines[i].strip()
        if "#" in line:
            return True
        if line and not line.startswith(("import ", "from ")):
            return False
        i -= 1
    return False


def test_imports_inside_functions_say_why():
    silent = []
    for path, text in sources().items():
        lines = text.splitlines()
        for node, module, _, in_function in imports(text):
            if not in_function:
                continue
            if not has_reason(lines, node.lineno - 1):
                silent.append(f"{path}:{node.lineno} {module}")
    assert not silent, "function-level imports without a reason:\n" + "\n".join(silent)


def test_no_module_imports_a_private_name():
    private = [
        f"{path}: {module}.{name}"
        for path, text in sources().items()
        for _, module, names, _ in imports(text)
        if module.startswith("policygrad")
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]
    assert not private, private


def documented_graph() -> dict[str, set[str]]:
    """The "who imports whom" block of docs/architecture.md: ``unit -> a, b, c`` lines between
    the ``<!-- import graph -->`` markers."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- import graph -->\n```\n(.*?)```\n<!-- /import graph -->", text, re.S)
    assert block, "docs/architecture.md has no import graph block"
    graph = {}
    for line in block.group(1).splitlines():
        name, _, targets = line.partition("->")
        graph[name.strip()] = {t.strip() for t in targets.split(",") if t.strip()}
    return graph


def test_the_architecture_page_shows_the_import_graph():
    graph = {k: v for k, v in import_graph().items()}
    assert documented_graph() == graph, "\n".join(
        f"{k:10s} -> {', '.join(sorted(v))}" for k, v in sorted(graph.items())
    )
