"""Run outputs: ``metrics.jsonl`` (one row per step), TensorBoard events, a progress bar.

Every metric name is defined once, where it is computed, and follows the field's names
(``reward/mean``, ``kl/ref``, ``policy/clipfrac``, ``time/generation_s``, ...).
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

import torch

from policygrad.errors import TrainingError
from policygrad.run.directory import atomic_write_text, metrics_file
from policygrad.run.trackers import TensorBoardTracker

log = logging.getLogger("policygrad")


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else value
    return value


def read_metrics_rows(path: str) -> list[dict[str, Any]]:
    """The rows of a ``metrics.jsonl``. A torn last line (the run stopped while writing it) is
    dropped with a message naming the file.

    Raises:
        TrainingError: a line other than the last is not a JSON object (the file is damaged).
    """
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    rows = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            row = None
        if isinstance(row, dict):
            rows.append(row)
        elif number == len(lines):  # no newline after it: the write was cut short
            log.warning(
                "note: %s: dropped its torn last line (%d bytes); the run stopped while writing it",
                path,
                len(raw),
            )
        else:
            raise TrainingError(
                f"{path}: line {number} is not a JSON row; the file is damaged (remove or fix that line, "
                "then resume)"
            )
    return rows


class MetricsLogger:
    """Appends one JSON row per step to ``RUN_DIR/metrics.jsonl`` and hands every row to the
    trackers (``report_to``: TensorBoard, W&B, MLflow, trackio; :mod:`policygrad.run.trackers`).

    Each row is appended with a single ``write`` of the whole line to a file opened for appending,
    so a crash leaves at most a torn last line, which resume drops (:func:`read_metrics_rows`).

    Args:
        run_dir: the run directory.
        tensorboard: mirror numeric metrics to TensorBoard (``RUN_DIR/tensorboard``).
        trackers: opened trackers (:func:`policygrad.run.trackers.build_trackers`); closed
            by :meth:`close`.
        truncate_after_step: on resume, the checkpoint's step: rows logged after it are dropped
            (the file is rewritten atomically) so that each step appears once.

    Raises:
        TrainingError: resuming over a damaged ``metrics.jsonl`` (see :func:`read_metrics_rows`).
    """

    def __init__(
        self,
        run_dir: str,
        *,
        tensorboard: bool = True,
        truncate_after_step: int | None = None,
        trackers: list | None = None,
    ):
        self.path = metrics_file(run_dir)
        if truncate_after_step is not None and os.path.exists(self.path):
            rows = [r for r in read_metrics_rows(self.path) if r.get("step", 0) <= truncate_after_step]
            atomic_write_text(self.path, "".join(json.dumps(row) + "\n" for row in rows))
        self.trackers = list(trackers or [])
        if tensorboard:
            try:
                self.trackers.insert(0, TensorBoardTracker(run_dir))
            except ImportError:  # tensorboard is a dependency; tolerate a minimal install
                pass

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        line = (json.dumps(row) + "\n").encode("utf-8")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            written = os.write(fd, line)  # the whole line in one write: never interleaved or half
            while written < len(line):  # a short write (a signal, a nearly full disk): finish it
                written += os.write(fd, line[written:])
        except OSError as e:  # a write's error names no file (a full disk): the message must
            raise OSError(e.errno, e.strerror, self.path) from e
        finally:
            os.close(fd)
        for tracker in self.trackers:
            tracker.log(step, row)

    def close(self) -> None:
        """Finish every tracker (idempotent)."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            try:
                tracker.close()
            except Exception as e:  # noqa: BLE001 - one tracker's failure must not keep the others open
                log.warning("note: closing the %s tracker failed: %s", tracker.name, e)
