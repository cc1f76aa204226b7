"""Intra-op threads that fit the machine's load (``num_threads: null``).

OpenMP threads wait for each other at the end of every parallel region, spinning first. When
another process holds one of the cores, a thread of ours is descheduled and its siblings spin
until it runs again: on 2 cores shared with one other CPU-bound job, a step with 2 threads took
165 s against about 70 s with 1. With ``num_threads`` null the trainer therefore picks its thread
count from what is free:

- **usable CPUs**: the affinity set (``os.sched_getaffinity``) and the cgroup's CPU quota
  (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us / cpu.cfs_period_us``; the smallest along the
  process's cgroup path);
- **CPUs busy with other processes** on the affinity set: at start the 1-minute load average
  less this process's running threads (scaled by affinity / online CPUs when the affinity set is
  a part of the machine); between steps the busy jiffies of the affinity set's CPUs in
  ``/proc/stat`` less this process's own (``utime + stime`` of ``/proc/self/stat``, waited-for
  children and live descendants included), over the interval since the last reading;
- **the choice** (:func:`choose_threads`): ``min(quota, affinity - others)`` rounded half up,
  at least 1, at most torch's default count. On a quiet machine without a quota that is torch's
  default, so such a run is unchanged.
- **hysteresis** (:class:`ThreadChooser`): between steps the count changes only when two
  consecutive readings give the same new choice; a single noisy interval changes nothing.

Readings cost a few small file reads (no subprocess). The first time the count goes below the
default, one ``note:`` line says so. ``num_threads`` set: that count, and nothing is read or
changed afterwards.

vLLM in-process (the default, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): its CPU kernels are
OpenMP regions of torch's own libgomp, started from the thread that calls ``generate``, so
``torch.set_num_threads`` in that thread (the trainer's; the rollout pipeline's worker applies
the trainer's count before each job) governs its decode too, step by step.
``VLLM_CPU_OMP_THREADS_BIND`` is read only when vLLM runs its worker in another process
(``VLLM_ENABLE_V1_MULTIPROCESSING=1``): that worker's count is fixed at start, from the bind
list, which the engine then takes from the start-time choice.
"""

from __future__ import annotations

import glob
import logging
import math
import os
from dataclasses import dataclass

import torch

from policygrad.config.checks import ConfigError

__all__ = [
    "CpuTimes",
    "ThreadChooser",
    "ThreadGovernor",
    "affinity_cpus",
    "choose_threads",
    "others_from_load",
    "others_from_times",
    "parse_cfs_quota",
    "parse_cpu_max",
    "parse_proc_stat",
    "parse_task_jiffies",
    "read_cpu_times",
    "read_quota",
]

log = logging.getLogger("policygrad")


# ----------------------------------------------------------------------------------------------
# Pure functions of the readings.


def parse_cpu_max(text: str) -> float | None:
    """cgroup v2 ``cpu.max`` (``"150000 100000"``) -> CPUs (1.5); ``"max ..."`` -> None."""
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    quota = int(fields[0])
    period = int(fields[1]) if len(fields) > 1 else 100000
    return quota / period if quota > 0 and period > 0 else None


def parse_cfs_quota(quota_text: str, period_text: str) -> float | None:
    """cgroup v1 ``cpu.cfs_quota_us`` and ``cpu.cfs_period_us`` -> CPUs; a quota of -1 -> None."""
    quota, period = int(quota_text.strip()), int(period_text.strip())
    return quota / period if quota > 0 and period > 0 else None


def parse_proc_stat(text: str, cpus: set[int] | None = None) -> tuple[int, int]:
    """``(busy, total)`` jiffies of ``/proc/stat``: summed over the ``cpuN`` lines with N in
    ``cpus``, or the aggregate ``cpu`` line when ``cpus`` is None. Busy is user + nice + system +
    irq + softirq + steal; total adds idle and iowait (guest time is inside user already)."""
    busy = total = 0
    for line in text.splitlines():
        if not line.startswith("cpu"):
            continue
        name, *values = line.split()
        if cpus is None:
            if name != "cpu":
                continue
        elif name == "cpu" or int(name[3:]) not in cpus:
            continue
        v = [int(x) for x in values[:8]] + [0] * max(0, 8 - len(values))
        user, nice, system, idle, iowait, irq, softirq, steal = v[:8]
        b = user + nice + system + irq + softirq + steal
        busy += b
        total += b + idle + iowait
    return busy, total


def parse_task_jiffies(text: str, *, children: bool = True) -> int:
    """``utime + stime`` (and ``cutime + cstime``, the waited-for children, when ``children``)
    of a ``/proc/PID/stat`` line. The command name may hold spaces: fields count from its ``)``."""
    rest = text[text.rindex(")") + 2 :].split()
    # rest[0] is field 3 (state): utime is field 14, stime 15, cutime 16, cstime 17
    fields = rest[11:15] if children else rest[11:13]
    return sum(int(x) for x in fields)


def others_from_load(load1: float, own_running: int, cpus: int, online: int) -> float:
    """CPUs busy with other processes from the 1-minute load average: ``load1`` less this
    process's ``own_running`` threads, scaled by ``cpus / online`` (the load average counts the
    whole machine; the affinity set holds ``cpus`` of its ``online`` CPUs), at most ``cpus``."""
    others = max(0.0, load1 - own_running) * min(1.0, cpus / max(online, 1))
    return min(others, float(cpus))


@dataclass(frozen=True)
class CpuTimes:
    """One reading: busy and total jiffies of the affinity set's CPUs, this process's jiffies."""

    busy: int
    total: int
    own: int


def others_from_times(before: CpuTimes, after: CpuTimes, cpus: int) -> float | None:
    """CPUs busy with other processes between two readings of ``cpus`` CPUs: (busy - own
    jiffies) / elapsed jiffies per CPU, in [0, cpus]. None: no time passed between them."""
    elapsed = (after.total - before.total) / max(cpus, 1)
    if elapsed <= 0:
        return None
    others = ((after.busy - before.busy) - (after.own - before.own)) / elapsed
    return min(max(others, 0.0), float(cpus))


def choose_threads(cpus: int, quota: float | None, others: float, cap: int) -> int:
    """The thread count: ``min(quota, cpus - others)`` CPUs rounded half up, in [1, cap]
    (``cap``: torch's default count). ``cpus``: the affinity set's size; ``quota``: the cgroup's
    CPU quota (None: none); ``others``: CPUs of the affinity set busy with other processes."""
    free = cpus - others
    if quota is not None:
        free = min(free, quota)
    return max(1, min(cap, math.floor(free + 0.5)))


class ThreadChooser:
    """Hysteresis: the count moves to a new choice only when two consecutive readings give it."""

    def __init__(self, current: int):
        self.current = current
        self.pending: int | None = None

    def offer(self, choice: int) -> int:
        """Take one reading's choice; returns the count to use."""
        if choice == self.current:
            self.pending = None
        elif choice == self.pending:
            self.current, self.pending = choice, None
        else:
            self.pending = choice
        return self.current


# ----------------------------------------------------------------------------------------------
# Readers (thin: the files, parsed by the functions above).


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def affinity_cpus() -> set[int]:
    """The CPUs this process may run on (all of ``os.cpu_count()`` where affinity is unknown)."""
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return set(range(os.cpu_count() or 1))


def _v2_quota(folder: str) -> float | None:
    text = _read(os.path.join(folder, "cpu.max"))
    return parse_cpu_max(text) if text else None


def _v1_quota(folder: str) -> float | None:
    quota = _read(os.path.join(folder, "cpu.cfs_quota_us"))
    period = _read(os.path.join(folder, "cpu.cfs_period_us"))
    return parse_cfs_quota(quota, period) if quota and period else None


def read_quota(cgroup_root: str = "/sys/fs/cgroup", proc: str = "/proc") -> float | None:
    """The smallest CPU quota (CPUs) on this process's cgroup path (``/proc/self/cgroup``) and
    the mount's own folder (a container's view); None: no quota."""
    found: list[float | None] = []
    for line in (_read(os.path.join(proc, "self", "cgroup")) or "").splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        parts = [p for p in path.strip().strip("/").split("/") if p]
        if not controllers and line.startswith("0:"):  # v2: the cgroup's folder and its ancestors
            found += [_v2_quota(os.path.join(cgroup_root, *parts[:k])) for k in range(len(parts), -1, -1)]
        elif "cpu" in controllers.split(","):  # v1: the cgroup's folder, or the mount's own
            for folder in glob.glob(os.path.join(cgroup_root, "cpu*")):
                found += [_v1_quota(os.path.join(folder, *parts)), _v1_quota(folder)]
    if not any(q is not None for q in found):  # no path listed (or an unusual layout)
        found += [_v2_quota(cgroup_root), _v1_quota(os.path.join(cgroup_root, "cpu"))]
    quotas = [q for q in found if q is not None]
    return min(quotas) if quotas else None


def _running_threads(proc: str) -> int:
    """This process's threads in state R (at least 1: the one reading)."""
    running = 0
    for stat in glob.glob(os.path.join(proc, "self", "task", "*", "stat")):
        text = _read(stat)
        if text and text[text.rindex(")") + 2 :].startswith("R"):
            running += 1
    return max(running, 1)


def _descendant_jiffies(proc: str, pid: str, depth: int = 0) -> int:
    """``utime + stime + cutime + cstime`` of the live descendants of ``pid``."""
    total = 0
    for children in glob.glob(os.path.join(proc, pid, "task", "*", "children")):
        for child in (_read(children) or "").split():
            text = _read(os.path.join(proc, child, "stat"))
            if text:
                total += parse_task_jiffies(text)
            if depth < 8:
                total += _descendant_jiffies(proc, child, depth + 1)
    return total


def read_cpu_times(cpus: set[int], proc: str = "/proc") -> CpuTimes | None:
    """Busy and total jiffies of ``cpus`` and this process's own (children included); None
    where ``/proc`` cannot be read."""
    stat, own = _read(os.path.join(proc, "stat")), _read(os.path.join(proc, "self", "stat"))
    if not stat or not own:
        return None
    busy, total = parse_proc_stat(stat, cpus)
    if total == 0:  # no per-CPU lines for these CPUs: the whole machine's line
        busy, total = parse_proc_stat(stat)
    pid = own.split(None, 1)[0]
    return CpuTimes(busy, total, parse_task_jiffies(own) + _descendant_jiffies(proc, pid))


# ----------------------------------------------------------------------------------------------
# The trainer's governor.


class ThreadGovernor:
    """torch's intra-op thread count for a run: ``num_threads`` when set (applied once, never
    changed), else adapted to the machine's load at start and between steps (see the module
    docstring). :attr:`threads` is the count in use; :meth:`close` puts torch's count back."""

    def __init__(
        self, num_threads: int | None = None, *, proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup"
    ):
        self.fixed = num_threads is not None
        self.proc, self.cgroup_root = proc, cgroup_root
        self.noted = False
        if self.fixed:
            usable = len(affinity_cpus())
            if num_threads > usable:
                # more OpenMP threads than CPUs wait on each other at every barrier: a step can take
                # minutes where it took seconds, with nothing said
                raise ConfigError(
                    f"num_threads={num_threads} is more than the {usable} CPUs this process may run on; "
                    f"set num_threads <= {usable}, or null (fitted to the machine's load)"
                )
            torch.set_num_threads(num_threads)
            self.default = self.threads = int(num_threads)
            return
        self.default = torch.get_num_threads()
        self.cpus = affinity_cpus()
        self.quota = read_quota(cgroup_root, proc)
        try:
            load1 = os.getloadavg()[0]
        except OSError:
            load1 = 0.0
        others = others_from_load(
            load1, _running_threads(proc), len(self.cpus), os.cpu_count() or len(self.cpus)
        )
        self.last = read_cpu_times(self.cpus, proc)
        self.chooser = ThreadChooser(choose_threads(len(self.cpus), self.quota, others, self.default))
        self.threads = self.default
        self._apply(self.chooser.current, others)

    def check(self) -> int:
        """Between steps: read the interval since the last reading and apply the choice (with
        hysteresis). Returns the count in use. ``num_threads`` set: that count, nothing read."""
        if self.fixed:
            return self.threads
        now = read_cpu_times(self.cpus, self.proc)
        if now is None or self.last is None:
            self.last = now
            return self.threads
        others = others_from_times(self.last, now, len(self.cpus))
        self.last = now
        if others is not None:
            self._apply(
                self.chooser.offer(choose_threads(len(self.cpus), self.quota, others, self.default)), others
            )
        return self.threads

    def close(self) -> None:
        """Put torch's count back to the one found at start if this governor changed it (and it
        is still the count this governor set). ``num_threads`` set: nothing (as before)."""
        if not self.fixed and self.threads != self.default and torch.get_num_threads() == self.threads:
            torch.set_num_threads(self.default)
            self.threads = self.default

    def _apply(self, n: int, others: float) -> None:
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        self.threads = n
        if n < self.default and not self.noted:
            self.noted = True
            quota = f"; the cgroup's CPU quota is {self.quota:g} CPUs" if self.quota is not None else ""
            log.warning(
                "note: %.1f of %d CPUs are busy with other processes%s; using %d intra-op thread%s instead "
                "of %d (set num_threads to choose)",
                others,
                len(self.cpus),
                quota,
                n,
                "" if n == 1 else "s",
                self.default,
            )
