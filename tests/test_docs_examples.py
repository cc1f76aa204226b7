"""The docs' examples run as printed, or say why not.

Every fenced block of the README and the docs pages (the code-layout pages aside) is one of:

- a Python block: executed (the model a training call names replaced by the tiny one, one step,
  the Hugging Face engine), unless a ``<!-- not run: WHY -->`` line precedes it or a
  ``<!-- run by: TEST_FILE -->`` line names the test that runs it;
- a command block (``bash``, or a ``$ `` transcript): every ``policygrad train`` command is
  validated as printed (``--print-config``: the recipe, the overrides and the presets resolve,
  and nothing runs; a transcript of a refused one must print its error), and every
  ``policygrad memory`` command runs and must print its transcript's lines; any other command
  (``eval``, ``serve``, ``lab``, ``torchrun``, ``make``, ``pip``) needs the block's
  ``<!-- not run: WHY -->`` line, which also excuses the block's ``memory`` commands (a
  placeholder folder), never its ``train`` ones;
- output (a plain block without a ``$`` line): nothing to run.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from policygrad.cli import main
from tests.training import eos_model_dir  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parent.parent
CODE_PAGES = {"architecture.md", "layout.md"}
BLOCK = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)
MARK = re.compile(r"<!-- (not run|run by): ([^>]+?) -->\s*$")
# The placeholders the docs use for "yours", and what stands for them here.
PLACEHOLDERS = {"CONFIG.yaml": "configs/grpo.yaml"}


def pages() -> list[Path]:
    docs = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in CODE_PAGES)
    return [ROOT / "README.md", *docs]


def blocks() -> list[dict]:
    """Every fenced block: page, line, language, body, and the marker line before it (if any)."""
    out = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        for m in BLOCK.finditer(text):
            before = [line for line in text[: m.start()].splitlines() if line.strip()][-2:]
            mark = next((found for line in reversed(before) if (found := MARK.search(line))), None)
            out.append(
                {
                    "where": f"{page.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}",
                    "lang": m.group(2),
                    "body": m.group(3),
                    "mark": (mark.group(1), mark.group(2)) if mark else None,
                }
            )
    return out


def commands(block: dict) -> list[tuple[list[str], list[str]]]:
    """``(argv, the output printed after it)`` of each command of a command block (continued
    lines joined, comments dropped, ``$ `` transcripts with their output)."""
    lines = block["body"].splitlines()
    transcript = any(line.startswith("$ ") for line in lines)
    out, i = [], 0
    while i < len(lines):
        line = lines[i]
        if transcript and not line.startswith("$ "):
            i += 1
            continue
        line = line[2:] if transcript else line
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        output = []
        while transcript and i < len(lines) and not lines[i].startswith("$ "):
            output.append(lines[i])
            i += 1
        words = shlex.split(line, comments=True)
        if words:
            out.append(([PLACEHOLDERS.get(w, w) for w in words], output))
    return out


def is_command_block(block: dict) -> bool:
    return block["lang"] in ("bash", "sh", "console") or block["body"].startswith("$ ")


def checked(argv: list[str]) -> bool:
    """A command this test runs (validates) rather than needing a reason not to."""
    return argv[:2] in (["policygrad", "train"], ["policygrad", "memory"]) and "--resume" not in argv


def run_command(argv: list[str]) -> tuple[int, str]:
    """The exit status and the output (stdout and stderr) of ``argv`` through the CLI, in this
    process; a training command only validates its config (``--print-config``)."""
    args = argv[1:] + (["--print-config"] if argv[1] == "train" else [])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = main(args)
    return status, out.getvalue()


@pytest.mark.unit
def test_every_block_runs_or_says_why_not():
    missing = []
    for block in blocks():
        if block["mark"] is not None:
            continue
        if is_command_block(block):  # (an unmarked Python block runs below)
            for argv, _ in commands(block):
                if not checked(argv):
                    missing.append(f"{block['where']}: {' '.join(argv)[:80]} is not run; say why")
    assert missing == []


@pytest.mark.unit
def test_a_run_by_marker_names_a_test_that_reads_its_page():
    for block in blocks():
        if block["mark"] and block["mark"][0] == "run by":
            test = ROOT / block["mark"][1]
            page = block["where"].split(":")[0]
            assert test.is_file(), block["where"]
            assert Path(page).name in test.read_text(encoding="utf-8"), (block["where"], test)


COMMANDS = [
    pytest.param(argv, output, id=f"{block['where']}:{' '.join(argv[:3])}")
    for block in blocks()
    if is_command_block(block)
    for argv, output in commands(block)
    if checked(argv) and (argv[1] == "train" or block["mark"] is None)
]


@pytest.mark.unit
@pytest.mark.parametrize(("argv", "output"), COMMANDS)
def test_a_documented_command_runs_as_printed(argv, output, monkeypatch, tmp_path):
    """A training command's config resolves (a transcript of a refused one prints its error); a
    memory command runs and prints the transcript's lines."""
    if argv[1] == "train":
        monkeypatch.chdir(ROOT)  # recipes and example files are named from the repository's root
    else:
        monkeypatch.chdir(tmp_path)  # what it writes (lab-results/) goes there
    status, printed = run_command(argv)
    expected = [line.rstrip() for line in output if line.strip()]
    refused = bool(expected) and expected[0].startswith("error:")
    assert status == (2 if refused else 0), printed[-2000:]
    if refused or argv[1] == "memory":  # (a training transcript shows a run, not its config)
        got = [line.rstrip() for line in printed.splitlines()]
        assert [line for line in expected if line not in got] == [], printed[-3000:]


PYTHON = [
    pytest.param(block["body"], id=block["where"])
    for block in blocks()
    if block["lang"] == "python" and block["mark"] is None
]


@pytest.mark.integration
@pytest.mark.parametrize("code", PYTHON)
def test_a_documented_python_block_runs(code, eos_model_dir, tmp_path, monkeypatch):  # noqa: F811
    import policygrad  # the entry point the examples call, wrapped for a tiny run

    real = policygrad.train
    runs = []

    def tiny(**kwargs):
        kwargs.update(model=eos_model_dir, steps=1, overwrite=True)
        rollout = {"engine": "hf", "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6}
        kwargs["rollout"] = {**kwargs.get("rollout", {}), **rollout}
        kwargs["data"] = {**kwargs.get("data", {}), "eval_size": 2}
        # The tiny model earns every sample of a group the same reward, so every advantage is 0; an
        # entropy bonus gives the step a gradient, so the example runs to its end as it would.
        kwargs["loss"] = {**kwargs.get("loss", {}), "entropy_coef": 0.01}
        runs.append(real(**kwargs))
        return runs[-1]

    monkeypatch.setattr(policygrad, "train", tiny)
    monkeypatch.chdir(tmp_path)
    exec(compile(code, "docs example", "exec"), {"__name__": "docs_example"})
    assert runs or "policygrad.train(" not in code  # the example trained, one step
    assert all(summary["steps"] == 1 for summary in runs)
