"""The sections that make and score a batch.

The base they stand on: :class:`ConfigError`, ``MIN_TEMPERATURE`` and the checks every section
validates with are in :mod:`policygrad.config.checks` (``ConfigError`` is importable from here
too); :func:`~policygrad.config.coerce.build_dataclass`, which builds a section (or the whole
tree) from a YAML mapping, in :mod:`policygrad.config.coerce`. The sections: the policy
(:class:`ModelConfig` with its :class:`LoraConfig`), the prompts (:class:`DataConfig`), sampling
(:class:`RolloutConfig`) and the environment (:class:`EnvConfig`); the rewards are in
:mod:`policygrad.config.rewards`.

The training sections and the algorithm presets are in :mod:`policygrad.config.training`;
the whole tree (``TrainConfig``) and its loading in :mod:`policygrad.config.train`, which
re-exports every public name here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from policygrad.config.checks import (
    MAX_ENV_RETRIES,
    MIN_TEMPERATURE,
    ConfigError,
    check_choice,
    check_positive,
    parse_cpus,
)
from policygrad.config.coerce import field_choices
from policygrad.specs import engines


@dataclass
class LoraConfig:
    """LoRA adapters (peft). ``rank: 0`` means a full fine-tune, and then the other options,
    which only shape adapters, must keep their defaults. ``dropout`` is in [0, 1)."""

    rank: int = 0
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"

    def validate(self, path: str) -> None:
        check_positive(f"{path}.rank", self.rank, allow_zero=True)
        check_positive(f"{path}.alpha", self.alpha)
        check_positive(f"{path}.dropout", self.dropout, allow_zero=True)
        if self.dropout >= 1:  # 1 would zero every adapter input: the adapters could not train
            raise ConfigError(
                f"{path}.dropout must be in [0, 1) (the probability of zeroing an adapter input), "
                f"got {self.dropout!r}"
            )
        if self.rank == 0:
            defaults = LoraConfig(rank=0)
            names = ("alpha", "dropout", "target_modules")
            changed = [n for n in names if getattr(self, n) != getattr(defaults, n)]
            if changed:
                name = f"{path}.{changed[0]}"
                raise ConfigError(
                    f"{name}={getattr(self, changed[0])!r} has no effect with {path}.rank=0 (a full "
                    f"fine-tune, no adapters); set {path}.rank >= 1 for LoRA or unset {name}"
                )


@dataclass
class ModelConfig:
    """The policy. ``name``: ``bundled:smollm2-135m-instruct``, a local HF folder, or a hub id.

    ``dtype``: ``auto`` picks float32 on CPU (bf16 matmul is several times slower on CPUs without
    AMX/AVX512-BF16) and bfloat16 on CUDA; ``float32`` / ``bfloat16`` force one. It is the dtype
    of the frozen networks (reward models, vLLM's weights); the trained ones, and the reference
    (a copy of the starting policy, computing as it does), follow ``precision``: ``fp32``,
    ``bf16-mixed`` (float32 parameters and optimizer state, bf16 compute under autocast),
    ``bf16-pure`` (bf16 parameters stepped by AdamW: small updates round away; an explicit
    opt-in), ``fp16-mixed`` (float32 parameters, fp16 compute under autocast, dynamic loss
    scaling; the ``optim/loss_scale`` metric; on CUDA the vLLM engine's ``rollout.dtype: auto``
    is then float16; Qi et al. 2025 trace much of the sampler/trainer mismatch to bf16 rounding)
    or ``auto`` (bf16-mixed on CUDA with bf16, on a CPU with AVX512-BF16 or AMX-BF16, or with
    ``dtype=bfloat16``; else fp32); see :mod:`policygrad.parallel.precision`.

    ``lm_head_dtype``: ``auto`` (or null, the default: the LM head computes as the body does) or
    ``float32``: under ``bf16-mixed`` / ``fp16-mixed`` the head's matmul, the logits and the
    log-probs run in float32 while the body runs under the autocast (ScaleRL's fp32 head, Khatri
    et al. 2025), for the trainer's forwards, the reference and the hf engine's sampling (vLLM
    keeps ``dtype``). Under ``fp32`` it is accepted and changes nothing (the head already is
    float32); ``bf16-pure`` (bf16 head weights) refuses it.

    ``trust_remote_code``: run the Python code a model folder or hub repository ships with its
    weights (transformers' ``trust_remote_code``). Off by default, and never asked interactively:
    a model that needs it is refused with an error naming this option.

    ``gradient_checkpointing``: ``auto`` (the default), ``true`` or ``false``. ``true``
    recomputes every decoder layer's forward in the backward (each layer keeps only its input:
    far less activation memory, about one extra forward, ~+30% step time); ``auto`` turns it on
    at the first policy update whose longest micro-batch would not fit without it (model states
    not yet allocated + that micro-batch's saved activations and logits over 90% of the free
    memory of the device: :func:`policygrad.parallel.footprint.resolve_gradient_checkpointing`), says so
    once with the numbers, and keeps it on; it never turns on where the activations fit.

    ``adapter``: a trained PEFT adapter folder to start from (``name`` is then its base model);
    ``name`` may also be an adapter folder itself (a LoRA run's ``checkpoints/step_N/model``),
    whose ``base_model_name_or_path`` is the base. The run trains that adapter, and the reference
    is the starting policy (base plus the starting adapter, frozen). See
    :mod:`policygrad.models.adapters`.
    """

    name: str = "bundled:smollm2-135m-instruct"
    dtype: str = "auto"
    precision: str = "auto"
    lm_head_dtype: str | None = "auto"
    lora: LoraConfig = field(default_factory=LoraConfig)
    gradient_checkpointing: bool | str = field(
        default="auto",
        metadata={"choices": "auto (recompute only when the activations would not fit), true or false"},
    )
    trust_remote_code: bool = False
    adapter: str | None = None

    def validate(self, path: str) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"{path}.name must be a model folder, hub id or bundled:NAME")
        check_choice(f"{path}.dtype", self.dtype, {"auto", "float32", "bfloat16"})
        check_choice(
            f"{path}.precision", self.precision, {"auto", "fp32", "bf16-mixed", "bf16-pure", "fp16-mixed"}
        )
        if self.lm_head_dtype is not None:
            check_choice(f"{path}.lm_head_dtype", self.lm_head_dtype, {"auto", "float32"})
        if self.lm_head_dtype == "float32" and self.precision == "bf16-pure":
            raise ConfigError(
                f"{path}.lm_head_dtype=float32 with {path}.precision=bf16-pure: the head's weights are "
                f"bfloat16 there; set {path}.precision=bf16-mixed or unset {path}.lm_head_dtype"
            )
        self.lora.validate(f"{path}.lora")
        if isinstance(self.gradient_checkpointing, str):
            self.gradient_checkpointing = self.gradient_checkpointing.strip().lower()
        if not (isinstance(self.gradient_checkpointing, bool) or self.gradient_checkpointing == "auto"):
            raise ConfigError(
                f"{path}.gradient_checkpointing={self.gradient_checkpointing!r} is not valid; choose "
                + field_choices(type(self), "gradient_checkpointing")
            )
        if self.adapter is not None and self.lora.rank > 0:
            raise ConfigError(
                f"{path}.adapter with {path}.lora.rank={self.lora.rank}: the run trains the adapter it "
                f"starts from (its own rank and targets); unset {path}.lora.rank"
            )


@dataclass
class DataConfig:
    """Training and held-out prompts.

    ``dataset``: ``builtin:arithmetic`` (procedurally generated, the default), a local file or
    folder (JSONL, JSON, Parquet, CSV, ``save_to_disk``; GSM8K's ``question``/``answer`` format
    works without a field mapping) or a Hugging Face Hub dataset id such as ``openai/gsm8k``
    (``datasets.load_dataset`` with ``dataset_config`` and ``split``; from the local cache when
    ``HF_DATASETS_OFFLINE``/``HF_HUB_OFFLINE`` is set, see :mod:`policygrad.data.hub`).
    ``split`` / ``eval_split`` choose a split of a dataset folder or a Hub dataset and
    ``dataset_config`` a Hub dataset's configuration; set (off their defaults) for a dataset they
    choose nothing in (a single file, a built-in task), they are refused when the run reads its
    data. ``prompt_field`` and ``answer_field`` map other formats. ``eval_dataset``: a path or Hub id;
    empty means the built-in task's held-out split, or a Hub dataset's ``eval_split``.
    ``eval_size``: held-out problems per evaluation. ``chat_template``: a Jinja chat template (the
    text, or the path of a file holding it) used instead of the tokenizer's, for every prompt.
    """

    dataset: str = "builtin:arithmetic"
    difficulty: str = "medium"
    prompt_field: str | None = None
    answer_field: str | None = None
    system_prompt: str | None = None
    use_chat_template: bool = True
    max_prompt_length: int = 512
    eval_dataset: str | None = None
    eval_size: int = 200
    shuffle: bool = True
    dataset_config: str | None = None
    split: str = "train"
    eval_split: str = "test"
    chat_template: str | None = None

    def validate(self, path: str) -> None:
        check_positive(f"{path}.max_prompt_length", self.max_prompt_length)
        check_positive(f"{path}.eval_size", self.eval_size, allow_zero=True)
        for name in ("split", "eval_split"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ConfigError(f"{path}.{name} must name a split, e.g. train or test")


# Rollout options that only multi-turn episodes read.
EPISODE_OPTIONS = (
    "max_turns",
    "max_episode_tokens",
    "max_observation_tokens",
    "env_step_timeout_s",
    "env_workers",
    "env_error_budget",
    "env_retries",
    "env_isolation",
)


@dataclass
class EnvConfig:
    """A multi-turn environment (:mod:`policygrad.envs`); without one, a run is single-turn.

    ``name``: ``builtin:guess``, ``builtin:calculator``, ``builtin:code_feedback``,
    ``package.module:Class`` or ``path/to/file.py:Class`` (an
    :class:`~policygrad.envs.Environment`; an object given to ``policygrad.train(env=...)`` is
    recorded by import path). ``options``: keyword arguments of the class. The episode limits are
    in ``rollout`` (``max_turns`` ...).
    """

    name: str | None = None
    options: dict = field(default_factory=dict)

    def validate(self, path: str) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise ConfigError(f"{path}.name must name an environment (e.g. builtin:guess) or be null")
        if not isinstance(self.options, dict):
            raise ConfigError(f"{path}.options must be a mapping of keyword arguments, got {self.options!r}")
        if self.options and self.name is None:
            raise ConfigError(f"{path}.options is set but {path}.name is null; name the environment")


@dataclass
class RolloutConfig:
    """Sampling. B = ``prompts_per_step`` x ``group_size`` sequences per step.

    ``top_k: 0`` and ``top_p: 1.0`` sample the full softmax at ``temperature``; training
    log-probs always use the same temperature and truncation as the sampler.

    ``engine``: ``hf`` (transformers ``generate`` on the live policy), ``vllm`` (a vLLM engine
    in the same process, weights pushed to it after every update), ``server`` (vLLM servers apart
    from the trainer, weights pushed to them over gloo after every update:
    :mod:`policygrad.rollout.server`) or ``auto`` (``vllm`` when the ``vllm`` package is
    installed, else ``hf``; the choice is printed at start).

    ``servers`` (with ``engine: server``): a list of base URLs of running servers
    (``policygrad serve``), or a count of servers the run starts itself and stops at its end,
    each on the CPUs of ``server_cpus`` (one list per server, e.g. ``["1"]`` or ``["2-3"]``;
    null: every CPU) or the GPU of ``server_gpus`` (one id per server); their logs go to
    ``<output_dir>/servers/``. ``server_timeout_s``: the most seconds a server may take to start,
    answer a request or take a weight push before it is named and set aside. ``dtype``: the
    vLLM engine's weights and compute (``auto`` = the policy's); ``bfloat16`` on an fp32 policy
    is a faster but mismatched sampler. ``vllm_kv_cache_gb`` (CPU) / ``vllm_gpu_memory_utilization``
    (GPU): the engine's KV-cache budget. ``vllm_prefix_caching``: reuse the prompt's KV across the
    G samples (the cache is reset after every weight push).

    ``is_correction``: truncated importance sampling against the train/inference mismatch (Yao et
    al. 2025, truncated importance sampling) and the lag of rollouts sampled ahead: ``none``,
    ``token`` or ``sequence`` weights ``pi_trainer / pi_sampler``, capped at ``is_cap``;
    ``is_mode: truncate`` clips the weight at the cap, ``mask`` drops the tokens (token) or
    sequences (sequence) above it; ``is_floor`` (null: none) also drops those whose weight is
    below it (IcePop's two-sided mask). The policy loss of every token is multiplied by its
    weight. ``auto`` (the default): ``token`` when ``max_staleness`` > 0, else ``none``.

    ``max_staleness`` (k, default 0): rollouts run ahead of training with a fixed lag: the batch
    trained at step m is sampled with the weights after update max(0, m - k), in a background
    thread (``async_executor: thread``; ``inline`` runs each job in the trainer's thread, the
    same numbers without overlap) while the policy trains. A stale batch's old log-probs are
    recomputed at the start of its step (the proximal policy) and the sampler's stay the
    behaviour policy of the importance weights (AReaL's decoupled objective); ``is_correction:
    none`` with k > 0 is accepted with a warning. 0 builds no pipeline (the synchronous step).
    Needs an engine with its own weights (vllm; the hf engine samples from a copy of the policy).

    ``per_prompt_seeds`` (true): each prompt samples from its own seed (run seed, step, global
    position), so its samples do not depend on the batch or rank it is in and one process trains
    on what N processes do. ``false`` (torch's global stream) only continues a run recorded with
    it; a new run refuses it.

    ``ignore_eos``: every response runs to exactly ``max_new_tokens`` tokens, an end-of-sequence
    id sampled along the way kept as an ordinary token (vLLM's ``ignore_eos``); no response
    counts as truncated. For measuring equal work (benchmarks), not for training a model to stop.

    With an environment (``env.name``; :mod:`policygrad.envs.episodes`): ``max_new_tokens`` is
    per turn; ``max_turns`` the most policy turns of an episode (reaching it is not a
    truncation); ``max_episode_tokens`` the most tokens after the prompt, actions and
    observations (null: only the model's context); ``max_observation_tokens`` the most tokens of
    one observation message's content (longer ones keep head and tail; null: no cut);
    ``env_step_timeout_s`` the most seconds of one environment call (an episode over it fails;
    null: no limit; kept by the trainer, a worker over it is killed); ``env_isolation`` (true)
    runs the environments in ``env_workers`` worker processes, so ``os._exit``, a crash, a signal,
    ``chdir`` or a fork in them fails episodes, never the run (false: threads of the trainer's
    process, for trusted environments; see :mod:`policygrad.envs.workers`); ``env_workers``
    environment calls run at once; ``env_retries`` (1) fresh attempts of an episode that failed
    in the environment (raised, timed out, its worker died), from scratch with the same reset
    seed and turns sampled again from seeds derived from the attempt, before it counts as
    failed; a group with an episode still failed leaves the batch whole (``env/groups_dropped``);
    ``env_retries`` is at most 10; ``env_error_budget`` the largest fraction of a step's episodes
    that may fail (they carry no loss) before the run stops. These options need ``env.name``."""

    engine: str = "auto"
    per_prompt_seeds: bool = True
    ignore_eos: bool = False
    prompts_per_step: int = 4
    group_size: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    dtype: str = "auto"
    vllm_kv_cache_gb: float = 1.0
    vllm_gpu_memory_utilization: float = 0.3
    vllm_prefix_caching: bool = True
    servers: list[str] | int | None = None
    server_cpus: list[str] | None = None
    server_gpus: list[str] | None = None
    server_timeout_s: float = 300.0
    is_correction: str = "auto"
    is_cap: float = 2.0
    is_mode: str = "truncate"
    is_floor: float | None = None
    max_staleness: int = 0
    async_executor: str = "thread"
    max_turns: int = 4
    max_episode_tokens: int | None = None
    max_observation_tokens: int | None = None
    env_step_timeout_s: float | None = 60.0
    env_workers: int = 4
    env_error_budget: float = 0.25
    env_retries: int = 1
    env_isolation: bool = True

    def validate(self, path: str) -> None:
        check_choice(f"{path}.engine", self.engine, {"auto", "hf", "vllm", "server"})
        self._check_servers(path)
        check_positive(f"{path}.max_turns", self.max_turns)
        for name in ("max_episode_tokens", "max_observation_tokens", "env_step_timeout_s"):
            if getattr(self, name) is not None:
                check_positive(f"{path}.{name}", getattr(self, name))
        check_positive(f"{path}.env_workers", self.env_workers)
        retries = self.env_retries
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_ENV_RETRIES:
            # bounded: an environment that always fails is retried this many times per episode
            # and step, so a huge value is a run that never finishes a step (and a stop signal
            # waits for the step)
            raise ConfigError(
                f"{path}.env_retries must be an int in [0, {MAX_ENV_RETRIES}], got {self.env_retries!r}"
            )
        if not isinstance(self.env_isolation, bool):
            raise ConfigError(f"{path}.env_isolation must be true or false, got {self.env_isolation!r}")
        if not 0.0 <= self.env_error_budget <= 1.0:
            raise ConfigError(f"{path}.env_error_budget must be in [0, 1], got {self.env_error_budget!r}")
        check_positive(f"{path}.prompts_per_step", self.prompts_per_step)
        check_positive(f"{path}.group_size", self.group_size)
        check_positive(f"{path}.temperature", self.temperature)
        if self.temperature < MIN_TEMPERATURE:
            raise ConfigError(
                f"{path}.temperature={self.temperature!r} is below {MIN_TEMPERATURE}: logits / temperature "
                "overflows float32 (or keeps no precision in the log-probs the update needs); use "
                f"{path}.temperature >= {MIN_TEMPERATURE} (0.1 samples almost greedily)"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"{path}.top_p must be in (0, 1], got {self.top_p!r}")
        check_positive(f"{path}.top_k", self.top_k, allow_zero=True)
        check_positive(f"{path}.max_new_tokens", self.max_new_tokens)
        check_choice(f"{path}.dtype", self.dtype, {"auto", "float32", "bfloat16", "float16"})
        check_positive(f"{path}.vllm_kv_cache_gb", self.vllm_kv_cache_gb)
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ConfigError(
                f"{path}.vllm_gpu_memory_utilization must be in (0, 1], "
                f"got {self.vllm_gpu_memory_utilization!r}"
            )
        check_choice(f"{path}.is_correction", self.is_correction, {"auto", "none", "token", "sequence"})
        check_positive(f"{path}.is_cap", self.is_cap)
        check_choice(f"{path}.is_mode", self.is_mode, {"truncate", "mask"})
        if self.is_floor is not None and not 0 < self.is_floor < self.is_cap:
            raise ConfigError(
                f"{path}.is_floor must be in (0, {path}.is_cap={self.is_cap}), got {self.is_floor!r} "
                "(IcePop uses 0.5 with a cap of 2)"
            )
        check_positive(f"{path}.max_staleness", self.max_staleness, allow_zero=True)
        check_choice(f"{path}.async_executor", self.async_executor, {"thread", "inline"})
        if self.max_staleness and not self.per_prompt_seeds:
            raise ConfigError(
                f"{path}.max_staleness={self.max_staleness} needs per-prompt seeds (a batch sampled ahead "
                f"must not depend on when it runs); drop {path}.per_prompt_seeds=false"
            )

    def _check_servers(self, path: str) -> None:
        timeout = self.server_timeout_s
        if not (isinstance(timeout, (int, float)) and 0 < timeout <= MAX_SERVER_TIMEOUT_S):
            # NaN or infinity would never time out (or overflow a timedelta): bounded
            raise ConfigError(
                f"{path}.server_timeout_s must be a number of seconds in (0, {MAX_SERVER_TIMEOUT_S}], "
                f"got {timeout!r}"
            )
        if isinstance(self.servers, bool):
            raise ConfigError(f"{path}.servers must be a list of URLs or a count, got {self.servers!r}")
        if self.engine != "server":
            for name in ("servers", "server_cpus", "server_gpus"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"{path}.{name} is for {path}.engine=server, which this run does not use"
                    )
        elif self.servers is None:
            raise ConfigError(
                f"{path}.engine=server needs {path}.servers: a list of server URLs (policygrad serve) "
                "or how many servers the run starts, e.g. --rollout.servers=1"
            )
        elif isinstance(self.servers, int):
            _check_started_servers(path, self.servers, self.server_cpus, self.server_gpus)
        else:
            _check_server_urls(path, self.servers, self.server_cpus, self.server_gpus)

    def resolved_is_correction(self) -> str:
        """``is_correction`` with ``auto`` resolved: ``token`` when rollouts run ahead, else ``none``."""
        if self.is_correction != "auto":
            return self.is_correction
        return "token" if self.max_staleness > 0 else "none"

    def resolved_engine(self) -> tuple[str, str]:
        """``(engine, why)``: ``auto`` becomes ``vllm`` when the vllm package is installed *and*
        imports (an install built for another torch does not), else ``hf``; ``why`` says which."""
        if self.engine != "auto":
            return self.engine, "configured"
        if not engines.vllm_available():
            return "hf", "auto: vllm not installed"
        try:
            import vllm  # noqa: F401
        except Exception as e:  # any import failure means: not usable here
            return "hf", f"auto: vllm is installed but does not import ({type(e).__name__}: {e})"
        return "vllm", "auto: vllm installed"


# The most seconds rollout.server_timeout_s may be: a day (a bound, so no call waits forever).
MAX_SERVER_TIMEOUT_S = 86400.0


def _check_started_servers(path: str, count: int, cpus, gpus) -> None:
    """``rollout.servers`` as a count, and where those servers run."""
    if count < 1:
        raise ConfigError(f"{path}.servers must be >= 1 (servers the run starts), got {count}")
    if cpus is not None and gpus is not None:
        raise ConfigError(f"give {path}.server_cpus or {path}.server_gpus, not both")
    for name, value in (("server_cpus", cpus), ("server_gpus", gpus)):
        if value is not None and len(value) != count:
            raise ConfigError(
                f"{path}.{name} has {len(value)} entries for {count} servers; give one per server"
            )
    for spec in cpus or []:
        parse_cpus(f"{path}.server_cpus", spec)
    if gpus is not None and len({str(g) for g in gpus}) != len(gpus):
        raise ConfigError(f"{path}.server_gpus names a GPU twice ({gpus}); give each server its own GPU")


def _check_server_urls(path: str, urls: list[str], cpus, gpus) -> None:
    """``rollout.servers`` as URLs: servers that run where they were started."""
    if not urls:
        raise ConfigError(f"{path}.servers is an empty list; give server URLs or a count")
    seen = set()
    for url in urls:
        match = re.fullmatch(r"(https?)://([^/:\s]+):(\d+)/?", str(url))
        if not match:
            raise ConfigError(f"{path}.servers: {url!r} is not a URL like http://host:8000")
        host = match.group(2).lower()
        host = "127.0.0.1" if host == "localhost" else host
        if (host, int(match.group(3))) in seen:
            raise ConfigError(f"{path}.servers names {url!r} twice; list each server once")
        seen.add((host, int(match.group(3))))
    for name, value in (("server_cpus", cpus), ("server_gpus", gpus)):
        if value is not None:
            raise ConfigError(
                f"{path}.{name} places servers the run starts ({path}.servers as a count); servers at "
                "URLs run where they were started"
            )


def check_episode_options(config) -> None:
    """The checks that tie ``env.name`` to the other sections of ``config`` (a ``TrainConfig``
    whose sections and estimator are valid): without an environment the episode options keep
    their defaults and some reward function scores; with one no option that would never end a
    turn, and no advantage estimator that needs inputs episodes lack (ReMax's greedy baseline).

    Raises:
        ConfigError: naming the option and the fix.
    """
    rollout = config.rollout
    if not config.env.name:
        if not config.reward.functions:
            raise ConfigError("reward.functions is empty; give at least one reward function")
        defaults = RolloutConfig()
        for name in EPISODE_OPTIONS:
            if getattr(rollout, name) != getattr(defaults, name):
                raise ConfigError(
                    f"rollout.{name} applies to multi-turn episodes only; set env.name (an environment) or "
                    f"agent.function (an agent), or leave rollout.{name} at its default"
                )
        return
    if rollout.ignore_eos:
        raise ConfigError(
            "rollout.ignore_eos with env.name would never end a turn; set rollout.ignore_eos=false"
        )
    spec = config.estimator_spec
    if spec.inputs:
        raise ConfigError(
            f"advantage estimator {spec.name!r} needs {', '.join(spec.inputs)}, which "
            "multi-turn episodes do not provide; use grpo, rloo, reinforce, reinforce_pp or gae"
        )
