"""Checkpoints of a run (``RUN_DIR/checkpoints/step_N``).

A checkpoint folder holds ``model/`` (safetensors weights, or the LoRA adapter, plus the
tokenizer: a complete model folder for ``policygrad eval --model``), ``trainer_state.pt``
(optimizer, schedule, KL controller, data position, RNG states, reward normaliser, PPO-ptx
position, update counts; loaded with ``weights_only=True``, so a crafted file cannot run code),
with a critic ``critic/``, and the completion marker ``COMPLETE``. A run whose networks are
FSDP-sharded (``distributed.strategy: fsdp``) also writes ``sharded/``, a
``torch.distributed.checkpoint`` folder in which every rank writes its shards of the policy's (and
critic's) weights and AdamW state; its ``trainer_state.pt`` then holds no optimizer tensors.
Every checkpoint resumes with any number of ranks and either strategy: ``sharded/`` is resharded
on load, and a full optimizer state is sharded on load (``Trainer.load_state_dict``).

A checkpoint is a transaction (:func:`save_checkpoint`): everything is written into a hidden
sibling folder ``.step_N.tmp-PID``, every file and folder is fsynced, the folder is renamed to
``step_N``, and only then the marker is written, listing every file with its size. A save that
is killed, or fails on a full disk, leaves no ``step_N`` or one without a marker; either way
:func:`latest_checkpoint` skips it (saying why) and resume takes the newest complete one.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import time
from typing import Any

import torch

from policygrad.errors import CheckpointError, CheckpointSaveError, TrainingError
from policygrad.models.adapters import is_peft_model
from policygrad.run.directory import atomic_write_text, checkpoints_dir, fsync_dir

__all__ = [
    "CheckpointError",
    "CheckpointSaveError",
    "checkpoint_bytes",
    "checkpoint_path",
    "checkpoint_problem",
    "checkpoint_step",
    "find_checkpoints",
    "latest_checkpoint",
    "load_trainer_state",
    "recover_interrupted_saves",
    "save_checkpoint",
    "temp_folder",
]

log = logging.getLogger("policygrad")

STATE_FILE = "trainer_state.pt"
COMPLETE_FILE = "COMPLETE"


def checkpoint_path(run_dir: str, step: int) -> str:
    """``RUN_DIR/checkpoints/step_N``."""
    return os.path.join(checkpoints_dir(run_dir), f"step_{step}")


def checkpoint_step(path: str) -> int | None:
    """N of a ``.../step_N`` folder, or None for any other name."""
    name = os.path.basename(os.path.normpath(path))
    number = name[len("step_") :] if name.startswith("step_") else ""
    return int(number) if number.isdigit() else None


def _files_with_sizes(folder: str) -> dict[str, int]:
    sizes = {}
    for root, _, files in os.walk(folder):
        for name in files:
            full = os.path.join(root, name)
            sizes[os.path.relpath(full, folder)] = os.path.getsize(full)
    return sizes


def checkpoint_problem(path: str) -> str | None:
    """Why the checkpoint folder ``path`` is not complete, or None when it is: its marker is
    present and every file it lists is there with the size it had when the save finished."""
    marker = os.path.join(path, COMPLETE_FILE)
    if not os.path.isfile(marker):
        return "no completion marker (its save did not finish)"
    try:
        with open(marker, encoding="utf-8") as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"its completion marker {COMPLETE_FILE} is unreadable"
    for name, size in sorted(files.items()):
        full = os.path.join(path, name)
        if not os.path.isfile(full):
            return f"{name} is missing"
        if os.path.getsize(full) != size:
            return f"{name} has {os.path.getsize(full)} bytes, not the {size} it was saved with"
    return None


def find_checkpoints(run_dir: str) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest complete checkpoint under ``run_dir/checkpoints`` and the newer ones skipped.

    Returns:
        ``(path or None, [(skipped path, why), ...])``, newest first.
    """
    root = checkpoints_dir(run_dir)
    if not os.path.isdir(root):
        return None, []
    steps = sorted((n for n in (checkpoint_step(d) for d in os.listdir(root)) if n is not None), reverse=True)
    skipped = []
    for step in steps:
        path = os.path.join(root, f"step_{step}")
        problem = checkpoint_problem(path)
        if problem is None:
            return path, skipped
        skipped.append((path, problem))
    return None, skipped


def prune_checkpoints(run_dir: str, keep: int) -> list[str]:
    """Delete the complete checkpoints of ``run_dir`` but the newest ``keep`` (>= 1); folders that
    are not complete checkpoints (a save in progress, a killed one) are left alone. Returns the
    deleted paths, oldest first."""
    root = checkpoints_dir(run_dir)
    if not os.path.isdir(root):
        return []
    steps = sorted((n for n in (checkpoint_step(d) for d in os.listdir(root)) if n is not None), reverse=True)
    complete = [p for p in (os.path.join(root, f"step_{n}") for n in steps) if checkpoint_problem(p) is None]
    deleted = []
    for path in reversed(complete[keep:]):
        shutil.rmtree(path)
        log.info("deleted checkpoint %s (keep_checkpoints=%d)", path, keep)
        deleted.append(path)
    return deleted


def latest_checkpoint(run_dir: str) -> str | None:
    """The newest complete ``checkpoints/step_N`` folder under ``run_dir`` (see
    :func:`checkpoint_problem`), or None. Logs which one it is and why newer ones were skipped."""
    path, skipped = find_checkpoints(run_dir)
    for bad, why in skipped:
        log.warning("note: skipped checkpoint %s: %s", bad, why)
    if path is not None:
        log.info("newest complete checkpoint: %s", path)
    return path


def recover_interrupted_saves(run_dir: str) -> None:
    """Tidy ``run_dir/checkpoints`` after a save was killed (call it while owning the run): a
    checkpoint moved aside to be replaced (``.step_N.old-PID``) whose replacement never arrived is
    put back, and every other hidden folder of an unfinished save is deleted."""
    root = checkpoints_dir(run_dir)
    if not os.path.isdir(root):
        return
    for name in sorted(os.listdir(root)):
        if not (name.startswith(".step_") and (".tmp-" in name or ".old-" in name)):
            continue
        path = os.path.join(root, name)
        final = os.path.join(root, name[1:].split(".", 1)[0])
        replaced = ".old-" in name and checkpoint_problem(path) is None
        if replaced and os.path.exists(final) and checkpoint_problem(final) is not None:
            # the replacement was renamed into place but killed before its marker: it is the
            # half-written one, and the checkpoint it was to replace comes back
            shutil.rmtree(final, ignore_errors=True)
        if replaced and not os.path.exists(final):
            os.rename(path, final)
            log.warning("note: restored checkpoint %s (a save replacing it was interrupted)", final)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _fsync_tree(folder: str) -> None:
    for root, _, files in os.walk(folder, topdown=False):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def checkpoint_bytes(policy, critic=None) -> int:
    """About how many bytes one checkpoint of this run takes on disk: each network's saved
    weights (every parameter in its dtype; with an adapter, the adapter's trainable ones) and
    AdamW's two float32 moments per trainable parameter. The tokenizer, the trainer's state and
    the files' headers (megabytes) are left out. Under FSDP parameters are DTensors, whose
    ``numel`` is the whole tensor's, so the sum is the checkpoint's, not a rank's share."""
    total = 0
    for network in (policy, critic):
        if network is None:
            continue
        adapter = is_peft_model(network)
        for p in network.parameters():
            if p.requires_grad or not adapter:
                total += p.numel() * p.element_size()
            if p.requires_grad:
                total += 8 * p.numel()
    return total


def check_room_for_checkpoint(folder: str, needed: int) -> None:
    """Refuse a run whose output folder's disk cannot hold one checkpoint (``needed`` bytes,
    :func:`checkpoint_bytes`): its trained steps could never be saved, and would be lost at the
    first save.

    Raises:
        TrainingError: the free space of the disk holding ``folder`` (or its nearest existing
            parent) is below ``needed``.
    """
    where = os.path.abspath(folder)
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    try:
        free = shutil.disk_usage(where).free
    except OSError:  # a folder the OS cannot measure: the save's own errors stay the guard
        return
    if free < needed:
        raise TrainingError(
            f"output_dir {folder} is on a disk with {_size(free)} free, and one checkpoint of this run "
            f"takes about {_size(needed)} (weights and AdamW state): the steps it trains could not be "
            "saved, so nothing was trained; free space, or set output_dir on a disk with room"
        )


def _size(n: int) -> str:
    """``n`` bytes in the unit that shows its size (decimal units, as ``df -H``)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}" if n < 10 * scale else f"{n / scale:.0f} {unit}"
    return f"{n} bytes"


# Below this much free space a failed write is most likely a full disk (torch.save then reports
# only "unexpected pos", safetensors "StorageFull").
LOW_DISK_BYTES = 1 << 30


def _write_reason(exc: BaseException, folder: str | None = None) -> str:
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return f"{exc.strerror or exc}{where}"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if "StorageFull" in text or "No space left" in text:  # safetensors reports the OS error as text
        return "No space left on device"
    free = None
    if folder is not None:
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            free = None
    if free is not None and free < LOW_DISK_BYTES:
        return f"the disk is probably full ({free / 2**20:.0f} MiB free; {type(exc).__name__}: {text[:120]})"
    return f"{type(exc).__name__}: {text[:200]}"


def save_checkpoint(
    path: str,
    *,
    policy,
    tokenizer,
    state: dict[str, Any],
    critic=None,
    model_card: str | None = None,
    critic_state: dict[str, torch.Tensor] | None = None,
    tmp: str | None = None,
) -> str:
    """Write the checkpoint folder ``path`` as a transaction (see the module docstring): the
    policy (``save_pretrained``, safetensors; the adapter with LoRA), tokenizer and ``model_card``
    (``README.md``, :mod:`policygrad.run.export`) under ``model/``, ``state`` as
    ``trainer_state.pt``, the critic under ``critic/`` when given (``critic_state``: its full
    weights, when the critic itself is sharded), then the completion marker. Returns ``path``.

    ``tmp``: the temporary folder to complete, already holding what the ranks wrote into it
    (``sharded/``, :func:`save_sharded_state`); default a fresh ``.step_N.tmp-PID``.

    Raises:
        CheckpointSaveError: a write failed (full disk, read-only folder, ...): nothing of this
            checkpoint is left, an older ``path`` and every other checkpoint are untouched.
    """
    parent, name = os.path.split(os.path.normpath(path))
    prepared = tmp is not None
    tmp = tmp or temp_folder(path)
    old = os.path.join(parent, f".{name}.old-{os.getpid()}")
    try:
        os.makedirs(parent, exist_ok=True)
        if not prepared:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        policy.save_pretrained(os.path.join(tmp, "model"), safe_serialization=True)
        tokenizer.save_pretrained(os.path.join(tmp, "model"))
        if model_card is not None:  # after save_pretrained, whose template it replaces
            with open(os.path.join(tmp, "model", "README.md"), "w", encoding="utf-8") as f:
                f.write(model_card)
        if critic is not None:
            critic.save(os.path.join(tmp, "critic"), state=critic_state)
        torch.save(state, os.path.join(tmp, STATE_FILE))
        files = _files_with_sizes(tmp)
        _fsync_tree(tmp)
        if os.path.exists(path):  # the same step saved again: the new one replaces it
            shutil.rmtree(old, ignore_errors=True)
            os.rename(path, old)
        os.rename(tmp, path)
        fsync_dir(parent)
        marker = {"step": state.get("step"), "saved_at": time.time(), "files": files}
        atomic_write_text(os.path.join(path, COMPLETE_FILE), json.dumps(marker, indent=1))
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if os.path.exists(old) and not os.path.exists(path):
            os.rename(old, path)  # the replaced checkpoint comes back
        run_dir = os.path.dirname(parent)
        if find_checkpoints(run_dir)[0] is not None:
            then = (
                "the checkpoints written before are intact; free space (or fix the folder) and continue "
                f"with --resume {run_dir}"
            )
        else:  # nothing to resume: the folder of a start without a checkpoint is taken as new
            then = (
                "no checkpoint was written before; free space (or fix the folder) and run the same command "
                "again: the run starts over"
            )
        raise CheckpointSaveError(
            f"could not write checkpoint {path}: {_write_reason(exc, parent)}; nothing of it was kept "
            f"and {then}"
        ) from exc
    except BaseException:  # a second Ctrl-C: leave no half folder behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return path


def temp_folder(path: str) -> str:
    """The hidden folder a save of checkpoint ``path`` writes into before it is renamed."""
    parent, name = os.path.split(os.path.normpath(path))
    return os.path.join(parent, f".{name}.tmp-{os.getpid()}")


def load_trainer_state(path: str) -> dict[str, Any]:
    """The ``trainer_state.pt`` of a checkpoint folder, loaded with ``weights_only=True``.

    Raises:
        CheckpointError: the file is missing, unreadable, holds anything but tensors and plain
            containers (a file that would run code when unpickled), or lacks the fields a
            trainer state has.
    """
    file = os.path.join(path, STATE_FILE)
    try:
        state = torch.load(file, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {path} has no {STATE_FILE}; it is incomplete") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError, TypeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"checkpoint {file} cannot be loaded safely ({first[:200]}); it is corrupt or was not written "
            "by policygrad"
        ) from None
    missing = [k for k in _STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(
            f"checkpoint {file} is not a policygrad trainer state (no {', '.join(missing)}); it is corrupt "
            "or was not written by policygrad"
        )
    return state


_STATE_KEYS = ("step", "data_position", "optimizer", "scheduler", "kl_controller", "rng")
