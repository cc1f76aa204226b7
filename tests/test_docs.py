"""The docs: the site builds with every link and anchor resolving (``mkdocs build --strict``), the
README is a front page, the configuration reference is the config tree, and every option the docs
name exists (removing or renaming one fails here, naming the page and line)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from policygrad.config.reference import option_rows, options_markdown
from policygrad.config.train import TrainConfig
from policygrad.specs.estimators import BUILTIN_ESTIMATORS
from policygrad.specs.losses import list_policy_losses, policy_loss_options

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Pages about the code's layout name modules (``rollout.samplers``), not options.
CODE_PAGES = {"architecture.md", "layout.md"}


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(p for p in DOCS.glob("*.md") if p.name not in CODE_PAGES)]


def test_the_site_builds_strictly(tmp_path):
    """Every page in the nav, every link and anchor resolving, every API entry found: one warning
    fails the build."""
    if shutil.which("mkdocs", path=os.path.dirname(sys.executable)) is None:
        pytest.fail("mkdocs is not installed: pip install -e '.[test]' (or '.[docs]')")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    index = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert "Quick start" in index and 'href="agents/"' in index  # the README, its links rewritten
    assert "estimate_advantages" in (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    # A list that fell apart (a block inside an item not indented as Markdown's lists need, an
    # indented paragraph swallowing the next item) shows its "- " as text: no page may.
    broken = {}
    for page in (tmp_path / "site").rglob("*.html"):
        text = re.sub(r"<pre.*?</pre>", "", page.read_text(encoding="utf-8"), flags=re.S)
        found = [line for line in text.splitlines() if re.match(r"\s*- \S", line)]
        if found:
            broken[str(page.relative_to(tmp_path / "site"))] = found[:2]
    assert broken == {}


def test_the_readme_is_a_front_page_whose_links_resolve():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 250
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert targets, "the README links to its pages"
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert missing == []
    linked = {Path(t).name for t in targets if t.startswith("docs/")}
    unlinked = {p.name for p in DOCS.glob("*.md")} - linked - {"api.md", "papers.md"}
    assert unlinked == set(), "every page is reachable from the front page"


def test_the_configuration_reference_is_the_config_tree():
    text = (DOCS / "options.md").read_text(encoding="utf-8")
    found = re.search(r"<!-- options:start -->\n(.*?)\n<!-- options:end -->", text, re.S)
    assert found, "docs/options.md has no options:start/end block"
    assert found.group(1).strip() == options_markdown(TrainConfig), (
        "regenerate: python -c 'from policygrad.config.reference import options_markdown as m; "
        "from policygrad.config.train import TrainConfig as T; print(m(T))'"
    )


def documented_options(text: str) -> list[tuple[int, str]]:
    """``(line, name)`` of every dotted option a page names (``rollout.max_turns``,
    ``--kl.beta=0.1``): a token starting with a config section, not part of a path or module."""
    sections = sorted({name.split(".")[0] for name, _, _ in option_rows(TrainConfig) if "." in name})
    pattern = re.compile(
        rf"(?<![\w./-])(?:--)?((?:{'|'.join(sections)})(?:\.[a-z_][a-z0-9_]*)+)(?![\w/]|\.py)"
    )
    return [(i, m.group(1)) for i, line in enumerate(text.splitlines(), 1) for m in pattern.finditer(line)]


def known(name: str) -> bool:
    """An option of the tree, a section of it, or an estimator's / policy loss's option."""
    names = {n for n, _, _ in option_rows(TrainConfig)}
    sections = {".".join(n.split(".")[:k]) for n in names for k in range(1, n.count(".") + 1)}
    estimator = {o for spec in BUILTIN_ESTIMATORS for o in spec.options}
    loss = {o for n in list_policy_losses() for o in policy_loss_options(n)}
    head, _, key = name.rpartition(".")
    return (
        name in names
        or name in sections
        or (head == "advantage.options" and key in estimator)
        or (head == "loss.options" and key in loss)
    )


def test_every_option_the_docs_name_exists():
    # A deliberate typo shown with the error it gets is the one exception.
    allowed = {"kl.bta"}
    unknown = [
        f"{page.relative_to(ROOT)}:{line}: {name}"
        for page in pages()
        for line, name in documented_options(page.read_text(encoding="utf-8"))
        if not known(name) and name not in allowed
    ]
    assert unknown == []


def test_a_removed_option_is_found():
    """The check above fails for an option the tree no longer has (the fake page names one)."""
    text = "Set `rollout.max_turns` and `--rollout.no_such_option=3`; see `policygrad.envs.agent`.\n"
    found = documented_options(text)
    assert found == [(1, "rollout.max_turns"), (1, "rollout.no_such_option")]
    assert [known(name) for _, name in found] == [True, False]
