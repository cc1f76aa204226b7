"""The program that runs inside the code sandbox; :mod:`policygrad.sandbox.runner` starts it.

It is not imported by the package: the sandbox starts a fresh interpreter as
``python -I -S -B -c <this file's source>`` (isolated mode: no ``PYTHON*`` variables, no site
packages, no user site, no bytecode written), writes one JSON spec to its standard input and
closes it. Only the standard library is used, and everything this file needs is imported before
any untrusted code runs.

What it does, in order (every step is trusted code, before the program's first line):

1. read the spec (role, isolation, limits, the program, the tests, the file descriptors);
2. ``isolation == "namespaces"``: enter new user (when not root), mount, PID, network, IPC and
   UTS namespaces, fork twice (a supervisor outside the PID namespace, an init that is PID 1
   inside it and dies with the supervisor, so killing the supervisor's process group ends
   everything the program started), build a minimal read-only root (``/usr``, ``/lib*``,
   ``/bin``, the interpreter's prefix, a few ``/dev`` nodes, a fresh ``/proc``) with one
   writable tmpfs of ``max_write_bytes`` at ``/sandbox``, and ``pivot_root`` into it.
   ``"bwrap"``: bubblewrap has done the same; ``"none"``: only a supervisor process, a child
   subreaper that kills everything the program left behind when it ends (:func:`supervise`);
3. drop privileges: to the spec's ``uid`` (a fresh unprivileged uid when started as root), or,
   inside a user namespace, every capability; ``PR_SET_NO_NEW_PRIVS``;
4. resource limits (``RLIMIT_AS``, ``RLIMIT_CPU``, ``RLIMIT_NPROC``, ``RLIMIT_FSIZE``,
   ``RLIMIT_NOFILE``, ``RLIMIT_CORE`` = 0), hard limits equal to the soft ones;
5. run the role:

* ``script``: run the program as the module ``__main__``; its exit status is the process's.
* ``candidate``: send a ready frame, execute the program as the module ``__candidate__``, then
  answer call requests ``{"call": name, "args": [...], "kwargs": [...]}`` read from ``req_fd``
  with ``{"ok": value}`` or ``{"raised": exception type name, "message": text}`` on
  ``resp_fd``. Only plain data crosses (see :func:`encode`).
* ``tests``: wait for the candidate's ready frame, run the tests (each in its own module
  ``__tests__``) with the candidate's functions replaced by proxies that make those calls, and
  write one JSON line per test to ``report_fd``.

Each runs its code as a real module (:func:`new_module`): registered in ``sys.modules`` under
its name, as an import registers it, with its source in ``linecache``, so dataclasses, pickling,
``typing.get_type_hints``, ``inspect.getsource`` and ``enum`` work as in a file one imports.

Frames on the request/response pipes are a 4-byte big-endian length and a JSON body.
"""

from __future__ import annotations

import builtins
import ctypes
import ctypes.util
import json
import linecache
import os
import resource
import select
import signal
import socket  # noqa: F401 - imported before the program runs, for the probe's use
import struct
import sys
import time
import traceback
import types

MAX_FRAME_BYTES = 16 << 20  # the largest request or response; larger answers fail the call

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
PR_SET_CHILD_SUBREAPER = 36
# statvfs flags -> mount flags: a read-only remount of a bind mount must repeat the flags the
# kernel locked on it (nosuid, nodev, noexec ... of the original) or it fails with EPERM.
ST_TO_MS = {1: MS_RDONLY, 2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME, 2048: MS_NODIRATIME,
            4096: MS_RELATIME}
SETUP_FAILED = 121  # exit status of a worker whose sandbox could not be set up

_libc = None


def libc():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    return _libc


def _call(name, *args):
    fn = getattr(libc(), name)
    if fn(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}{args!r}: {os.strerror(err)}")


def _b(text):
    return None if text is None else os.fsencode(text)


def mount(source, target, fstype, flags, data=None):
    _call("mount", _b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data))


def prctl(option, value):
    _call("prctl", ctypes.c_int(option), ctypes.c_ulong(value), ctypes.c_ulong(0), ctypes.c_ulong(0),
          ctypes.c_ulong(0))


def write_file(path, text):
    with open(path, "w") as handle:
        handle.write(text)


# ---------------------------------------------------------------------------------------------
# Entering the sandbox.


def supervise(reap_tree=False):
    """Fork; the parent waits for the child and exits with its status, the child returns.

    The parent is the process the sandbox started (the session and process-group leader); the
    child gets ``PR_SET_PDEATHSIG = SIGKILL`` so that killing the parent ends it.

    ``reap_tree`` (no PID namespace to end everything at once): the parent is a child subreaper
    (``PR_SET_CHILD_SUBREAPER``), so every process the program starts and leaves behind, in a
    session of its own or not, becomes its child instead of init's; when the program's process
    ends (or is killed) it kills them all (:func:`kill_children`) before it exits."""
    parent = os.getpid()
    if reap_tree:
        prctl(PR_SET_CHILD_SUBREAPER, 1)  # not inherited by the child
    # A SIGTERM from the coordinator before the parent's handler is in place would kill it by
    # default and orphan the program's processes: it waits, blocked, until the handler is set.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent and os.getppid() != 0:  # the parent died before prctl
            os._exit(SETUP_FAILED)
        return
    # The supervisor: reap the child and pass its status on; never run untrusted code here. On
    # SIGTERM (the coordinator ending the run) it kills the child and still reaps it, so no zombie
    # is left to a PID 1 that might not reap orphans.
    def end_child(_signum, _frame):  # a signal handler
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:  # exiting already; raised here, it would end this process unreaped
            pass

    signal.signal(signal.SIGTERM, end_child)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    while True:
        try:
            # A subreaper reaps the orphans that end meanwhile too (they would count as processes).
            reaped, status = os.waitpid(-1 if reap_tree else pid, 0)
        except ChildProcessError:
            os._exit(SETUP_FAILED)
        except InterruptedError:
            continue
        if reaped == pid:
            break
    if reap_tree:
        # The pid may be reused from now on: a late SIGTERM must not reach it; this is the end anyway.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        kill_children()
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def _children(pid):
    """The pids whose parent is ``pid``, read from ``/proc/*/stat``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:  # ended meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; read after the last ')'
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1 and int(fields[1]) == pid:
            found.append(int(name))
    return found


def kill_children():
    """SIGKILL every child of this process and reap it, until it has none: as a subreaper, the
    children of each killed process become its children and go in the next round. A process
    with a SIGKILL pending cannot fork, so the rounds end."""
    me = os.getpid()
    while True:
        for child in _children(me):
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass
        except ChildProcessError:  # none left
            return
        time.sleep(0.005)


def _remount_readonly(target):
    flags = MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV
    have = os.statvfs(target).f_flag
    for st, ms in ST_TO_MS.items():
        if have & st:
            flags |= ms
    mount(None, target, None, flags)


def _bind(root, path, *, readonly=True, optional=False):
    """Bind ``path`` at the same place under ``root`` (symlinks are recreated, not followed)."""
    if not os.path.lexists(path):
        if optional:
            return
        raise FileNotFoundError(path)
    target = root + path
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(path):
        if not os.path.lexists(target):
            os.symlink(os.readlink(path), target)
        return
    if os.path.lexists(target):
        return  # already inside an earlier bind (e.g. /usr/local under /usr)
    if os.path.isdir(path):
        os.mkdir(target)
    else:
        open(target, "w").close()
    try:
        mount(path, target, None, MS_BIND | MS_REC)
        if readonly:
            _remount_readonly(target)
    except OSError:
        if optional:
            return
        raise


def build_root(spec, in_userns):
    """A minimal root on a tmpfs: read-only system paths, device nodes, /proc, /sandbox."""
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    root = "/tmp" if os.path.isdir("/tmp") else "/mnt"
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
    for path in sorted(spec["ro_paths"], key=len):
        _bind(root, path, optional=True)
    for path in ("/etc/ld.so.cache", "/etc/localtime"):
        _bind(root, path, optional=True)
    os.makedirs(root + "/dev", exist_ok=True)
    mount("tmpfs", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,nr_inodes=64,mode=0755")
    for name in ("null", "zero", "full", "random", "urandom"):
        _bind(root, "/dev/" + name, readonly=False, optional=True)
    os.makedirs(root + "/proc", exist_ok=True)
    try:
        mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        if not in_userns:
            raise  # inside an unprivileged container a fresh /proc may be refused; Python needs none
    os.makedirs(root + "/sandbox", exist_ok=True)
    uid = spec.get("uid")
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    limit = int(spec["limits"]["max_write_bytes"])
    mount("tmpfs", root + "/sandbox", "tmpfs", MS_NOSUID | MS_NODEV,
          f"size={max(limit, 4096)},nr_inodes=16384,mode=0700{owner}")
    os.symlink("sandbox", root + "/tmp")
    os.chdir(root)
    os.mkdir(".oldroot")
    _call("pivot_root", b".", b".oldroot")
    os.chdir("/")
    _call("umount2", b"/.oldroot", ctypes.c_int(MNT_DETACH))
    os.rmdir("/.oldroot")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir("/sandbox")


def enter_namespaces(spec):
    """Unshare, fork into the new PID namespace, build the root; returns in the role process."""
    in_userns = os.geteuid() != 0
    if in_userns:
        uid, gid = os.geteuid(), os.getegid()
        _call("unshare", ctypes.c_int(CLONE_NEWUSER))
        write_file("/proc/self/setgroups", "deny")
        write_file("/proc/self/uid_map", f"0 {uid} 1")
        write_file("/proc/self/gid_map", f"0 {gid} 1")
    _call("unshare", ctypes.c_int(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS))
    supervise()
    # PID 1 of the new namespace from here on. Its own session, so that a kill(0, ...) from the
    # program reaches nothing outside; when it exits, the kernel kills every process inside.
    os.setsid()
    try:
        libc().sethostname(b"sandbox", ctypes.c_size_t(7))
    except Exception:  # noqa: BLE001 - cosmetic
        pass
    build_root(spec, in_userns)
    prctl(PR_SET_DUMPABLE, 0)
    pid = os.fork()
    if pid != 0:
        _init_loop(pid)
    return in_userns


def _init_loop(child):
    """PID 1: reap every orphan; exit (ending the namespace) when the role process ends."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)  # PID 1 with default handlers ignores them from inside
    code = SETUP_FAILED
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == child:
            code = os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
            break
    os._exit(code)


def drop_privileges(spec, in_userns):
    uid = spec.get("uid")
    if uid is not None and os.geteuid() == 0 and not in_userns:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    elif in_userns:
        # Root of a user namespace: keep the uid (the only one mapped), drop every capability.
        for cap in range(64):
            try:
                prctl(PR_CAPBSET_DROP, cap)
            except OSError:
                break
        header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
        data = (ctypes.c_uint32 * 6)()
        _call("capset", ctypes.byref(header), ctypes.byref(data))
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def set_limits(limits):
    def hard(which, value):
        value = int(value)
        resource.setrlimit(which, (value, value))

    hard(resource.RLIMIT_CORE, 0)
    hard(resource.RLIMIT_AS, limits["memory_bytes"])
    hard(resource.RLIMIT_CPU, max(1, int(limits["cpu_time_s"] + 0.999)))
    hard(resource.RLIMIT_FSIZE, limits["max_write_bytes"])
    hard(resource.RLIMIT_NOFILE, 256)
    if limits.get("max_processes"):
        hard(resource.RLIMIT_NPROC, limits["max_processes"])


# ---------------------------------------------------------------------------------------------
# Plain data across the boundary.

_TAGS = ("tuple", "dict", "set", "frozenset", "bytes", "complex")


def encode(value):
    """A JSON-ready form of plain data: None, bool, int, float, str, and lists, tuples, dicts,
    sets, frozensets of them, bytes, complex. The type test is exact (``type(x) is int``), so no
    subclass, and no object whose methods the program wrote, can cross.

    Raises:
        TypeError: any other type.
    """
    kind = type(value)
    if value is None or kind is bool or kind is int or kind is float or kind is str:
        return value
    if kind is list:
        return [encode(v) for v in value]
    if kind is tuple:
        return {"__t": "tuple", "v": [encode(v) for v in value]}
    if kind is dict:
        return {"__t": "dict", "v": [[encode(k), encode(v)] for k, v in value.items()]}
    if kind is set or kind is frozenset:
        return {"__t": kind.__name__, "v": [encode(v) for v in value]}
    if kind is bytes or kind is bytearray:
        return {"__t": "bytes", "v": bytes(value).hex()}
    if kind is complex:
        return {"__t": "complex", "v": [value.real, value.imag]}
    raise TypeError(f"a {kind.__name__} cannot cross the sandbox boundary (plain data only)")


def _decode_dict_items(pairs):
    """A dict from the ``[key, value]`` pairs of an encoded one."""
    out = {}
    for pair in pairs:
        if type(pair) is not list or len(pair) != 2:
            raise ValueError("malformed dict item")
        out[decode(pair[0])] = decode(pair[1])
    return out


def decode(obj):
    """The inverse of :func:`encode` on parsed JSON; anything else raises ``ValueError``."""
    kind = type(obj)
    if obj is None or kind is bool or kind is int or kind is float or kind is str:
        return obj
    if kind is list:
        return [decode(v) for v in obj]
    if kind is dict and len(obj) == 2 and obj.get("__t") in _TAGS and "v" in obj:
        tag, v = obj["__t"], obj["v"]
        if tag == "bytes" and type(v) is str:
            return bytes.fromhex(v)
        if type(v) is not list:
            raise ValueError(f"malformed {tag}")
        if tag == "tuple":
            return tuple(decode(x) for x in v)
        if tag == "dict":
            return _decode_dict_items(v)
        if tag == "set":
            return {decode(x) for x in v}
        if tag == "frozenset":
            return frozenset(decode(x) for x in v)
        if tag == "complex" and len(v) == 2 and all(type(x) in (int, float) for x in v):
            return complex(v[0], v[1])
    raise ValueError(f"not plain data: {str(obj)[:60]}")


def write_frame(fd, payload):
    data = json.dumps(payload).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def _read_exact(fd, n, deadline):
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError("time limit reached")
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("the other side closed the pipe")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(fd, deadline=None):
    (size,) = struct.unpack(">I", _read_exact(fd, 4, deadline))
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a {size}-byte message exceeds the {MAX_FRAME_BYTES}-byte limit")
    return json.loads(_read_exact(fd, size, deadline))


# ---------------------------------------------------------------------------------------------
# Roles.


def new_module(name, filename, source):
    """A module object named ``name``, as an import makes it: ``__file__`` is ``filename`` and
    the source is in :mod:`linecache` under it (so ``inspect.getsource`` and tracebacks find it).
    The caller registers it in ``sys.modules`` before running ``source`` in it: dataclasses,
    pickle, ``typing.get_type_hints`` and ``inspect`` find a class's module there by name."""
    module = types.ModuleType(name)
    module.__file__ = filename
    module.__builtins__ = builtins
    lines = source.splitlines(True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    # mtime None: linecache.checkcache keeps the entry (there is no file to compare with).
    linecache.cache[filename] = (len(source), None, lines, filename)
    return module


def run_module(source, module):
    """Register ``module`` in ``sys.modules`` under its name (replacing what was there; the
    caller keeps a reference to anything it still needs) and execute ``source`` in it."""
    sys.modules[module.__name__] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)


def role_script(spec):
    # The program replaces this file as __main__; the worker's functions keep their own globals.
    module = new_module("__main__", "program.py", spec["program"])
    try:
        run_module(spec["program"], module)
    except SystemExit:
        raise
    except BaseException:  # noqa: BLE001 - report any failure of the program as exit status 1
        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)


def role_candidate(spec):
    req, resp = spec["fds"]["req"], spec["fds"]["resp"]
    write_frame(resp, {"ready": True})
    # Registered for the rest of this process's life: the program's classes are looked up there
    # whenever an instance is pickled or a hint resolved, during the calls too.
    module = new_module("__candidate__", "solution.py", spec["program"])
    namespace = module.__dict__
    load_error = None
    try:
        run_module(spec["program"], module)
    except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt included
        load_error = f"{type(exc).__name__}: {exc}"[:2000]
    while True:
        try:
            request = read_frame(req)
        except EOFError:
            os._exit(0)
        name = request.get("call")
        try:
            if load_error is not None:
                raise RuntimeError(f"the program failed to load: {load_error}")
            fn = namespace.get(name)
            if not callable(fn):
                raise NameError(f"the program defines no function {name!r}")
            args = decode(request["args"])
            kwargs = decode(request["kwargs"])
            reply = {"ok": encode(fn(*args, **kwargs))}
        except BaseException as exc:  # noqa: BLE001 - every failure is the call's result
            try:
                reply = {"raised": type(exc).__name__, "message": str(exc)[:2000]}
            except BaseException:  # noqa: BLE001 - a str() that raises
                reply = {"raised": "Exception", "message": "(unprintable)"}
        write_frame(resp, reply)


class CandidateError(Exception):
    """The candidate's function could not give an answer (it raised something that is not a
    built-in exception, it returned something that is not plain data, its process ended, or the
    time ran out)."""


# Exceptions a candidate may "raise" across the boundary: built-in Exception subclasses only, so
# a test that expects e.g. ValueError still sees one; BaseException-only ones (SystemExit,
# KeyboardInterrupt, GeneratorExit) and everything else become CandidateError.
_BUILTIN_ERRORS = {
    name: obj for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, Exception)
}


class Channel:
    """The harness side of the pipes to the candidate process."""

    def __init__(self, req, resp, deadline):
        self.req, self.resp, self.deadline = req, resp, deadline
        self.broken = None  # why the channel died (then every later call fails)

    def wait_ready(self):
        frame = read_frame(self.resp, self.deadline)
        if frame != {"ready": True}:
            raise RuntimeError(f"unexpected first frame {str(frame)[:80]}")

    def call(self, name, args, kwargs):
        if self.broken is not None:
            raise CandidateError(self.broken)
        request = {"call": name, "args": encode(list(args)), "kwargs": encode(dict(kwargs))}
        try:
            write_frame(self.req, request)
            reply = read_frame(self.resp, self.deadline)
        except TimeoutError:
            self.broken = "time limit reached"
            raise CandidateError(self.broken) from None
        except (EOFError, OSError) as exc:
            self.broken = f"the candidate's process ended ({type(exc).__name__})"
            raise CandidateError(self.broken) from None
        except Exception as exc:  # noqa: BLE001 - malformed frames: the candidate broke the protocol
            self.broken = f"unreadable reply ({type(exc).__name__}: {str(exc)[:200]})"
            raise CandidateError(self.broken) from None
        if type(reply) is dict and set(reply) == {"ok"}:
            try:
                return decode(reply["ok"])
            except Exception as exc:  # noqa: BLE001 - not plain data
                raise CandidateError(f"{name}() returned something that is not plain data: {exc}") from None
        if (type(reply) is dict and set(reply) == {"raised", "message"} and type(reply["raised"]) is str
                and type(reply["message"]) is str):
            error = _BUILTIN_ERRORS.get(reply["raised"], None)
            if error is not None:
                try:
                    exc = error(reply["message"])
                except TypeError:  # an exception class whose constructor wants other arguments
                    exc = None
                if exc is not None:  # raised outside the try: a TypeError of the program is itself
                    raise exc
            raise CandidateError(f"{name}() raised {reply['raised'][:80]}: {reply['message'][:500]}")
        self.broken = "malformed reply"
        raise CandidateError(self.broken)

    def proxy(self, name):
        def candidate(*args, **kwargs):
            return self.call(name, args, kwargs)

        candidate.__name__ = candidate.__qualname__ = name
        return candidate


def role_tests(spec):
    fds = spec["fds"]
    report_fd = fds["report"]

    def report(**record):
        os.write(report_fd, (json.dumps(record) + "\n").encode())

    # The program's time starts when its sandbox is up: start-up on a loaded machine is not its.
    channel = Channel(fds["req"], fds["resp"], time.monotonic() + float(spec["start_timeout_s"]))
    try:
        channel.wait_ready()
    except Exception as exc:  # noqa: BLE001 - the candidate's sandbox did not start
        report(setup_error=f"the candidate's sandbox did not start: {type(exc).__name__}: {exc}")
        return
    channel.deadline = time.monotonic() + float(spec["limits"]["wall_time_s"])
    report(ready=True)
    tests = spec["tests"]
    prelude = tests.get("prelude") or ""
    module = new_module("__tests__", "prompt.py", prelude)
    namespace = module.__dict__
    if prelude:
        # The prompt's own code (HumanEval's helpers): it belongs to the tests, so it runs here.
        try:
            run_module(prelude, module)
        except BaseException as exc:  # noqa: BLE001 - a prompt that is not a program
            report(note=f"the prompt did not run as code: {type(exc).__name__}: {exc}"[:500])
    for name in tests["names"]:
        namespace[name] = channel.proxy(name)
    cases = []
    if tests.get("check"):
        entry = tests["entry_point"]
        cases.append((tests["check"] + f"\n\ncheck({entry})\n", "check.py"))
    cases += [(source, f"test_{i}.py") for i, source in enumerate(tests.get("asserts") or [])]
    for index, (source, filename) in enumerate(cases):
        error = None
        case = new_module("__tests__", filename, source)  # each test in its own copy of the namespace
        case.__dict__.update(namespace)
        case.__file__ = filename
        try:
            run_module(source, case)
        except BaseException as exc:  # noqa: BLE001 - any exception fails the test
            error = f"{type(exc).__name__}: {exc}"[:1000]
        if error is None and channel.broken is not None:
            error = f"the candidate failed during the test: {channel.broken}"
        report(test=index, passed=error is None, error=error)
    report(done=True)


ROLES = {"script": role_script, "candidate": role_candidate, "tests": role_tests}


def main():
    spec = json.loads(sys.stdin.buffer.read())
    in_userns = False
    try:
        isolation = spec["isolation"]
        if isolation == "namespaces":
            in_userns = enter_namespaces(spec)
        elif isolation == "bwrap":
            os.chdir("/sandbox")  # bubblewrap's own PID 1 supervises and dies with its parent
        else:
            supervise(reap_tree=True)
        drop_privileges(spec, in_userns)
        set_limits(spec["limits"])
    except BaseException as exc:  # noqa: BLE001 - report and stop: the sandbox is not in force
        sys.stderr.write(f"sandbox setup failed: {type(exc).__name__}: {exc}\n")
        sys.stderr.flush()
        os._exit(SETUP_FAILED)
    ROLES[spec["role"]](spec)


if __name__ == "__main__":
    main()
