"""Experiment trackers (``report_to``): every step's metrics go to TensorBoard, Weights & Biases,
MLflow and/or trackio, each through its own library, all of them local and offline by default.

- ``tensorboard`` (``torch.utils.tensorboard``): ``RUN_DIR/tensorboard``;
- ``wandb`` (extra ``wandb``): ``RUN_DIR/wandb/offline-run-*``, offline unless ``WANDB_MODE``
  says otherwise (``wandb sync`` uploads such a run later);
- ``mlflow`` (extra ``mlflow``: ``mlflow-skinny``): a file store in ``RUN_DIR/mlruns``, or the
  server or database of ``MLFLOW_TRACKING_URI`` when set;
- ``trackio`` (extra ``trackio``): trackio's local storage (``TRACKIO_DIR``, default
  ``~/.cache/huggingface/trackio``; ``trackio show`` opens its dashboard).

Names: :func:`policygrad.learn.metrics.tracker_metric_name` maps each metric name to what a
tracker accepts (the one place that does). Values: finite numbers only (``metrics.jsonl`` keeps
everything). The run's config goes to each tracker as its parameters. A resumed run continues
the same W&B / MLflow / trackio run: the ids are kept in ``RUN_DIR/trackers.json``.

A tracker whose library is missing is an error naming the extra to install, raised before the
run starts.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import time
from typing import Any

from policygrad.errors import TrainingError
from policygrad.learn.metrics import tracker_metric_name
from policygrad.run.directory import atomic_write_text

__all__ = ["TRACKER_EXTRAS", "Tracker", "build_trackers", "read_tracker_ids", "tracker_scalars"]

log = logging.getLogger("policygrad")

# The pip extra (``pip install policygrad[NAME]``) that brings each tracker's library.
TRACKER_EXTRAS = {"tensorboard": None, "wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
IDS_FILE = "trackers.json"
# What to check when a tracker cannot start.
TRACKER_HINTS = {
    "wandb": "online W&B needs WANDB_API_KEY or `wandb login`; WANDB_MODE=offline logs under the run",
    "mlflow": "MLFLOW_TRACKING_URI must reach a running server; unset it to log under the run",
    "trackio": "TRACKIO_DIR must be writable",
}


def tracker_scalars(tracker: str, metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numeric metrics of a step under the tracker's names (bools and NaN dropped)."""
    out = {}
    for key, value in metrics.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[tracker_metric_name(tracker, key)] = float(value)
    return out


class Tracker:
    """One tracker: ``log(step, metrics)`` and ``close()``. Subclasses open their run in
    ``__init__`` (``run_dir``, ``project``, ``run_name``, the config as a flat dict, the saved
    ids of a resumed run)."""

    name = ""

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flush and finish the run (idempotent)."""

    def ids(self) -> dict[str, str]:
        """What a resumed run needs to continue this tracker's run."""
        return {}


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, run_dir: str, **_):
        # an optional tracker: imported only when report_to names it
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(run_dir, "tensorboard"))

    def log(self, step, metrics):
        for key, value in tracker_scalars(self.name, metrics).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self):
        if self.writer is not None:
            self.writer.close()
            self.writer = None


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, run_dir: str, *, project: str, run_name: str, config: dict, saved: dict, **_):
        # an optional tracker: imported only when report_to names it
        import wandb

        mode = os.environ.get("WANDB_MODE") or "offline"
        os.makedirs(run_dir, exist_ok=True)
        self.run = wandb.init(
            project=project,
            name=run_name,
            dir=run_dir,
            mode=mode,
            config=config,
            id=saved.get("wandb_run_id"),
            resume="allow" if saved.get("wandb_run_id") else None,
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True),
            reinit="create_new",
        )

    def log(self, step, metrics):
        self.run.log(tracker_scalars(self.name, metrics), step=step)

    def close(self):
        if self.run is not None:
            self.run.finish()
            self.run = None

    def ids(self):
        return {"wandb_run_id": self.run.id} if self.run is not None else {}


class MLflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, run_dir: str, *, project: str, run_name: str, config: dict, saved: dict, **_):
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            # MLflow 3 keeps its file store behind an opt-in; a run directory is exactly its use.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = "file://" + os.path.abspath(os.path.join(run_dir, "mlruns"))
        if uri.startswith(("http://", "https://")):
            # MLflow's defaults retry a server it cannot reach for minutes in silence (7 retries,
            # backoff factor 2): a run that cannot log says so within seconds. The user's own
            # settings win.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        # an optional tracker: imported only when report_to names it
        from mlflow import MlflowClient
        from mlflow.entities import Metric, Param

        self._metric = Metric
        self.client = MlflowClient(tracking_uri=uri)
        self.uri = uri
        run_id = saved.get("mlflow_run_id")
        if run_id is None:
            exp = self.client.get_experiment_by_name(project)
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(project)
            run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in config.items()]
            for start in range(0, len(params), 100):  # MLflow's batch limit
                self.client.log_batch(run_id, params=params[start : start + 100])
        self.run_id = run_id

    def log(self, step, metrics):
        now = int(time.time() * 1000)
        batch = [self._metric(k, v, now, step) for k, v in tracker_scalars(self.name, metrics).items()]
        for start in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def close(self):
        if self.run_id is not None:
            self.client.set_terminated(self.run_id)

    def ids(self):
        return {"mlflow_run_id": self.run_id, "mlflow_tracking_uri": self.uri}


class TrackioTracker(Tracker):
    name = "trackio"

    def __init__(self, run_dir: str, *, project: str, run_name: str, config: dict, saved: dict, **_):
        del run_dir  # trackio keeps its own store (TRACKIO_DIR); every tracker is built with the folder
        # an optional tracker: imported only when report_to names it
        import trackio

        self._trackio = trackio
        with _captured_prints("trackio"):
            self.run = trackio.init(
                project=project,
                name=saved.get("trackio_run", run_name),
                config=config,
                resume="allow" if saved.get("trackio_run") else "never",
                auto_log_cpu=False,
                auto_log_gpu=False,
            )
        self.run_name = self.run.name

    def log(self, step, metrics):
        self.run.log(tracker_scalars(self.name, metrics), step=step)

    def close(self):
        if self.run is not None:
            with _captured_prints("trackio"):
                if self._trackio.context_vars.current_run.get() is self.run:
                    self._trackio.finish()  # also clears trackio's current run (its exit hook)
                else:
                    self.run.finish()
            self.run = None

    def ids(self):
        return {"trackio_run": self.run_name}


@contextlib.contextmanager
def _captured_prints(name: str):
    """A library that prints its progress: its lines go to the policygrad log (debug) instead."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        yield
    for line in buffer.getvalue().splitlines():
        if line.strip():
            log.debug("%s: %s", name, line.strip())


_TRACKERS: dict[str, type[Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MLflowTracker,
    "trackio": TrackioTracker,
}


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            plain = isinstance(value, (int, float, str, bool, type(None)))
            out[f"{prefix}{key}"] = value if plain else str(value)
    return out


def build_trackers(
    names: list[str], run_dir: str, *, project: str, run_name: str | None, config: dict, resume: bool
) -> list[Tracker]:
    """Open the trackers ``names`` (``TrainConfig.trackers``) for the run in ``run_dir``.

    Args:
        config: the run's config as a nested dict (sent flattened, ``kl.beta``, as parameters).
        resume: continue the runs whose ids ``RUN_DIR/trackers.json`` holds.

    Raises:
        ImportError: a tracker's library is missing (the message names the pip extra).
    """
    path = os.path.join(run_dir, IDS_FILE)
    saved = read_tracker_ids(run_dir) if resume else {}
    opened: list[Tracker] = []
    name = run_name or os.path.basename(os.path.normpath(os.path.abspath(run_dir)))
    flat = _flat(config)
    try:
        for tracker in names:
            try:
                opened.append(
                    _TRACKERS[tracker](run_dir, project=project, run_name=name, config=flat, saved=saved)
                )
            except ImportError as e:
                extra = TRACKER_EXTRAS[tracker] or tracker
                raise ImportError(
                    f"report_to: {tracker} needs its library ({e.name or e}); install it with "
                    f"pip install 'policygrad[{extra}]', or remove {tracker} from report_to"
                ) from None
            except Exception as e:  # a tracker's own failure (no API key, no server): one line
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
                hint = TRACKER_HINTS.get(tracker, "see its documentation")
                raise TrainingError(
                    f"report_to: {tracker} could not start ({type(e).__name__}: {first}); fix its set-up "
                    f"({hint}) or remove {tracker} from report_to"
                ) from e
    except BaseException:
        for t in opened:
            with contextlib.suppress(Exception):
                t.close()
        raise
    ids = {k: v for t in opened for k, v in t.ids().items()}
    if ids:
        atomic_write_text(path, json.dumps(ids, indent=2))
    return opened


def read_tracker_ids(run_dir: str) -> dict[str, str]:
    """The tracker run ids a run saved (``RUN_DIR/trackers.json``; ``{}`` when it has none), read
    and checked before a resume writes anything.

    Raises:
        ValueError: the file is not a JSON object of strings (names the file and the fix).
    """
    path = os.path.join(run_dir, IDS_FILE)
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            saved = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        saved, why = None, f"{type(e).__name__}: {e}"
    else:
        why = "not an object of tracker ids"
    if not isinstance(saved, dict) or not all(isinstance(v, str) for v in saved.values()):
        raise ValueError(
            f"{path} cannot be read ({why}); it holds the ids that continue this run's tracker runs: "
            "restore it, or delete it to start new tracker runs"
        )
    return saved
