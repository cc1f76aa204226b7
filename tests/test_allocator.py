"""The command's allocator preload: which library it picks, when it re-executes, and a real
re-execution where tcmalloc is installed."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import types

import pytest

from policygrad import allocator
from policygrad.allocator import ENV, find_library, plan_preload, preload_and_reexec

TC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
JE = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"


needs_tcmalloc = pytest.mark.skipif(
    sys.platform != "linux" or find_library("tcmalloc") is None, reason="tcmalloc is not installed"
)


def _env_without_preload() -> dict[str, str]:
    """This environment with no allocator chosen or preloaded: what a user's shell gives the command."""
    drop = (ENV, "LD_PRELOAD", "POLICYGRAD_ALLOCATOR_PRELOADED")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _finder(**installed):
    return lambda name: installed.get(name)


@pytest.mark.unit
def test_auto_prefers_tcmalloc_then_jemalloc_then_nothing():
    both = _finder(tcmalloc=TC, jemalloc=JE)
    assert plan_preload({}, "linux", both) == TC
    assert plan_preload({ENV: "auto"}, "linux", _finder(jemalloc=JE)) == JE
    assert plan_preload({}, "linux", _finder()) is None  # nothing installed: run as is, silently
    assert plan_preload({ENV: "jemalloc"}, "linux", both) == JE


@pytest.mark.unit
def test_no_preload_when_asked_not_to_already_done_or_not_linux():
    both = _finder(tcmalloc=TC, jemalloc=JE)
    assert plan_preload({ENV: "system"}, "linux", both) is None
    assert plan_preload({ENV: " System "}, "linux", both) is None  # case and spaces forgiven
    assert plan_preload({"POLICYGRAD_ALLOCATOR_PRELOADED": TC}, "linux", both) is None  # never loops
    assert plan_preload({"LD_PRELOAD": "/opt/libjemalloc.so.2"}, "linux", both) is None  # the user's
    assert plan_preload({}, "darwin", both) is None


@pytest.mark.unit
def test_any_build_of_an_allocator_the_user_preloads_is_their_choice(tmp_path):
    both = _finder(tcmalloc=TC, jemalloc=JE)
    for user in (
        "/opt/libjemalloc.so",  # no version suffix
        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal_debug.so.4",  # the debug build
        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10",
        "/x/libasan.so:/opt/libjemalloc.so.2",  # colon-separated, not the first entry
    ):
        assert plan_preload({"LD_PRELOAD": user}, "linux", both) is None, user
    # a link whose own name says nothing, pointing at jemalloc
    target = tmp_path / "libjemalloc.so.2"
    target.write_bytes(b"")
    link = tmp_path / "alloc.so"
    link.symlink_to(target)
    assert plan_preload({"LD_PRELOAD": str(link)}, "linux", both) is None
    # other preloads are not allocators: the command still adds tcmalloc
    assert plan_preload({"LD_PRELOAD": "/x/libasan.so /y/libfoo.so"}, "linux", both) == TC
    # an explicit choice that agrees is fine; one that contradicts the preload is an error
    assert plan_preload({"LD_PRELOAD": JE, ENV: "jemalloc"}, "linux", both) is None
    with pytest.raises(
        ValueError,
        match=r"^POLICYGRAD_ALLOCATOR=tcmalloc but LD_PRELOAD already loads jemalloc "
        r"\(/opt/libjemalloc\.so\.2\); remove one of the two$",
    ):
        plan_preload({"LD_PRELOAD": "/opt/libjemalloc.so.2", ENV: "tcmalloc"}, "linux", both)


@pytest.mark.unit
def test_bad_or_missing_choice_is_one_clear_error():
    with pytest.raises(ValueError, match=r"POLICYGRAD_ALLOCATOR='mimalloc' is not valid; choose one of auto"):
        plan_preload({ENV: "mimalloc"}, "linux", _finder())
    with pytest.raises(
        ValueError, match=r"POLICYGRAD_ALLOCATOR=tcmalloc: .*apt install libtcmalloc-minimal4"
    ):
        plan_preload({ENV: "tcmalloc"}, "linux", _finder(jemalloc=JE))


@pytest.mark.unit
def test_find_library_looks_in_the_usual_folders():
    assert find_library("jemalloc", exists=lambda p: p == JE) == JE
    # the minimal tcmalloc first, the full one otherwise
    full = "/usr/lib64/libtcmalloc.so.4"
    assert find_library("tcmalloc", exists=lambda p: p == full) == full
    assert find_library("tcmalloc", exists=lambda _p: False) is None


@pytest.mark.unit
def test_reexec_keeps_interpreter_flags_and_arguments(monkeypatch):
    monkeypatch.setattr(allocator, "find_library", lambda name: TC if name == "tcmalloc" else None)
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    # This process as argv says it started (-m policygrad), whatever started pytest: a
    # pytest-xdist worker reads its program from stdin, which is never re-executed.
    main = types.ModuleType("__main__")
    main.__file__, main.__spec__ = "/venv/lib/policygrad/__main__.py", importlib.util.find_spec("policygrad")
    monkeypatch.setitem(sys.modules, "__main__", main)
    calls = []
    argv = ["/venv/bin/python", "-X", "utf8", "-m", "policygrad", "train", "--steps=2"]
    preload_and_reexec(argv, {"LD_PRELOAD": "/opt/other.so", "KEEP": "1"}, execve=lambda *a: calls.append(a))
    ((exe, args, env),) = calls
    assert exe == sys.executable
    assert args == [sys.executable, "-X", "utf8", "-m", "policygrad", "train", "--steps=2"]
    assert env["LD_PRELOAD"] == f"{TC} /opt/other.so"  # first, the user's own preloads kept
    assert env["POLICYGRAD_ALLOCATOR_PRELOADED"] == TC and env["KEEP"] == "1"
    assert env["POLICYGRAD_ALLOCATOR_ORIGINAL_LD_PRELOAD"] == "/opt/other.so"
    calls.clear()
    preload_and_reexec(argv, {ENV: "system"}, execve=lambda *a: calls.append(a))
    assert calls == []

    def refused(*_args):
        raise PermissionError("exec refused")

    preload_and_reexec(argv, {}, execve=refused)  # runs on without the preload, no traceback


@pytest.mark.integration
@needs_tcmalloc
def test_the_command_really_runs_under_tcmalloc():
    code = (
        "import sys; from policygrad.allocator import preload_and_reexec; preload_and_reexec(); "
        "import os; from policygrad.allocator import preloaded; "
        "maps = open('/proc/self/maps').read(); "
        "print('tcmalloc' in maps, sys.argv[1:], os.environ.get('LD_PRELOAD'), preloaded() is not None)"
    )
    env = _env_without_preload()
    out = subprocess.run(
        [sys.executable, "-c", code, "a", "b c"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    # loaded, and the environment its children inherit is the user's again (no LD_PRELOAD)
    assert out.stdout.strip() == "True ['a', 'b c'] None True"
    env[ENV] = "system"
    out = subprocess.run(
        [sys.executable, "-c", code, "a"], env=env, capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False ['a'] None False"
    env[ENV] = "nonsense"
    bad = subprocess.run(
        [sys.executable, "-m", "policygrad", "--help"], env=env, capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 2
    assert bad.stderr.strip() == (
        "error: POLICYGRAD_ALLOCATOR='nonsense' is not valid; choose one of auto, tcmalloc, jemalloc, system"
    )


@pytest.mark.unit
def test_vllm_is_not_told_to_preload_what_the_command_preloaded(monkeypatch):
    from policygrad.rollout import vllm as engine

    fragment = "libtcmalloc is not found in LD_PRELOAD"
    monkeypatch.setattr(allocator, "_preloaded", None)
    assert fragment not in engine._start_notes().get("vllm.v1.worker.cpu_worker", ())
    monkeypatch.setattr(allocator, "_preloaded", TC)
    notes = engine._start_notes()["vllm.v1.worker.cpu_worker"]
    assert fragment in notes and "doesn't allow to use `torch.set_num_threads`" in notes


def _record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("vllm.v1.worker.cpu_worker", logging.WARNING, __file__, 1, msg, args, None)


@pytest.mark.unit
def test_a_dropped_message_is_matched_as_printed_with_its_arguments():
    from policygrad.rollout import vllm as engine

    drop = engine._DropMessages("libtcmalloc is not found in LD_PRELOAD")
    # vLLM's own call: the library name is an argument, so the format string alone never matches
    assert not drop.filter(_record("%s is not found in LD_PRELOAD. For best performance ...", "libtcmalloc"))
    assert drop.filter(_record("%s is not found in LD_PRELOAD. For best performance ...", "libiomp5.so"))
    assert not drop.filter(_record("libtcmalloc is not found in LD_PRELOAD"))
    # arguments that do not fit the format: matched against the format string, no exception
    assert drop.filter(_record("%d things", "not a number"))
    assert not engine._DropMessages("%d things").filter(_record("%d things", "not a number"))


@pytest.mark.unit
def test_the_tcmalloc_advice_is_dropped_from_vllm_own_logger(monkeypatch):
    from policygrad.rollout import vllm as engine

    monkeypatch.setattr(allocator, "_preloaded", TC)
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    log = logging.getLogger("vllm.v1.worker.cpu_worker")
    handler = Keep()
    log.addHandler(handler)
    # The filter is under test, not the level: vLLM sets its loggers' level from the environment
    # when it configures logging, which an earlier test in this process may have done (the suite
    # once failed here in a pytest-xdist worker, with neither line reaching the handler).
    level, disabled = log.level, log.disabled
    log.setLevel(logging.WARNING)
    log.disabled = False
    try:
        with engine._quiet(engine._start_notes()):
            log.warning("%s is not found in LD_PRELOAD. For best performance ...", "libtcmalloc")
            log.warning("%s is not found in LD_PRELOAD. For best performance ...", "libiomp5.so")
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.disabled = disabled
    assert seen == ["libiomp5.so is not found in LD_PRELOAD. For best performance ..."]


@pytest.mark.integration
@needs_tcmalloc
def test_a_program_read_from_stdin_runs_without_the_preload():
    code = (
        "from policygrad.allocator import preload_and_reexec, preloaded; preload_and_reexec(); "
        "print('ran', preloaded())\n"
    )
    env = _env_without_preload()
    out = subprocess.run(
        [sys.executable, "-"], input=code, env=env, capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "ran None"  # not re-executed onto an empty stdin, running nothing
