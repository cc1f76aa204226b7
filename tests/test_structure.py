"""Every module of the package has a test file of its own.

The test file of ``policygrad/<pkg>/<m>.py`` is ``tests/<pkg>/test_<m>.py`` (of ``policygrad/<m>.py``,
``tests/test_<m>.py``), unless :data:`TEST_FILE_OF` names another file that tests that module
(it must exist and import or mention the module). ``__init__.py`` and ``__main__.py`` need none.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "policygrad"

# Modules whose test file is not at the rule's path: module -> its test file.
TEST_FILE_OF = {
    # The command line is tested through its commands, with the trainer's fixtures.
    "policygrad/cli.py": "tests/trainer/test_cli.py",
    # LoRA adapters in and out: loading a run from an adapter, merged exports, adapter mistakes.
    "policygrad/models/adapters.py": "tests/trainer/test_adapters.py",
    # The code_tests reward's pure parts (its sandbox runs are in tests/sandbox/test_runner.py).
    "policygrad/rewards/code.py": "tests/rewards/test_code_reward.py",
    # The builtin:guess rows are tested with the environment that plays them.
    "policygrad/data/guess_task.py": "tests/envs/test_guess.py",
    # The rollout server's HTTP calls and its weight-transfer engine run against real servers.
    "policygrad/rollout/server_api.py": "tests/rollout/test_server.py",
    "policygrad/rollout/transfer_worker.py": "tests/rollout/test_server.py",
}


def modules() -> list[str]:
    """Every module of the package as a path from the repository root (``policygrad/core/kl.py``)."""
    found = (ROOT / PACKAGE).rglob("*.py")
    return sorted(
        p.relative_to(ROOT).as_posix() for p in found if p.name not in ("__init__.py", "__main__.py")
    )


def rule_path(module: str) -> str:
    """``policygrad/<pkg>/<m>.py`` -> ``tests/<pkg>/test_<m>.py``; ``policygrad/<m>.py`` ->
    ``tests/test_<m>.py``."""
    path = Path(module)
    inside = path.relative_to(PACKAGE)
    return (Path("tests") / inside.parent / f"test_{inside.name}").as_posix()


def dotted(module: str) -> str:
    return module.removesuffix(".py").replace("/", ".")


def mentions(test_file: str, module: str) -> bool:
    """The test file imports the module (``from policygrad.rewards.code import ...``, ``from
    policygrad.rewards import code``, ``import policygrad.rewards.code``) or names it
    (``policygrad.rewards.code`` anywhere, a docstring too)."""
    text = (ROOT / test_file).read_text(encoding="utf-8")
    name = dotted(module)
    if re.search(rf"\b{re.escape(name)}(?![\w])", text):
        return True
    parent, _, leaf = name.rpartition(".")
    for node in ast.walk(ast.parse(text)):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module == parent
            and any(a.name == leaf for a in node.names)
        ):
            return True
    return False


def test_the_path_rule():
    assert rule_path("policygrad/cli.py") == "tests/test_cli.py"
    assert rule_path("policygrad/trainer/loop.py") == "tests/trainer/test_loop.py"
    assert rule_path("policygrad/a/b/m.py") == "tests/a/b/test_m.py"


def test_the_walk_finds_every_module_and_no_package_file():
    found = modules()
    assert {"policygrad/api.py", "policygrad/core/kl.py", "policygrad/trainer/loop.py"} <= set(found)
    assert not [m for m in found if m.endswith(("/__init__.py", "/__main__.py"))]
    assert len(found) > 50  # a walk of the wrong folder would find none


def test_every_module_has_its_test_file():
    missing = []
    for module in modules():
        if module in TEST_FILE_OF:
            continue
        if not (ROOT / rule_path(module)).is_file():
            missing.append(f"{module} has no test file: create {rule_path(module)}")
    assert not missing, "\n".join(missing)


def test_the_table_of_modules_and_their_test_files():
    """Every module with the test file that tests it (the rule's path, or its mapping)."""
    table = {m: TEST_FILE_OF.get(m, rule_path(m)) for m in modules()}
    assert len(table) == len(modules()) and all((ROOT / t).is_file() for t in table.values()), table


@pytest.mark.parametrize("module", sorted(TEST_FILE_OF))
def test_each_mapped_test_file_exists_and_names_its_module(module):
    test_file = TEST_FILE_OF[module]
    assert (ROOT / module).is_file(), f"TEST_FILE_OF names {module}, which is not a module any more; drop it"
    assert (ROOT / test_file).is_file(), f"TEST_FILE_OF maps {module} to {test_file}, which does not exist"
    assert mentions(test_file, module), f"{test_file} neither imports nor mentions {dotted(module)}"
    assert not (ROOT / rule_path(module)).is_file(), (
        f"{module} has its own test file {rule_path(module)} now; drop its TEST_FILE_OF entry ({test_file})"
    )


def test_mentions_tells_a_module_from_its_neighbours(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "a.py").write_text("from policygrad.data.code_task import x\n")
    (tmp_path / "b.py").write_text("from policygrad.sandbox import worker\n")
    (tmp_path / "c.py").write_text("from policygrad.rewards import (\n    code,\n)\n")
    assert not mentions("a.py", "policygrad/data/code.py")  # code_task is another module
    assert mentions("a.py", "policygrad/data/code_task.py")
    assert mentions("b.py", "policygrad/sandbox/worker.py")
    assert not mentions("b.py", "policygrad/sandbox/runner.py")
    assert mentions("c.py", "policygrad/rewards/code.py")  # an import over several lines
    assert not mentions("c.py", "policygrad/data/code.py")
