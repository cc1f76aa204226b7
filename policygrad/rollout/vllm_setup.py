"""What an in-process vLLM engine needs around the library (the engine: :mod:`policygrad.rollout.vllm`):
its arguments checked against the model folder before vLLM loads, the environment it starts in, one
seed per request, the stop set and shutdown it is built with, the process-wide settings its start
changes (captured to be put back), its start-up failures in one line, the shutdown of the engines
of this process once the last one closes, and the names and shapes of a weight push checked before
anything is copied (with the worker extension that receives a push in another process)."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import numbers
import os
import random
import weakref

import torch

from policygrad.models.adapters import merged_weights, tied_pairs_that_differ

__all__ = [
    "DTYPES",
    "ENV_SET_HERE",
    "OPEN_ENGINES",
    "ProcessState",
    "VLLMStartError",
    "WorkerWeightSync",
    "check_engine_args",
    "check_weight_names",
    "checkpoint_shapes",
    "pushed_weight_shapes",
    "cpu_list",
    "model_text_config",
    "release",
    "request_seed",
    "set_env_defaults",
    "start_errors",
    "stop_at_eos_only",
    "take_over_shutdown",
    "weights_to_push",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# Environment variables this module set (a user's own settings are never overwritten).
ENV_SET_HERE: dict[str, str] = {}


def cpu_list(cpus) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"`` (the format of ``VLLM_CPU_OMP_THREADS_BIND``)."""
    cpus = sorted(cpus)
    parts, start = [], None
    for k, c in enumerate(cpus):
        if start is None:
            start = c
        if k + 1 == len(cpus) or cpus[k + 1] != c + 1:
            parts.append(f"{start}-{c}" if c != start else f"{c}")
            start = None
    return ",".join(parts)


def set_env_defaults(cache_root: str, cpu_threads: int | None = None) -> None:
    """Environment for an in-process vLLM engine; a value the user has set is left alone.
    ``cpu_threads``: bind the first that many allowed CPUs (None: all of them)."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        cpus = range(os.cpu_count() or 1)
    if cpu_threads is not None:
        cpus = sorted(cpus)[: max(1, cpu_threads)]
    defaults = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus),
        "VLLM_CACHE_ROOT": cache_root,
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_root, "inductor"),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    for key, value in defaults.items():
        current = os.environ.get(key)
        if not current or current == ENV_SET_HERE.get(key):  # unset, or set by an earlier engine
            os.environ[key] = ENV_SET_HERE[key] = value


def request_seed(generator_seed: int, index: int) -> int:
    """A seed in [0, 2**62) that depends on ``(generator_seed, index)`` only (SHA-256 of both)."""
    digest = hashlib.sha256(f"{int(generator_seed)}:{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]] | None:
    """``{name: shape}`` of every tensor in the folder's safetensors files; None without any."""
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        return None
    # imported here: safetensors is read only for a folder that holds such files
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), not __iter__)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def pushed_weight_shapes(model_path: str, text_config) -> dict[str, tuple[int, ...]] | None:
    """``{name: shape}`` of every weight a push to an engine of ``model_path`` sends: the
    folder's tensors (:func:`checkpoint_shapes`), plus ``lm_head.weight`` when the model ties it
    to the input embeddings (a tied checkpoint lacks it, but it is pushed: vLLM's CPU backend packs
    the output head apart and repacks only a layer that receives weights)."""
    shapes = checkpoint_shapes(model_path)
    if shapes is not None and getattr(text_config, "tie_word_embeddings", False):
        shapes.setdefault("lm_head.weight", (int(text_config.vocab_size), int(text_config.hidden_size)))
    return shapes


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def check_engine_args(
    dtype: str, eos_token_ids, max_model_len, seed, kv_cache_gb, gpu_memory_utilization
) -> list[int]:
    """The sorted distinct ``eos_token_ids``, after the checks of the engine's arguments that need
    no model folder (errors: see :class:`VLLMRolloutEngine`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    eos_token_ids = sorted({int(i) for i in (eos_token_ids or [])})
    if not eos_token_ids:
        raise ValueError("eos_token_ids is empty; give at least one end-of-sequence token id")
    for name, value in (("max_model_len", max_model_len), ("seed", seed)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not float(kv_cache_gb) > 0:
        raise ValueError(f"kv_cache_gb must be > 0 (GiB of KV cache on CPU), got {kv_cache_gb}")
    if not 0.0 < float(gpu_memory_utilization) <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    return eos_token_ids


def model_text_config(model_path: str, max_model_len: int):
    """The text config of the model folder ``model_path``, after checking that it is one and that
    ``max_model_len`` fits the model's ``max_position_embeddings``."""
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ValueError(
            f"model_path {model_path!r} is not a model folder with a config.json; give a local "
            "Hugging Face model folder (save_pretrained output)"
        )
    # imported here: transformers loads only when an engine is built
    from transformers import AutoConfig

    text_config = _text_config(AutoConfig.from_pretrained(model_path, trust_remote_code=False))
    limit = getattr(text_config, "max_position_embeddings", None)
    if max_model_len < 1 or (limit is not None and max_model_len > limit):
        raise ValueError(
            f"max_model_len must be in 1 .. {limit} (the model's max_position_embeddings), "
            f"got {max_model_len}"
        )
    return text_config


def stop_at_eos_only(llm) -> None:
    """Stop only at eos_token_ids: vLLM would also stop at generation_config.json's eos ids."""
    processor = getattr(llm.llm_engine, "input_processor", None)
    fields = getattr(processor, "generation_config_fields", None)
    if isinstance(fields, dict):
        fields.pop("eos_token_id", None)


def take_over_shutdown(llm):
    """Detach vLLM's own shutdown of ``llm``'s in-process engine and return it (None when there is
    none to detach): vLLM shuts that engine down when its client is garbage-collected, which would
    break any other open engine, so the VLLMRolloutEngine's finalizer (or close) calls it instead."""
    client = llm.llm_engine.engine_core
    shutdown = None
    # imported here: vLLM is an optional dependency, loaded when an engine is built
    from vllm.v1.engine.core_client import InprocClient

    vllm_finalizer = getattr(client, "_finalizer", None)
    if isinstance(client, InprocClient) and isinstance(vllm_finalizer, weakref.finalize):
        detached = vllm_finalizer.detach()
        shutdown = detached[1] if detached is not None else None
    return shutdown


class ProcessState:
    """Process-wide settings an in-process vLLM engine may change, captured to be put back."""

    @classmethod
    def capture(cls) -> ProcessState:
        # imported here: numpy's global generator is captured only when an engine starts
        import numpy as np

        state = cls()
        state.set_num_threads = torch.set_num_threads
        state.num_threads = torch.get_num_threads()
        state.default_dtype = torch.get_default_dtype()
        state.grad = torch.is_grad_enabled()
        state.torch_rng = torch.get_rng_state()
        state.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        state.py_rng = random.getstate()
        state.np_rng = np.random.get_state()
        state.env = {k: os.environ.get(k) for k in ("LD_PRELOAD", "LD_LIBRARY_PATH")}
        return state

    def restore(self) -> list[str]:
        """Put everything back; returns the names of what had changed."""
        # imported here: numpy's global generator is put back only when an engine started
        import numpy as np

        changed = []
        if torch.set_num_threads is not self.set_num_threads:
            torch.set_num_threads = self.set_num_threads
            changed.append("torch.set_num_threads")
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
            changed.append("torch.get_num_threads")
        if torch.get_default_dtype() != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)
            changed.append("torch default dtype")
        if torch.is_grad_enabled() != self.grad:
            torch.set_grad_enabled(self.grad)
            changed.append("grad mode")
        if not torch.equal(torch.get_rng_state(), self.torch_rng):
            torch.set_rng_state(self.torch_rng)
            changed.append("torch RNG")
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        if random.getstate() != self.py_rng:
            random.setstate(self.py_rng)
            changed.append("python RNG")
        current = np.random.get_state()
        if not (np.array_equal(current[1], self.np_rng[1]) and current[2:] == self.np_rng[2:]):
            np.random.set_state(self.np_rng)
            changed.append("numpy RNG")
        for key, value in self.env.items():
            if os.environ.get(key) != value:
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
                changed.append(key)
        return changed


# Engines built in this process and not yet closed. vLLM keeps one process-wide distributed
# state that shutting down any in-process engine destroys, so the last engine to close (or to be
# garbage-collected) shuts down every closed one (see VLLMRolloutEngine.close).
OPEN_ENGINES: weakref.WeakSet = weakref.WeakSet()
_CLOSED_LLMS: list = []


def release(llm, shutdown) -> None:
    """Queue ``llm`` for shutdown; shut every queued engine down once no engine is open."""
    _CLOSED_LLMS.append((llm, shutdown))
    if any(True for _ in OPEN_ENGINES):  # iterating skips engines already collected
        return
    while _CLOSED_LLMS:
        llm, shutdown = _CLOSED_LLMS.pop()
        with contextlib.suppress(Exception):
            (shutdown or llm.llm_engine.engine_core.shutdown)()
        del llm


class VLLMStartError(RuntimeError):
    """vLLM is installed but refused to start on this model (an attention configuration its
    backend does not support, an architecture it does not know, too little memory): the message
    is vLLM's last line. Callers name their own engine option and the hf engine as the way out."""


def _start_failure(exc: BaseException) -> str:
    """The most telling line of a vLLM start-up failure: the innermost cause's message (vLLM's
    engine-core wrappers say only "see the root cause above"), one line."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else 'no message'}"


@contextlib.contextmanager
def start_errors():
    """Any exception of vLLM's start-up (not a Ctrl-C) as a :class:`VLLMStartError`."""
    try:
        yield
    except Exception as exc:
        raise VLLMStartError(f"vLLM could not start on this model: {_start_failure(exc)}") from exc


def check_weight_names(
    weights: list[tuple[str, torch.Tensor]], expected: dict[str, tuple[int, ...]] | None, model_path: str
) -> None:
    """Before a weight push: every name in ``weights`` is a tensor of the engine's checkpoint
(``expected``, :func:`checkpoint_shapes`) with its shape, and none of them is missing."""
    if expected is None:  # no safetensors in the folder: vLLM's own loader checks the names
        return
    seen = set()
    for name, tensor in weights:
        if name not in expected:
            raise ValueError(
                f"sync_weights: {name!r} is not a parameter of the engine's model ({model_path}); "
                "sync a model of the same architecture (peft: LoRA adapters only, no modules_to_save)"
            )
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"sync_weights: {name!r} has shape {tuple(tensor.shape)}, the engine's model has "
                f"{expected[name]}"
            )
        seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(
            f"sync_weights: the model lacks {len(missing)} of the engine's weights (e.g. {missing[:3]}); "
            "every weight must be pushed"
        )


def weights_to_push(
    model: torch.nn.Module, expected: dict[str, tuple[int, ...]] | None, model_path: str, dtype: torch.dtype
) -> list[tuple[str, torch.Tensor]]:
    """``model``'s weights as an engine of ``model_path`` loads them: checkpoint names, LoRA
    merged (:func:`~policygrad.models.adapters.merged_weights`), cast to ``dtype``; names and
    shapes checked against ``expected`` (:func:`check_weight_names`). Call under ``no_grad``.

    Raises:
        ValueError: a name or shape the engine's model lacks, a missing weight, or an adapter that
            trains one of two weights the model ties (the engine loaded them as one).
    """
    weights = list(merged_weights(model))
    check_weight_names(weights, expected, model_path)
    differ = tied_pairs_that_differ(model, dict(weights))
    if differ:  # vLLM built the model tied: it would go on sampling with the other weight
        raise ValueError(
            f"the adapter trains {differ[0][0]} apart from {differ[0][1]}, which this model ties and "
            "vLLM loaded as one weight; use rollout.engine=hf, or export the merged model (its "
            "config is untied) and train from that folder"
        )
    return [(name, tensor.to(dtype)) for name, tensor in weights]


class WorkerWeightSync:
    """Mixed into vLLM's worker class (``worker_extension_cls``): a weight reload callable by name.

    ``collective_rpc`` decodes a tensor only where a type hint asks for one, so weights for a
    worker in another process travel as one ``torch.save`` byte string of ``[(name, tensor), ...]``.
    """

    def policygrad_reload_weights(self, payload: bytes) -> None:
        weights = torch.load(io.BytesIO(payload), weights_only=True)
        self.reload_weights(weights_iterator=iter(weights))
