"""``report_to``: a tiny run writes every step's metrics to TensorBoard, W&B (offline files),
an MLflow file store and trackio's local storage, and each library reads back the same names
(:func:`~policygrad.learn.metrics.tracker_metric_name`) and values as ``metrics.jsonl``.
A tracker whose library is not installed is skipped."""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import struct

import pytest

from policygrad.config.train import ConfigError
from policygrad.learn.metrics import tracker_metric_name
from policygrad.run import Run
from policygrad.run.trackers import tracker_scalars

pytestmark = pytest.mark.integration

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")


def _installed(name: str) -> bool:
    module = "tensorboard" if name == "tensorboard" else name
    return importlib.util.find_spec(module) is not None


def _logged(run_dir) -> dict[int, dict[str, float]]:
    """step -> {tracker-independent name: value} of the finite numbers in metrics.jsonl."""
    out: dict[int, dict[str, float]] = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            step = row.pop("step")
            out.setdefault(step, {}).update(
                {k: float(v) for k, v in row.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
            )
    return out


def _wandb_history(run_dir) -> dict[int, dict[str, float]]:
    """The history records of the offline run, parsed with wandb's own protobuf definitions from
    the .wandb file (a LevelDB-style log: 7-byte header, 32 KiB blocks of framed records)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*", "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, pending, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            records.append(pending)
            pending = b""
    history: dict[int, dict[str, float]] = {}
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            step = int(items.pop("_step", record.history.step.num))
            history.setdefault(step, {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return history


def _mlflow_history(run_dir) -> dict[int, dict[str, float]]:
    from mlflow import MlflowClient

    ids = json.load(open(os.path.join(run_dir, "trackers.json")))
    client = MlflowClient(tracking_uri=ids["mlflow_tracking_uri"])
    run = client.get_run(ids["mlflow_run_id"])
    assert run.data.params["algorithm"] == "grpo" and run.data.params["rollout.group_size"] == "4"
    out: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(ids["mlflow_run_id"], key):
            out.setdefault(m.step, {})[key] = m.value
    return out


def _trackio_history(run_dir) -> dict[int, dict[str, float]]:
    from trackio.sqlite_storage import SQLiteStorage

    ids = json.load(open(os.path.join(run_dir, "trackers.json")))
    out: dict[int, dict[str, float]] = {}
    for row in SQLiteStorage.get_logs("policygrad-tests", ids["trackio_run"]):
        step = int(row["step"])
        out.setdefault(step, {}).update(
            {k: v for k, v in row.items() if k not in ("step", "timestamp") and isinstance(v, (int, float))}
        )
    return out


def _tensorboard_history(run_dir) -> dict[int, dict[str, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(os.path.join(run_dir, "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            out.setdefault(event.step, {})[tag] = event.value
    return out


READERS = {
    "tensorboard": _tensorboard_history,
    "wandb": _wandb_history,
    "mlflow": _mlflow_history,
    "trackio": _trackio_history,
}


def test_report_to_writes_every_tracker_and_each_library_reads_it_back(make_config, tmp_path, monkeypatch):
    available = [t for t in TRACKERS if _installed(t)]
    if len(available) < 2:
        pytest.skip("no tracker library besides tensorboard is installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    cfg = make_config("run", steps=2, tensorboard=True, report_to=available, project="policygrad-tests")
    run = Run(cfg)
    try:
        run.train()
    finally:
        run.close()
    run_dir = tmp_path / "run"
    logged = _logged(run_dir)
    assert sorted(logged) == [1, 2]
    for tracker in available:
        history = READERS[tracker](run_dir)
        for step, metrics in logged.items():
            expected = {tracker_metric_name(tracker, k): v for k, v in metrics.items()}
            got = history.get(step, {})
            assert set(expected) <= set(got), (tracker, sorted(set(expected) - set(got))[:5])
            for name, value in expected.items():
                assert got[name] == pytest.approx(value, rel=1e-6, abs=1e-7), (tracker, step, name)


def test_tracker_names_and_values():
    # MLflow refuses '@' and ':' in a name; the others take any name.
    assert tracker_metric_name("mlflow", "eval/pass@8") == "eval/pass_8"
    assert tracker_metric_name("wandb", "eval/pass@8") == "eval/pass@8"
    row = {"step": 3, "a/b": 1, "c": True, "d": float("nan"), "e": "x", "f": 2.5}
    scalars = tracker_scalars("mlflow", row)
    assert scalars == {"a/b": 1.0, "f": 2.5}


def test_report_to_mistakes_are_one_line_errors(make_config):
    with pytest.raises(ConfigError, match=r"report_to\[0\]='neptune' is not valid"):
        make_config("x", report_to=["neptune"])
    with pytest.raises(ConfigError, match="'none' cannot be combined"):
        make_config("x", report_to=["none", "wandb"])
    assert make_config("x", report_to=["none"]).trackers == []
    assert make_config("x", report_to=["tensorboard", "wandb"], tensorboard=False).trackers == ["wandb"]


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_a_tracker_that_cannot_start_is_one_error_line_and_the_folder_stays_free(
    tracker, make_config, tmp_path, monkeypatch, capsys
):
    """W&B online without an API key, and an MLflow server nobody runs (port 9 on this machine:
    refused at once; MLflow's own defaults retried it for about 260 s): one line naming the
    tracker and what to check, within seconds."""
    import time

    import yaml

    from policygrad.cli import main

    if not _installed(tracker):
        pytest.skip(f"{tracker} is not installed")
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_API_KEY", "")
    for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc with a W&B key
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    for var in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    cfg = make_config("run", steps=1, report_to=[tracker])
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg.to_dict()))
    start = time.perf_counter()
    assert main(["train", str(path)]) == 2
    elapsed = time.perf_counter() - start
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(err) == 1 and err[0].startswith(f"error: report_to: {tracker} could not start ("), err
    assert {"wandb": "WANDB_API_KEY", "mlflow": "MLFLOW_TRACKING_URI"}[tracker] in err[0]
    assert elapsed < 120  # bounded, where MLflow's defaults spent ~260 s retrying
    assert not (tmp_path / "run" / "config.yaml").exists()  # the failed start left the folder free
