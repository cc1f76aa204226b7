"""Run outputs: ``metrics.jsonl`` rows (one whole line per write, NaN as null, tensors as
numbers), a torn last line dropped on reading while a damaged earlier one is an error, rows after
a resumed checkpoint's step dropped, trackers fed and closed, and the peak RSS in GB."""

from __future__ import annotations

import errno
import json
import logging
import math

import pytest
import torch

from policygrad.errors import TrainingError
from policygrad.run import logging as run_logging
from policygrad.run.logging import MetricsLogger, read_metrics_rows

pytestmark = pytest.mark.unit


class Tracker:
    def __init__(self, name="fake", fail_close=False):
        self.name, self.fail_close = name, fail_close
        self.rows, self.closed = [], 0

    def log(self, step, row):
        self.rows.append((step, row))

    def close(self):
        self.closed += 1
        if self.fail_close:
            raise RuntimeError("server gone")


def test_a_row_per_step_with_plain_values(tmp_path):
    tracker = Tracker()
    logger = MetricsLogger(str(tmp_path), tensorboard=False, trackers=[tracker])
    logger.log(1, {"reward/mean": torch.tensor(0.25), "kl/ref": float("nan"), "n": 3})
    logger.log(2, {"policy/ratio_max": float("inf"), "note": "x"})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 1, "reward/mean": 0.25, "kl/ref": None, "n": 3}
    assert json.loads(lines[1]) == {"step": 2, "policy/ratio_max": math.inf, "note": "x"}
    assert tracker.rows == [
        (1, {"step": 1, "reward/mean": 0.25, "kl/ref": None, "n": 3}),
        (2, {"step": 2, "policy/ratio_max": math.inf, "note": "x"}),
    ]
    assert read_metrics_rows(logger.path) == [json.loads(line) for line in lines]


def test_a_second_logger_appends(tmp_path):
    MetricsLogger(str(tmp_path), tensorboard=False).log(1, {"a": 1})
    MetricsLogger(str(tmp_path), tensorboard=False).log(2, {"a": 2})
    assert [r["step"] for r in read_metrics_rows(str(tmp_path / "metrics.jsonl"))] == [1, 2]


def test_resuming_drops_the_rows_after_the_checkpoints_step(tmp_path):
    first = MetricsLogger(str(tmp_path), tensorboard=False)
    for step in (1, 2, 3, 4):
        first.log(step, {"a": step})
    resumed = MetricsLogger(str(tmp_path), tensorboard=False, truncate_after_step=2)
    assert [r["step"] for r in read_metrics_rows(resumed.path)] == [1, 2]
    resumed.log(3, {"a": 30})
    assert read_metrics_rows(resumed.path)[-1] == {"step": 3, "a": 30}  # each step appears once


def test_resuming_without_a_metrics_file_starts_one(tmp_path):
    logger = MetricsLogger(str(tmp_path), tensorboard=False, truncate_after_step=5)
    assert not (tmp_path / "metrics.jsonl").exists()
    logger.log(6, {})
    assert read_metrics_rows(logger.path) == [{"step": 6}]


def test_a_torn_last_line_is_dropped_with_a_note(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n\n{"step": 2}\n{"step": 3, "a"')
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        assert read_metrics_rows(str(path)) == [{"step": 1}, {"step": 2}]
    assert f"{path}: dropped its torn last line (15 bytes)" in caplog.text  # len(b'{"step": 3, "a"') = 15


@pytest.mark.parametrize("bad", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_a_damaged_earlier_line_is_an_error_naming_it(tmp_path, bad):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n' + bad + b'\n{"step": 3}\n')
    with pytest.raises(TrainingError, match=r"metrics.jsonl: line 2 is not a JSON row; the file is damaged"):
        read_metrics_rows(str(path))
    with pytest.raises(TrainingError, match="line 2"):  # a resume over it refuses too
        MetricsLogger(str(tmp_path), tensorboard=False, truncate_after_step=1)


def test_a_complete_but_damaged_last_line_is_an_error_too(tmp_path):
    # With its newline the line was written whole: it is damage, not a cut write.
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{not json\n')
    with pytest.raises(TrainingError, match="line 2"):
        read_metrics_rows(str(path))


def test_a_failed_write_names_the_file(tmp_path, monkeypatch):
    logger = MetricsLogger(str(tmp_path), tensorboard=False)

    def full(_fd, _data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_logging.os, "write", full)
    with pytest.raises(OSError) as caught:
        logger.log(1, {"a": 1})
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == logger.path


def test_a_short_write_is_finished(tmp_path, monkeypatch):
    logger = MetricsLogger(str(tmp_path), tensorboard=False)
    real = run_logging.os.write
    monkeypatch.setattr(run_logging.os, "write", lambda fd, data: real(fd, data[:5]))  # 5 bytes a call
    logger.log(7, {"reward/mean": 0.5})
    monkeypatch.undo()
    assert read_metrics_rows(logger.path) == [{"step": 7, "reward/mean": 0.5}]


def test_close_closes_every_tracker_once_even_when_one_fails(tmp_path, caplog):
    failing, other = Tracker("wandb", fail_close=True), Tracker("mlflow")
    logger = MetricsLogger(str(tmp_path), tensorboard=False, trackers=[failing, other])
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        logger.close()
    assert (failing.closed, other.closed) == (1, 1)
    assert "closing the wandb tracker failed: server gone" in caplog.text
    logger.close()  # idempotent
    assert (failing.closed, other.closed) == (1, 1)
