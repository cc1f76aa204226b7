"""Plumbing shared by the lab commands: output files, plain-text tables, the plotting backend,
loading a model for an experiment, and parsing of list-valued options.

Every lab command produces three things: a table on stdout, a JSON file of the full result and a
PNG plot, both under an output folder (default ``lab-results/``).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

DEFAULT_OUTPUT_DIR = "lab-results"


def check_output_dir(path: str | os.PathLike) -> str:
    """The checks of :func:`ensure_output_dir` without creating anything, for a command to make
    before any model or dataset work (the folder is made when the results are written).

    Raises:
        ValueError: ``path`` or one of its parents exists and is not a folder (names ``--output-dir``).
    """
    path = os.fspath(path)
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    if os.path.exists(probe) and not os.path.isdir(probe):
        raise ValueError(f"--output-dir {path!r} is a file; give a folder for the lab's JSON and PNG files")
    return path


def ensure_output_dir(path: str | os.PathLike) -> str:
    """Create ``path`` (and its parents) when missing and return it as a string.

    Raises:
        ValueError: ``path`` exists and is not a folder (names the option ``--output-dir``).
    """
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--output-dir {path!r} is a file; give a folder for the lab's JSON and PNG files")
    os.makedirs(path, exist_ok=True)
    return path


def plain(value: Any) -> Any:
    """A JSON-ready copy of ``value``: tensors and numpy scalars become Python numbers or lists,
    tuples become lists, NaN becomes None (JSON has no NaN), +-inf become the strings "inf"/"-inf"."""
    try:
        # imported here: the command line imports this module for its parsers, before any torch work
        import torch

        if isinstance(value, torch.Tensor):
            value = value.item() if value.numel() == 1 else value.tolist()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    if hasattr(value, "item") and not isinstance(value, (list, tuple, dict, str)):
        try:
            value = value.item()
        except (TypeError, ValueError):
            pass
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def write_json(path: str | os.PathLike, data: Any) -> str:
    """Write ``plain(data)`` as indented JSON to ``path``; returns the path."""
    path = os.fspath(path)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(plain(data), f, indent=2)
        f.write("\n")
    return path


def fmt(value: Any, digits: int = 4) -> str:
    """A table cell: floats with ``digits`` significant digits (scientific when very small or
    large), None as ``-``, everything else ``str``."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
            return f"{value:.{max(digits - 1, 1)}e}"
        return f"{value:.{digits}g}"
    return str(value)


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, digits: int = 4) -> str:
    """A plain-text table: a header line, a rule, one line per row. The first column and every
    column holding text are left-aligned, numeric columns right-aligned. Cells go through
    :func:`fmt`."""
    raw = [list(row) for row in rows]
    cells = [[fmt(c, digits) for c in row] for row in raw]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    text = [
        i == 0 or any(isinstance(row[i], str) and not _numeric(row[i]) for row in raw)
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        parts = [v.ljust(widths[i]) if text[i] else v.rjust(widths[i]) for i, v in enumerate(values)]
        return "  ".join(parts).rstrip()

    out = [line(list(headers)), "  ".join("-" * w for w in widths)]
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def _numeric(text: str) -> bool:
    """True for cells such as ``"1.5"``, ``"112.0"``, ``"-"``, ``"135M"``, ``"16"``."""
    t = text.strip().replace(",", "")
    if t in ("-", ""):
        return True
    if t[-1:] in ("k", "M", "B", "T"):
        t = t[:-1]
    try:
        float(t)
    except ValueError:
        return False
    return True


def pyplot():
    """``matplotlib.pyplot`` with the non-interactive Agg backend (no display needed).

    Raises:
        ImportError: matplotlib is not installed (says how to install it).
    """
    try:
        # imported here: matplotlib loads only when a plot is drawn
        import matplotlib
    except ImportError as e:  # pragma: no cover - matplotlib is a dependency
        raise ImportError("the lab's plots need matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt  # after the backend is chosen

    return plt


def save_figure(fig, path: str | os.PathLike, *, dpi: int = 110) -> str:
    """Save ``fig`` as a PNG at ``path`` (tight bounding box), close it, return the path."""
    path = os.fspath(path)
    fig.savefig(path, dpi=dpi, bbox_inches="tight", format="png")
    pyplot().close(fig)
    return path


def parse_float_list(text: str | Sequence[float], name: str) -> list[float]:
    """``"0.1,0.5,1"`` (or a sequence of numbers) -> ``[0.1, 0.5, 1.0]``.

    Raises:
        ValueError: an item is not a finite number or the list is empty (names the option).
    """
    if isinstance(text, str):
        items = [t.strip() for t in text.split(",") if t.strip()]
    else:
        items = list(text)
    if not items:
        raise ValueError(f"{name} is empty; give comma-separated numbers such as 0.1,0.5")
    out = []
    for item in items:
        try:
            value = float(item)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: {item!r} is not a number; give comma-separated numbers") from None
        if not math.isfinite(value):
            raise ValueError(f"{name}: {item!r} is not finite")
        out.append(value)
    return out


def check_positive_int(value: Any, name: str, *, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``.

    Raises:
        TypeError: not an int. ValueError: smaller than ``minimum`` (names the argument).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def set_threads(threads: int | None) -> None:
    """``torch.set_num_threads(threads)`` when given (the ``--threads`` option). On a machine
    whose cores are busy, one thread avoids OpenMP threads spinning against other processes
    (measured on 2 shared cores: generation 8x slower with 2 threads than with 1).

    Raises:
        ValueError: ``threads`` < 1.
    """
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    # imported here: the command line imports this module for its parsers, before any torch work
    import torch

    torch.set_num_threads(threads)


def load_lab_model(spec: str, *, dtype: str = "float32"):
    """Load a causal LM (frozen, eval mode, dropout off) and its tokenizer for an experiment.

    Args:
        spec: ``bundled:NAME``, a local model folder or a (cached) hub id, as the ``model`` field
            of a training config.
        dtype: ``"float32"`` (default) or ``"bfloat16"``.

    Returns:
        ``(model, tokenizer)``.

    Raises:
        ValueError / FileNotFoundError: from :func:`policygrad.models.loading.resolve_model_path`.
    """
    # imported here: the CLI imports this module cheaply, and models.loading loads torch
    from policygrad.models.loading import load_causal_lm, load_tokenizer, resolve_model_path

    path = resolve_model_path(spec)
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path, dtype=dtype, trainable=False)
    return model, tokenizer


def tokenize_user_prompts(
    tokenizer, prompts: Sequence[str], *, max_prompt_length: int = 512
) -> list[list[int]]:
    """Token ids of user prompts rendered with the tokenizer's chat template (when it has one),
    ending with the assistant turn's header, as the trainer formats them.

    Raises:
        ValueError: no prompts, or a prompt that is not a non-empty string.
    """
    # imported here: the CLI imports this module cheaply, and data.chat loads torch
    from policygrad.data.chat import format_prompt, tokenize_prompts

    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt")
    for i, p in enumerate(prompts):
        if not isinstance(p, str) or not p:
            raise ValueError(f"prompts[{i}] must be a non-empty string, got {p!r}")
    texts = [format_prompt(tokenizer, p) for p in prompts]
    return tokenize_prompts(tokenizer, texts, max_prompt_length=max_prompt_length)


def repeat_each(items: Sequence[Any], times: int) -> list[Any]:
    """``[a, b], 2 -> [a, a, b, b]``: per-prompt values aligned with the rows of a rollout
    (the G samples of prompt i are rows i*G .. i*G+G-1)."""
    return [item for item in items for _ in range(times)]


def add_run_args(parser) -> None:
    """The options every model experiment shares: ``--seed``, ``--threads``, ``--output-dir``."""
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR)
