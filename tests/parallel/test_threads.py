"""Intra-op threads fitted to the machine's load: the pure choice from hand-worked readings, the
``/proc`` and cgroup readers against fake files, and the governor (``num_threads`` set: never
changed; a quiet machine: torch's default untouched; a busy one: fewer threads, said once)."""

from __future__ import annotations

import logging

import pytest
import torch

from policygrad.parallel import threads
from policygrad.parallel.threads import (
    CpuTimes,
    ThreadChooser,
    ThreadGovernor,
    choose_threads,
    others_from_load,
    others_from_times,
    parse_cfs_quota,
    parse_cpu_max,
    parse_proc_stat,
    parse_task_jiffies,
    read_cpu_times,
    read_quota,
)

pytestmark = pytest.mark.unit


# ----------------------------------------------------------------------------------------------
# The pure functions.


def test_cgroup_quotas_in_cpus():
    assert parse_cpu_max("150000 100000\n") == 1.5
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cfs_quota("50000\n", "100000\n") == 0.5
    assert parse_cfs_quota("-1\n", "100000\n") is None


@pytest.mark.parametrize(
    ("cpus", "quota", "others", "cap", "expected"),
    [
        (2, None, 0.0, 2, 2),  # quiet: torch's default
        (2, None, 1.0, 2, 1),  # load 1.0 of 2 -> 1 thread
        (2, None, 1.8, 2, 1),  # at least one
        (2, None, 0.5, 2, 2),  # 1.5 free rounds half up
        (2, None, 0.6, 2, 1),  # 1.4 free
        (8, 1.5, 0.0, 8, 2),  # quota 150000/100000 -> 1.5 CPUs -> 2 threads
        (8, 1.0, 0.0, 8, 1),
        (8, 4.0, 5.0, 8, 3),  # the busier limit wins
        (16, None, 0.0, 8, 8),  # never above torch's default
    ],
)
def test_choose_threads(cpus, quota, others, cap, expected):
    assert choose_threads(cpus, quota, others, cap) == expected


def test_others_from_the_load_average():
    assert others_from_load(2.0, 1, 2, 2) == 1.0  # load 2, one of them ours
    assert others_from_load(1.0, 1, 2, 2) == 0.0
    assert others_from_load(0.3, 1, 2, 2) == 0.0
    assert others_from_load(9.0, 1, 2, 8) == 2.0  # 8 busy on 8 CPUs: 2 on our 2
    assert others_from_load(30.0, 1, 2, 2) == 2.0  # at most every CPU


STAT = """cpu  900 10 100 5000 40 5 5 0 0 0
cpu0 500 10 50 2000 20 5 5 0 0 0
cpu1 400 0 50 3000 20 0 0 0 0 0
intr 12345
ctxt 678
"""


def test_proc_stat_busy_and_total():
    # busy: user + nice + system + irq + softirq + steal; total adds idle and iowait
    assert parse_proc_stat(STAT) == (1020, 6060)
    assert parse_proc_stat(STAT, {0}) == (570, 2590)
    assert parse_proc_stat(STAT, {1}) == (450, 3470)
    assert parse_proc_stat(STAT, {0, 1}) == (1020, 6060)


def task_stat(
    pid: int, comm: str, utime: int, stime: int, cutime: int = 0, cstime: int = 0, state: str = "S"
):
    after = [state, "1", "1", "1", "0", "-1", "4194560", "0", "0", "0", "0"]  # fields 3..13
    return f"{pid} ({comm}) " + " ".join(
        [*after, str(utime), str(stime), str(cutime), str(cstime), "20", "0"]
    )


def test_task_jiffies_counts_from_the_closing_parenthesis():
    text = task_stat(7, "a (b) c", 120, 30, 5, 2)
    assert parse_task_jiffies(text) == 157
    assert parse_task_jiffies(text, children=False) == 150


def test_others_from_two_readings():
    # 400 jiffies on 2 CPUs = 200 per CPU elapsed; 300 busy of which 100 ours -> 1 CPU busy elsewhere
    before, after = CpuTimes(1000, 2000, 100), CpuTimes(1300, 2400, 200)
    assert others_from_times(before, after, 2) == 1.0
    assert others_from_times(before, CpuTimes(1400, 2400, 500), 2) == 0.0  # all ours
    assert others_from_times(before, CpuTimes(1000, 2000, 100), 2) is None  # no time passed
    assert others_from_times(before, CpuTimes(1400, 2400, 50), 2) == 2.0  # capped at every CPU


def test_hysteresis_moves_after_two_readings_agree():
    c = ThreadChooser(2)
    assert c.offer(1) == 2  # one reading: pending
    assert c.offer(1) == 1  # two in a row: moved
    assert c.offer(2) == 1
    assert c.offer(1) == 1  # back to the current: the pending choice is dropped
    assert c.offer(2) == 1
    assert c.offer(2) == 2
    c = ThreadChooser(4)
    assert [c.offer(x) for x in (2, 3, 2, 2)] == [4, 4, 4, 2]  # only consecutive equal readings


# ----------------------------------------------------------------------------------------------
# The readers, against fake files.


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_read_quota_cgroup_v2_takes_the_smallest_on_the_path(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    write(proc / "self" / "cgroup", "0::/a/b\n")
    write(root / "a" / "b" / "cpu.max", "max 100000\n")
    write(root / "a" / "cpu.max", "150000 100000\n")
    write(root / "cpu.max", "300000 100000\n")
    assert read_quota(str(root), str(proc)) == 1.5


def test_read_quota_cgroup_v1_and_none(tmp_path):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    write(proc / "self" / "cgroup", "4:cpu,cpuacct:/x\n3:memory:/x\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "50000\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    assert read_quota(str(root), str(proc)) == 0.5
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    assert read_quota(str(root), str(proc)) is None
    assert read_quota(str(tmp_path / "nothing"), str(tmp_path / "noproc")) is None


def fake_proc(tmp_path, *, stat=STAT, own=(100, 20, 0, 0), child=None):
    proc = tmp_path / "proc"
    write(proc / "stat", stat)
    write(proc / "self" / "stat", task_stat(42, "python", *own))
    write(proc / "self" / "task" / "42" / "stat", task_stat(42, "python", *own, state="R"))
    write(proc / "self" / "task" / "43" / "stat", task_stat(43, "python", 0, 0, state="S"))
    write(proc / "self" / "task" / "42" / "children", "99 " if child else "")
    if child:
        write(proc / "99" / "stat", task_stat(99, "engine", *child))
        write(proc / "99" / "task" / "99" / "children", "")
    return proc


def test_read_cpu_times_counts_the_process_and_its_live_descendants(tmp_path):
    proc = fake_proc(tmp_path, own=(100, 20, 3, 1), child=(50, 5, 0, 0))
    # /proc/self is this fake's pid 42: its children file lists 99; 42's stat gives the pid
    (proc / "42").symlink_to(proc / "self")
    assert read_cpu_times({0, 1}, str(proc)) == CpuTimes(1020, 6060, 124 + 55)
    assert read_cpu_times({0}, str(proc)) == CpuTimes(570, 2590, 179)
    assert read_cpu_times({0}, str(tmp_path / "missing")) is None


# ----------------------------------------------------------------------------------------------
# The governor.


class FakeTorch:
    """torch's thread count, recorded instead of changed."""

    def __init__(self, monkeypatch, count=2):
        self.count, self.calls = count, []
        monkeypatch.setattr(torch, "get_num_threads", lambda: self.count)
        monkeypatch.setattr(torch, "set_num_threads", self.set)

    def set(self, n):
        self.calls.append(n)
        self.count = n


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A fake 2-CPU machine: load average, affinity, /proc and cgroup files under tmp_path."""
    state = {"load": 0.5}
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (state["load"], 0.0, 0.0))
    monkeypatch.setattr(threads, "affinity_cpus", lambda: {0, 1})
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    proc = fake_proc(tmp_path)
    (proc / "42").symlink_to(proc / "self")
    state["proc"], state["cgroup"] = str(proc), str(tmp_path / "cgroup")

    def tick(busy: int, own: int, total: int = 400):
        """Advance /proc by ``total`` jiffies over both CPUs: ``busy`` of them busy, ``own`` ours."""
        s = state.setdefault("t", [1020, 6060, 120])
        s[0] += busy
        s[1] += total
        s[2] += own
        b, t = s[0], s[1]
        write(proc / "stat", f"cpu  {b} 0 0 {t - b} 0 0 0 0 0 0\ncpu0 {b} 0 0 {t - b} 0 0 0 0 0 0\n")
        write(proc / "self" / "stat", task_stat(42, "python", s[2], 0))

    state["tick"] = tick
    return state


def governor(machine, num_threads=None):
    return ThreadGovernor(num_threads, proc=machine["proc"], cgroup_root=machine["cgroup"])


def test_num_threads_set_is_applied_once_and_never_changed(machine, monkeypatch):
    fake = FakeTorch(monkeypatch)
    machine["load"] = 5.0
    g = governor(machine, num_threads=2)
    assert fake.calls == [2] and g.threads == 2

    def no_reading(*_args, **_kwargs):
        raise AssertionError("num_threads set: nothing is read")

    monkeypatch.setattr(threads, "read_cpu_times", no_reading)
    for _ in range(5):
        assert g.check() == 2
    assert fake.calls == [2]


def test_num_threads_above_the_usable_cpus_is_refused_before_anything_is_set(machine, monkeypatch):
    from policygrad.config.sections import ConfigError

    fake = FakeTorch(monkeypatch)
    # the fake machine has 2 CPUs in the affinity set
    with pytest.raises(
        ConfigError,
        match=r"^num_threads=3 is more than the 2 CPUs this process may run on; set num_threads <= 2, or "
    ):
        governor(machine, num_threads=3)
    assert fake.calls == []
    assert governor(machine, num_threads=2).threads == 2


def test_a_quiet_machine_keeps_torchs_default_untouched(machine, monkeypatch, caplog):
    fake = FakeTorch(monkeypatch, count=2)
    with caplog.at_level(logging.INFO, logger="policygrad"):
        g = governor(machine)
        for _ in range(4):
            machine["tick"](busy=380, own=370)  # all but noise is ours
            assert g.check() == 2
    assert g.threads == g.default == 2
    assert fake.calls == []  # torch.set_num_threads never called: bit for bit today's run
    assert not caplog.records


def test_a_busy_machine_gets_fewer_threads_and_a_note_once(machine, monkeypatch, caplog):
    fake = FakeTorch(monkeypatch, count=2)
    machine["load"] = 2.0  # one of the two is ours: another process holds a core
    with caplog.at_level(logging.INFO, logger="policygrad"):
        g = governor(machine)
        assert g.threads == 1 and fake.calls == [1]
        for _ in range(3):
            machine["tick"](busy=400, own=200)  # the other job still holds a core
            assert g.check() == 1
        machine["tick"](busy=200, own=200)  # it ended: one quiet reading is not enough
        assert g.check() == 1
        machine["tick"](busy=200, own=200)
        assert g.check() == 2
        machine["tick"](busy=400, own=200)  # back again, twice
        g.check()
        machine["tick"](busy=400, own=200)
        assert g.check() == 1
    assert fake.calls == [1, 2, 1]
    notes = [r.getMessage() for r in caplog.records]
    assert notes == [
        "note: 1.0 of 2 CPUs are busy with other processes; using 1 intra-op thread instead of 2 "
        "(set num_threads to choose)"
    ]


def test_close_puts_back_the_count_found_at_start(machine, monkeypatch):
    fake = FakeTorch(monkeypatch, count=2)
    machine["load"] = 2.0
    g = governor(machine)
    assert g.threads == 1
    g.close()
    g.close()
    assert fake.calls == [1, 2] and g.threads == 2
    fixed = governor(machine, num_threads=1)
    fixed.close()  # num_threads set: left as set, as before
    assert fake.calls == [1, 2, 1] and fake.count == 1


def test_the_quota_limits_and_is_named(machine, monkeypatch, caplog, tmp_path):
    FakeTorch(monkeypatch, count=2)
    write(tmp_path / "proc" / "self" / "cgroup", "0::/\n")
    write(tmp_path / "cgroup" / "cpu.max", "100000 100000\n")
    with caplog.at_level(logging.INFO, logger="policygrad"):
        g = governor(machine)
    assert g.quota == 1.0 and g.threads == 1
    assert "the cgroup's CPU quota is 1 CPUs" in caplog.records[0].getMessage()
