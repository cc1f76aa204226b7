"""Entering the code sandbox, inside its worker (:mod:`policygrad.sandbox.worker`, steps 2 to 4 of
its docstring): Linux namespaces and a minimal read-only root (:func:`enter_namespaces`), the
supervisor that ends everything the program started (:func:`supervise`), dropped privileges and
resource limits.

Only the standard library: this module runs inside the sandbox, before the program's first line.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
import signal
import time

from policygrad.sandbox.procfs import child_pids

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


def kill_children():
    """SIGKILL every child of this process and reap it, until it has none: as a subreaper, the
    children of each killed process become its children and go in the next round. A process
    with a SIGKILL pending cannot fork, so the rounds end."""
    me = os.getpid()
    while True:
        for child in child_pids().get(me, []):
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
