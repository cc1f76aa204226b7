"""Run outputs: ``metrics.jsonl`` (one row per step), TensorBoard events, a progress bar.

Every metric name is defined once, where it is computed, and follows the field's names
(``reward/mean``, ``kl/ref``, ``policy/clipfrac``, ``time/generation_s``, ...).
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from typing import Any

import torch


def peak_rss_gb() -> float:
    """Peak resident set size of this process in GB (10^9 bytes), from ``getrusage``."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return kb * scale / 1e9


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else value
    return value


class MetricsLogger:
    """Appends one JSON row per step to ``RUN_DIR/metrics.jsonl`` and mirrors scalars to
    TensorBoard (``RUN_DIR/tensorboard``) when enabled."""

    def __init__(self, run_dir: str, *, tensorboard: bool = True, truncate_after_step: int | None = None):
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if truncate_after_step is not None and os.path.exists(self.path):
            # On resume, drop rows written after the checkpoint so the file has each step once.
            with open(self.path, encoding="utf-8") as f:
                rows = [json.loads(line) for line in f if line.strip()]
            with open(self.path, "w", encoding="utf-8") as f:
                for row in rows:
                    if row.get("step", 0) <= truncate_after_step:
                        f.write(json.dumps(row) + "\n")
        self._writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))
            except ImportError:  # tensorboard is a dependency; tolerate a minimal install
                self._writer = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self._writer is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
