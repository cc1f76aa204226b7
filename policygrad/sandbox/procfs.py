"""Processes by their parent, read from ``/proc``: the one walk that both the sandbox's supervisor
(:func:`policygrad.sandbox.confine.kill_children`) and the environment workers
(:mod:`policygrad.envs.workers`, which end what an environment left behind) use.

Only the standard library: this module also runs inside the sandbox (:mod:`policygrad.sandbox.worker`).
"""

from __future__ import annotations

import os

__all__ = ["child_pids", "descendants"]


def child_pids() -> dict[int, list[int]]:
    """Every living process's pid under its parent's pid (in ``/proc``'s order), from the parent
    links in ``/proc/*/stat``; ``{}`` where there is no ``/proc``."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:  # ended meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """The pids of every living descendant of ``pid`` (children first); [] where there is no
    ``/proc``."""
    children = child_pids()
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
