"""Start-up quiet: third-party lines that say nothing to a user of policygrad, filtered by name.

The ``policygrad`` command applies every filter of :data:`FILTERS` before it imports torch,
transformers or vLLM (their settings are read at import); ``--verbose`` applies none, so
everything those libraries print comes through. A value the user set in the environment is
left alone. What policygrad itself says (its ``policygrad`` logger, its progress bar, errors)
is never filtered, nor is any error or exception of a library.
"""

from __future__ import annotations

import logging
import os
import warnings

__all__ = ["FILTERS", "apply", "is_quiet"]

# name -> (what it hides, how)
FILTERS: dict[str, tuple[str, str]] = {
    "vllm-warnings": (
        "vLLM's start-up WARNING lines about settings policygrad chose on purpose (eager mode, no "
        "chunked prefill, no Triton on CPU, libiomp not preloaded, the V1 model runner)",
        "VLLM_LOGGING_LEVEL=ERROR, and the 'vllm' loggers at ERROR (one warns at import, before "
        "vLLM reads the variable)",
    ),
    "torch-cpp-warnings": (
        "torch's C++ warnings printed as '[W... file.cpp:N] Warning: ...' (NUMA binding at vLLM's start)",
        "TORCH_CPP_LOG_LEVEL=ERROR",
    ),
    "progress-bars": (
        "the libraries' loading and saving bars (transformers' 'Loading weights' and 'Writing model "
        "shards', transformers' one-time 'Converting and de-quantizing GGUF tensors' of the bundled model, "
        "vLLM's 'Loading safetensors checkpoint shards'); policygrad's own bar stays",
        "HF_HUB_DISABLE_PROGRESS_BARS=1, disable=True for the GGUF conversion's bar, and vLLM's "
        "use_tqdm_on_load=False",
    ),
    "library-deprecations": (
        "FutureWarning and DeprecationWarning raised inside vllm, torch, transformers, peft, "
        "huggingface_hub and triton: notes for those libraries' own maintainers",
        "warnings.filterwarnings('ignore', category=..., module=...)",
    ),
}

_ENV = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}
_LIBRARIES = ("vllm", "torch", "transformers", "peft", "huggingface_hub", "triton")
# "1" while the filters apply, "0" under --verbose: read by the engines, inherited by the processes
# a run starts (a rollout server started by a verbose run is verbose too).
_QUIET = "POLICYGRAD_QUIET"


def apply(*, verbose: bool = False) -> list[str]:
    """Apply every filter of :data:`FILTERS` (none with ``verbose``, or in a process started by a
    verbose one); returns the names applied.

    Environment variables are set only where the user has not set them, so one set by hand wins.
    """
    if verbose or os.environ.get(_QUIET) == "0":
        os.environ[_QUIET] = "0"
        return []
    for key, value in _ENV.items():
        os.environ.setdefault(key, value)
    if os.environ["VLLM_LOGGING_LEVEL"] == _ENV["VLLM_LOGGING_LEVEL"]:
        logging.getLogger("vllm").setLevel(logging.ERROR)
    for library in _LIBRARIES:
        for category in (FutureWarning, DeprecationWarning):
            warnings.filterwarnings("ignore", category=category, module=rf"{library}(\..*)?$")
    os.environ[_QUIET] = "1"
    return list(FILTERS)


def is_quiet() -> bool:
    """Whether the filters apply in this process (the ``policygrad`` command without ``--verbose``,
    or a process it started)."""
    return os.environ.get(_QUIET) == "1"
