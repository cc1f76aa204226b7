"""The run directory: its layout (the one place that names the files a run writes), who owns
it, which files a run writes there, and writing a file so that a crash never leaves half of it.

* **Layout.** ``RUN_DIR/config.yaml`` (:func:`config_file`), ``metrics.jsonl``
  (:func:`metrics_file`), ``summary.json`` (:func:`summary_file`), ``<tag>.jsonl`` of each
  evaluation (:func:`eval_file`), ``checkpoints/`` (:func:`checkpoints_dir`; the folders in it are
  :mod:`policygrad.run.checkpoint`'s), ``merged_model/`` and ``start_model/``. Code outside
  :mod:`policygrad.run` that needs a run's file asks these functions for its path.
* **Ownership.** A run holds ``RUN_DIR/.policygrad.lock`` (an exclusive ``flock``; the file
  records the owner's pid, host and start time) for its whole life. A second run in the same
  directory is refused, naming the owner; a lock file whose process is gone (the kernel released
  its ``flock``) is taken over with a message. ``flock`` is advisory and per host: two machines
  sharing a network folder are not kept apart.
* **What a run writes** (:data:`RUN_FILES`): ``config.yaml``, ``metrics.jsonl``,
  ``summary.json``, the ``eval_*.jsonl`` files, ``checkpoints/step_N`` (and the hidden folders
  of a checkpoint being written), TensorBoard event files, ``merged_model/``,
  ``start_model/``, the trackers' ``wandb/``, ``mlruns/`` and ``trackers.json``, and the lock.
  ``--overwrite`` deletes
  exactly these, nothing else in the folder.
* **Checks before anything is written** (:func:`check_new_run_dir`): a new run refuses a folder
  that holds a run (unless ``overwrite``), a ``config.yaml`` that policygrad did not write, a
  file in place of the folder and a folder in use; all read-only.
* **A folder holds a run** once a step of it is worth keeping (:func:`holds_run`): a checkpoint,
  an export, or a summary of finished steps. What a start that failed before its first
  checkpoint left (``config.yaml``, metrics, evaluations) holds nothing to resume: the next new
  run in the folder replaces it, so the corrected command works as it is.

Taking the folder once a run is built (the lock, then the run's files) is
:func:`policygrad.run.start.take_run_dir`; the checks of ``--resume`` are
:func:`policygrad.run.resume.check_resume`.
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import re
import shutil
import socket
import time
import weakref
from typing import Any

import yaml

from policygrad.config.train import ConfigError
from policygrad.errors import TrainingError

__all__ = [
    "LOCK_FILE",
    "RunLock",
    "atomic_write_text",
    "check_new_run_dir",
    "check_not_in_use",
    "checkpoints_dir",
    "config_file",
    "eval_file",
    "fsync_dir",
    "holds_run",
    "lock_owner",
    "merged_model_dir",
    "metrics_file",
    "remove_run_files",
    "run_files",
    "start_model_dir",
    "summary_file",
    "write_config",
    "write_summary",
]

log = logging.getLogger("policygrad")

LOCK_FILE = ".policygrad.lock"

# Entries of RUN_DIR a run writes: top-level files, and folders whose matching entries are its own.
_TOP_FILES = re.compile(
    r"^(config\.yaml|metrics\.jsonl|summary\.json|trackers\.json|eval_(before|after|step\d+)\.jsonl)$"
)
_CHECKPOINT_ENTRIES = re.compile(r"^(step_\d+|\.step_\d+\.(tmp|old)-\d+)$")
_TENSORBOARD_ENTRIES = re.compile(r"^events\.out\.tfevents\..+$")
# An export, the folder of a caller's model object, and the W&B and MLflow stores of report_to:
# left behind by --overwrite, the old run's tracker data would sit beside the new run's.
_TOP_FOLDERS = ("merged_model", "start_model", "wandb", "mlruns")
RUN_FILES = (
    "config.yaml, metrics.jsonl, summary.json, trackers.json, eval_before/eval_after/eval_stepN.jsonl, "
    "checkpoints/step_N, tensorboard/events.out.tfevents.*, merged_model/, start_model/, wandb/, mlruns/, "
    + LOCK_FILE
)


# --------------------------------------------------------------------------------------------
# Layout.


def config_file(run_dir: str) -> str:
    """``RUN_DIR/config.yaml``: the run's resolved config (:func:`write_config`)."""
    return os.path.join(run_dir, "config.yaml")


def metrics_file(run_dir: str) -> str:
    """``RUN_DIR/metrics.jsonl``: one row of metrics per step (:mod:`policygrad.run.logging`)."""
    return os.path.join(run_dir, "metrics.jsonl")


def summary_file(run_dir: str) -> str:
    """``RUN_DIR/summary.json``: what :meth:`policygrad.run.Run.train` returned (:func:`write_summary`)."""
    return os.path.join(run_dir, "summary.json")


def eval_file(run_dir: str, tag: str) -> str:
    """``RUN_DIR/<tag>.jsonl``: the records of one evaluation (``eval_before``, ``eval_stepN``,
    ``eval_after``)."""
    return os.path.join(run_dir, f"{tag}.jsonl")


def checkpoints_dir(run_dir: str) -> str:
    """``RUN_DIR/checkpoints``: the folder of :mod:`policygrad.run.checkpoint`'s ``step_N`` folders."""
    return os.path.join(run_dir, "checkpoints")


def merged_model_dir(run_dir: str) -> str:
    """``RUN_DIR/merged_model``: the export with every LoRA adapter merged in."""
    return os.path.join(run_dir, "merged_model")


def start_model_dir(run_dir: str) -> str:
    """``RUN_DIR/start_model``: a caller's model object written where engines and critics can load it."""
    return os.path.join(run_dir, "start_model")


# --------------------------------------------------------------------------------------------
# Durable writes.


def fsync_dir(path: str) -> None:
    """Flush a folder's entries (a rename or a new file in it) to disk. No-op where folders
    cannot be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems refuse fsync on a folder
        if e.errno not in (errno.EINVAL, errno.EBADF):
            raise
    finally:
        os.close(fd)


def atomic_write_text(path: str, text: str) -> None:
    """Replace ``path`` with ``text`` atomically: a reader (or a crash) sees the old file or the
    new one, never a part. Written to a temporary sibling, fsynced, renamed into place.

    Raises:
        OSError: the folder is not writable, or the disk is full (the old file is intact).
    """
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.remove(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.filename is None:  # a failed write names no file (a full disk)
            raise OSError(e.errno, e.strerror, path) from e
        raise
    fsync_dir(folder)


def write_config(run_dir: str, config) -> None:
    """``RUN_DIR/config.yaml``: the resolved config, without ``overwrite`` (re-running a run's own
    config must never delete the run), written atomically.

    Raises:
        OSError: it cannot be written.
    """
    data = config.to_dict()
    data.pop("overwrite", None)
    atomic_write_text(config_file(run_dir), yaml.safe_dump(data, sort_keys=False))


def write_summary(run_dir: str, summary: dict[str, Any]) -> None:
    """``RUN_DIR/summary.json``, written atomically.

    Raises:
        OSError: it cannot be written.
    """
    atomic_write_text(summary_file(run_dir), json.dumps(summary, indent=2))


# --------------------------------------------------------------------------------------------
# What a run writes.


def run_files(run_dir: str, keep: tuple[str, ...] = ()) -> list[str]:
    """The entries of ``run_dir`` that a run wrote (paths, top-level files and folders' own
    entries), the lock file and the top-level names in ``keep`` excluded; ``[]`` when the folder
    does not exist."""
    if not os.path.isdir(run_dir):
        return []
    found = []
    for name in sorted(os.listdir(run_dir)):
        path = os.path.join(run_dir, name)
        if name in keep:
            continue
        if _TOP_FILES.match(name) and os.path.isfile(path):
            found.append(path)
        elif name in _TOP_FOLDERS and os.path.isdir(path):
            found.append(path)
        elif name == "checkpoints" and os.path.isdir(path):
            found += [os.path.join(path, n) for n in sorted(os.listdir(path)) if _CHECKPOINT_ENTRIES.match(n)]
        elif name == "tensorboard" and os.path.isdir(path):
            found += [
                os.path.join(path, n) for n in sorted(os.listdir(path)) if _TENSORBOARD_ENTRIES.match(n)
            ]
    return found


def holds_run(run_dir: str, keep: tuple[str, ...] = ()) -> bool:
    """Whether ``run_dir`` holds a run worth keeping: a ``checkpoints/step_N`` folder (complete or
    not: a half-written one is never deleted unasked), ``merged_model/``, or a ``summary.json``
    of a run that finished steps (its checkpoints may have been deleted by hand). What else a run
    writes (:func:`run_files`: ``config.yaml``, metrics, evaluations, the lock) is what a start
    that failed before its first checkpoint leaves, and does not count; nor do the names in
    ``keep``."""
    for path in run_files(run_dir, keep):
        name, parent = os.path.basename(path), os.path.basename(os.path.dirname(path))
        if (parent == "checkpoints" and name.startswith("step_")) or name == "merged_model":
            return True
        if name == "summary.json" and _summary_steps(path) != 0:
            return True
    return False


def _summary_steps(path: str) -> int | None:
    """The steps a ``summary.json`` records; None when it cannot be read (then it counts as a run's)."""
    try:
        with open(path, encoding="utf-8") as f:
            steps = json.load(f).get("steps")
    except (OSError, ValueError, AttributeError):
        return None
    return steps if isinstance(steps, int) else None


def _is_policygrad_config(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and {"algorithm", "model", "rollout", "reward"} <= set(data)


def remove_run_files(run_dir: str, keep: tuple[str, ...] = ()) -> list[str]:
    """Delete what a run wrote in ``run_dir`` (:func:`run_files`, but for the names in ``keep``),
    then the ``checkpoints`` and ``tensorboard`` folders if that left them empty. Everything else
    stays. Returns the paths deleted. Call it only while holding the folder's :class:`RunLock`.

    Raises:
        OSError: a file cannot be deleted.
    """
    removed = run_files(run_dir, keep)
    for path in removed:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    for name in ("checkpoints", "tensorboard"):
        folder = os.path.join(run_dir, name)
        if os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)
    return removed


def check_new_run_dir(
    run_dir: str, *, overwrite: bool, owned: bool = False, keep: tuple[str, ...] = ()
) -> None:
    """Read-only checks that a new run may start in ``run_dir``: nothing is written. ``owned``:
    the caller holds the folder's :class:`RunLock` (the owner check is skipped). ``keep``: entries
    the starting run itself wrote while it was being built (``start_model``), not a run's.

    Raises:
        ConfigError: ``run_dir`` is a file; it holds a ``config.yaml`` that policygrad did not
            write; it holds a run and ``overwrite`` is False.
        TrainingError: another live run owns it (:func:`lock_owner`).
    """
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise ConfigError(f"output_dir={run_dir!r} is a file; give a folder")
    config = config_file(run_dir)
    if os.path.isfile(config) and not _is_policygrad_config(config):
        raise ConfigError(
            f"output_dir={run_dir!r} holds a config.yaml that is not a policygrad run's (--overwrite deletes "
            "only what a run writes, and this file is not one of those); choose another --output_dir"
        )
    if not owned:
        check_not_in_use(run_dir)
    if holds_run(run_dir, keep) and not overwrite:
        raise ConfigError(
            f"output_dir={run_dir!r} already holds a run; continue it with --resume {run_dir}, choose a new "
            "--output_dir, or replace it with --overwrite=true"
        )


# --------------------------------------------------------------------------------------------
# Ownership.


def _describe(info: dict[str, Any]) -> str:
    started = info.get("started")
    when = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started))
        if isinstance(started, (int, float))
        else "?"
    )
    return f"pid {info.get('pid', '?')} on {info.get('host', '?')}, started {when}"


def _read_info(fd: int) -> dict[str, Any]:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    try:
        info = json.loads(data.decode("utf-8")) if data.strip() else {}
    except (UnicodeDecodeError, json.JSONDecodeError):
        info = {"pid": "?", "unreadable": True}
    return info if isinstance(info, dict) else {}


def _try_flock(fd: int) -> bool:
    # POSIX-only: imported where the lock is taken
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def lock_owner(run_dir: str) -> dict[str, Any] | None:
    """The live owner of ``run_dir`` (``{"pid", "host", "started"}``), or None when no running
    process holds its lock. Read-only: the lock file is neither created nor changed."""
    path = os.path.join(run_dir, LOCK_FILE)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        if _try_flock(fd):
            return None  # free: nobody holds it (we drop it again on close)
        return _read_info(fd)
    finally:
        os.close(fd)


def _in_use_error(run_dir: str, info: dict[str, Any]) -> TrainingError:
    if info.get("pid") == os.getpid():
        return TrainingError(
            f"output_dir={run_dir!r} is in use by another Trainer in this process ({_describe(info)}); "
            "finish its train() or call its close() first"
        )
    return TrainingError(
        f"output_dir={run_dir!r} is in use by another run ({_describe(info)}); wait for it to end, or "
        "choose another --output_dir"
    )


def check_not_in_use(run_dir: str) -> None:
    """Read-only: refuse ``run_dir`` while another live run owns it.

    Raises:
        TrainingError: naming the owner's pid, host and start time.
    """
    info = lock_owner(run_dir)
    if info is not None and info.get("pid") == os.getpid():
        gc.collect()  # a Trainer of this process that nobody references any more releases on collection
        info = lock_owner(run_dir)
    if info is not None:
        raise _in_use_error(run_dir, info)


def _release(path: str, fd: int) -> None:
    try:
        if os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.remove(path)  # before unlocking, so a waiting run never locks a file about to vanish
    except OSError:
        pass
    os.close(fd)  # closing drops the flock


class RunLock:
    """Exclusive ownership of a run directory (see the module docstring). Use :meth:`acquire`;
    :meth:`release` (or garbage collection, or the process's end) gives it up."""

    def __init__(self, run_dir: str, path: str, fd: int, info: dict[str, Any]):
        self.run_dir, self.path, self.info = run_dir, path, info
        self._finalizer = weakref.finalize(self, _release, path, fd)

    @classmethod
    def acquire(cls, run_dir: str) -> RunLock:
        """Create ``run_dir`` if needed and take its lock.

        Raises:
            TrainingError: another live process (or another Trainer of this one) holds it.
            OSError: the folder or the lock file cannot be created.
        """
        os.makedirs(run_dir, exist_ok=True)
        path = os.path.join(run_dir, LOCK_FILE)
        for attempt in range(5):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            if not _try_flock(fd):
                info = _read_info(fd)
                os.close(fd)
                if info.get("pid") == os.getpid() and attempt == 0:
                    gc.collect()  # see check_not_in_use
                    continue
                raise _in_use_error(run_dir, info)
            try:  # the file we locked must still be the one at ``path`` (an owner unlinks it on release)
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            previous = _read_info(fd)
            if previous:
                log.warning(
                    "note: took over the lock of %s: a run (%s) that ended without releasing it",
                    run_dir,
                    _describe(previous),
                )
            info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, (json.dumps(info) + "\n").encode("utf-8"))
            os.fsync(fd)
            return cls(run_dir, path, fd, info)
        raise TrainingError(f"output_dir={run_dir!r}: could not take its lock {path}; try again")

    @property
    def held(self) -> bool:
        return self._finalizer.alive

    def release(self) -> None:
        """Give the directory up (idempotent): the lock file is removed and unlocked."""
        self._finalizer()
