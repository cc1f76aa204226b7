"""The typed configuration tree of a training run.

One dataclass per pipeline stage; a YAML file and ``--key=value`` overrides map onto the tree one
to one (``--kl.beta=0.04`` sets ``TrainConfig.kl.beta``). Every field is validated when the tree
is built, and every error names the field and says how to fix it.

Algorithms are *presets*, not code paths: ``ALGORITHMS[name]`` says which registered advantage
estimator, which estimator options, which policy loss and which loss aggregation the algorithm
uses. What a choice needs comes from ``policygrad.core``'s registries, never from its name: the
estimator's :class:`~policygrad.core.advantages.EstimatorSpec` (values, trainer-supplied inputs,
minimum group size), the policy loss's declared options and the KL placement's
:class:`~policygrad.core.kl.KLPlacement`. So an algorithm added here needs no change in the
training loop, and every option is checked against the registries when the tree is built,
before any model loads.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from policygrad.core.advantages import (
    EstimatorSpec,
    check_estimator_options,
    estimator_spec,
    list_advantage_estimators,
)
from policygrad.core.kl import KL_KINDS, KL_PLACEMENTS, KLPlacement, get_kl_placement
from policygrad.core.losses import check_policy_loss_options, list_policy_losses, policy_loss_options
from policygrad.core.masking import AGGREGATION_MODES


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range. The message names the field."""


@dataclass(frozen=True)
class AlgorithmPreset:
    """What an algorithm name means: estimator, its options, loss and aggregation.

    What the estimator needs (a critic's values, inputs such as ReMax's greedy-baseline
    rewards, a minimum group size) is not part of the preset: the estimator declares it in the
    registry (``TrainConfig.estimator_spec``).

    Fields:
        estimator: name registered with ``core.advantages.register_advantage_estimator``.
        estimator_options: keyword options passed to the estimator.
        policy_loss: name registered with ``core.losses.register_policy_loss``.
        loss_agg_mode: one of ``core.masking.AGGREGATION_MODES``.
        reference: the paper the preset follows.
        critic: the algorithm trains a value model; the trainer builds one and passes its
            values V(s_t) to the estimator (``critic.enabled`` overrides).
        whiten_advantages: whiten the advantages over the batch's valid tokens by default
            (``advantage.whiten`` overrides).
    """

    estimator: str
    estimator_options: dict[str, Any]
    policy_loss: str
    loss_agg_mode: str
    reference: str
    critic: bool = False
    whiten_advantages: bool = False


ALGORITHMS: dict[str, AlgorithmPreset] = {
    "reinforce": AlgorithmPreset("reinforce", {"baseline": 0.0}, "ppo", "token-mean", "Williams 1992"),
    "rloo": AlgorithmPreset("rloo", {}, "ppo", "token-mean", "Kool et al. 2019; Ahmadian et al. 2024"),
    "remax": AlgorithmPreset("remax", {}, "ppo", "token-mean", "Li et al. 2023"),
    "grpo": AlgorithmPreset("grpo", {"scale": "group"}, "ppo", "seq-mean-token-mean", "Shao et al. 2024"),
    "dr_grpo": AlgorithmPreset(
        "grpo", {"scale": "none"}, "ppo", "seq-mean-token-sum-norm", "Liu et al. 2025"
    ),
    "reinforce_pp": AlgorithmPreset("reinforce_pp", {}, "ppo", "token-mean", "Hu 2025 (REINFORCE++)"),
    "ppo": AlgorithmPreset(
        "gae",
        {"gamma": 1.0, "lam": 0.95},
        "ppo",
        "token-mean",
        "Schulman et al. 2017; Ouyang et al. 2022; Huang et al. 2024 (N+)",
        critic=True,
        whiten_advantages=True,
    ),
}


# The smallest sampling temperature: below it the tempered logits of a float32 model overflow or
# the log-probs of every token but the top one are -1e30-like numbers with no usable precision.
MIN_TEMPERATURE = 1e-3


def _check_choice(path: str, value: Any, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{path}={value!r} is not valid; choose one of {sorted(choices)}")


def _check_positive(path: str, value, *, allow_zero: bool = False, why: str = "") -> None:
    """``why``: appended to the message (what the field means, what a bad value would do)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(f"{path} must be {bound}, got {value!r}{why}")


@dataclass
class LoraConfig:
    """LoRA adapters (peft). ``rank: 0`` means a full fine-tune, and then the other options,
    which only shape adapters, must keep their defaults. ``dropout`` is in [0, 1)."""

    rank: int = 0
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"

    def validate(self, path: str) -> None:
        _check_positive(f"{path}.rank", self.rank, allow_zero=True)
        _check_positive(f"{path}.alpha", self.alpha)
        _check_positive(f"{path}.dropout", self.dropout, allow_zero=True)
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
    opt-in) or ``auto`` (bf16-mixed on CUDA with bf16 or with ``dtype=bfloat16``, else
    fp32); see :mod:`policygrad.trainer.precision`.

    ``trust_remote_code``: run the Python code a model folder or hub repository ships with its
    weights (transformers' ``trust_remote_code``). Off by default, and never asked interactively:
    a model that needs it is refused with an error naming this option.

    ``adapter``: a trained PEFT adapter folder to start from (``name`` is then its base model);
    ``name`` may also be an adapter folder itself (a LoRA run's ``checkpoints/step_N/model``),
    whose ``base_model_name_or_path`` is the base. The run trains that adapter, and the reference
    is the starting policy (base plus the starting adapter, frozen). See
    :mod:`policygrad.models.adapters`.
    """

    name: str = "bundled:smollm2-135m-instruct"
    dtype: str = "auto"
    precision: str = "auto"
    lora: LoraConfig = field(default_factory=LoraConfig)
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    adapter: str | None = None

    def validate(self, path: str) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"{path}.name must be a model folder, hub id or bundled:NAME")
        _check_choice(f"{path}.dtype", self.dtype, {"auto", "float32", "bfloat16"})
        _check_choice(f"{path}.precision", self.precision, {"auto", "fp32", "bf16-mixed", "bf16-pure"})
        self.lora.validate(f"{path}.lora")
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
    ``prompt_field`` and ``answer_field`` map other formats. ``eval_dataset``: a path or Hub id;
    empty means the built-in task's held-out split, or a Hub dataset's ``eval_split``.
    ``eval_size``: held-out problems per evaluation.
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

    def validate(self, path: str) -> None:
        _check_positive(f"{path}.max_prompt_length", self.max_prompt_length)
        _check_positive(f"{path}.eval_size", self.eval_size, allow_zero=True)
        for name in ("split", "eval_split"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ConfigError(f"{path}.{name} must name a split, e.g. train or test")


@dataclass
class RolloutConfig:
    """Sampling. B = ``prompts_per_step`` x ``group_size`` sequences per step.

    ``top_k: 0`` and ``top_p: 1.0`` sample the full softmax at ``temperature``; training
    log-probs always use the same temperature and truncation as the sampler.

    ``engine``: ``hf`` (transformers ``generate`` on the live policy), ``vllm`` (a vLLM engine
    in the same process, weights pushed to it after every update) or ``auto`` (``vllm`` when the
    ``vllm`` package is installed, else ``hf``; the choice is printed at start). ``dtype``: the
    vLLM engine's weights and compute (``auto`` = the policy's); ``bfloat16`` on an fp32 policy
    is a faster but mismatched sampler. ``vllm_kv_cache_gb`` (CPU) / ``vllm_gpu_memory_utilization``
    (GPU): the engine's KV-cache budget. ``vllm_prefix_caching``: reuse the prompt's KV across the
    G samples (the cache is reset after every weight push).

    ``is_correction``: truncated importance sampling against the train/inference mismatch (Yao et
    al. 2025, truncated importance sampling): ``none``, ``token`` or ``sequence`` weights
    ``pi_trainer / pi_sampler``, capped at ``is_cap``; ``is_mode: truncate`` clips the weight at
    the cap, ``mask`` drops the tokens (token) or sequences (sequence) above it. The policy loss
    of every token is multiplied by its weight.

    ``per_prompt_seeds``: each prompt samples from its own seed (run seed, step, global position),
    so its samples do not depend on the batch or rank it is in; always on with more than one
    process. Off (the default) in one process keeps the earlier sampling stream.

    ``ignore_eos``: every response runs to exactly ``max_new_tokens`` tokens, an end-of-sequence
    id sampled along the way kept as an ordinary token (vLLM's ``ignore_eos``); no response
    counts as truncated. For measuring equal work (benchmarks), not for training a model to stop."""

    engine: str = "auto"
    per_prompt_seeds: bool = False
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
    is_correction: str = "none"
    is_cap: float = 2.0
    is_mode: str = "truncate"

    def validate(self, path: str) -> None:
        _check_choice(f"{path}.engine", self.engine, {"auto", "hf", "vllm"})
        _check_positive(f"{path}.prompts_per_step", self.prompts_per_step)
        _check_positive(f"{path}.group_size", self.group_size)
        _check_positive(f"{path}.temperature", self.temperature)
        if self.temperature < MIN_TEMPERATURE:
            raise ConfigError(
                f"{path}.temperature={self.temperature!r} is below {MIN_TEMPERATURE}: logits / temperature "
                "overflows float32 (or keeps no precision in the log-probs the update needs); use "
                f"{path}.temperature >= {MIN_TEMPERATURE} (0.1 samples almost greedily)"
            )
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"{path}.top_p must be in (0, 1], got {self.top_p!r}")
        _check_positive(f"{path}.top_k", self.top_k, allow_zero=True)
        _check_positive(f"{path}.max_new_tokens", self.max_new_tokens)
        _check_choice(f"{path}.dtype", self.dtype, {"auto", "float32", "bfloat16", "float16"})
        _check_positive(f"{path}.vllm_kv_cache_gb", self.vllm_kv_cache_gb)
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ConfigError(
                f"{path}.vllm_gpu_memory_utilization must be in (0, 1], "
                f"got {self.vllm_gpu_memory_utilization!r}"
            )
        _check_choice(f"{path}.is_correction", self.is_correction, {"none", "token", "sequence"})
        _check_positive(f"{path}.is_cap", self.is_cap)
        _check_choice(f"{path}.is_mode", self.is_mode, {"truncate", "mask"})

    def resolved_engine(self) -> tuple[str, str]:
        """``(engine, why)``: ``auto`` becomes ``vllm`` when the vllm package is installed *and*
        imports (an install built for another torch does not), else ``hf``; ``why`` says which."""
        if self.engine != "auto":
            return self.engine, "configured"
        from policygrad.rollout.vllm import vllm_available

        if not vllm_available():
            return "hf", "auto: vllm not installed"
        try:
            import vllm  # noqa: F401
        except Exception as e:  # any import failure means: not usable here
            return "hf", f"auto: vllm is installed but does not import ({type(e).__name__}: {e})"
        return "vllm", "auto: vllm installed"


@dataclass
class CodeRewardConfig:
    """The sandbox of the ``code_tests`` reward (and of evaluation on code rows); see
    :mod:`policygrad.rewards.sandbox` for what each isolation mode isolates and the threat model.

    ``isolation``: ``auto`` (bubblewrap if installed, else Linux namespaces; the run refuses to
    start when neither works), ``bwrap``, ``namespaces`` or ``none`` (separate processes with
    resource limits only: unsafe, with a warning). ``partial``: score the fraction of passing
    tests instead of 1/0. Per program: ``timeout_s`` wall (and CPU) seconds, ``memory_mb`` per
    process, ``max_processes``, ``max_write_mb`` written, ``max_output_kb`` of output read (the
    rest is discarded). ``workers``: programs tested at once (0: twice the CPU count, at most 16)."""

    isolation: str = "auto"
    partial: bool = False
    timeout_s: float = 10.0
    memory_mb: int = 1024
    max_processes: int = 64
    max_write_mb: int = 256
    max_output_kb: int = 1024
    workers: int = 0

    def validate(self, path: str) -> None:
        _check_choice(f"{path}.isolation", self.isolation, {"auto", "bwrap", "namespaces", "none"})
        _check_positive(f"{path}.timeout_s", self.timeout_s)
        if self.memory_mb < 64:
            raise ConfigError(
                f"{path}.memory_mb must be >= 64 (an interpreter needs it), got {self.memory_mb}"
            )
        for name in ("max_processes", "max_write_mb", "max_output_kb"):
            _check_positive(f"{path}.{name}", getattr(self, name))
        _check_positive(f"{path}.workers", self.workers, allow_zero=True)


@dataclass
class RewardConfig:
    """Reward functions, summed with weights.

    ``functions``: built-in names (``answer_correctness``, ``answer_format``, ``length_penalty``,
    ``code_tests``: the row's tests run against the completion's program in the sandbox that
    ``code`` configures, :class:`CodeRewardConfig`), ``module:function`` or ``path.py:function``.
    ``weights``: one per function (default 1 each).
    ``on_error``: ``raise`` stops the run naming the row and the function; ``skip`` excludes the
    row from the loss and counts it in ``reward/invalid_frac``. ``truncation``: what a completion
    without EOS gets: ``none`` (scored as is), ``penalty`` (the N+ EOS trick: the score is
    replaced by ``truncation_penalty``) or ``exclude`` (no loss on it).

    A learned reward model is an entry ``reward_model:/path/to/folder`` (a local
    ``AutoModelForSequenceClassification`` with one label, read at the last real token; see
    ``policygrad.rewards.reward_model``), batched by ``model_batch_size``, at most
    ``model_max_length`` tokens per row, in its chat template when ``model_chat_template``.

    ``normalize`` (applied to the summed score before the truncation penalty): ``none``;
    ``fixed_offset`` (subtract the mean score of the first batch, samples of the initial policy,
    so they average 0: N+ detail 15); ``running`` (running mean/std, "Secrets of RLHF"), clamped
    to +-``normalize_clip`` when set. ``whiten``: whiten the per-token rewards (score plus KL
    penalty) over the batch's valid tokens, scale only (N+ reward whitening).

    ``isolation`` (default on): reward functions given as ``module:function`` or
    ``file.py:function``, and callables given as objects that can be pickled, run in a worker
    process (``policygrad.rewards.isolation``), on copies of the completions and row fields;
    ``sys.exit``, ``os._exit``, ``os.chdir`` or a crash there cannot stop or disturb the run,
    they make the call an error that ``on_error`` handles. A callable that cannot be pickled (a
    lambda, a closure, a function of ``__main__``) runs in the trainer's process on copies, with
    ``sys.exit`` and ``timeout_s`` contained but not ``os._exit`` (logged when the run starts);
    so does every function with ``isolation: false``. ``timeout_s``: the most seconds one call
    of a user function may take (``null``: no limit); a call over it is an error for its whole
    batch (in the worker it is stopped; in the trainer's process it goes on in a thread, which
    cannot be stopped). Built-in rewards and reward models are the library's code and run in the
    trainer's process.
    """

    functions: list[str] = field(default_factory=lambda: ["answer_correctness"])
    weights: list[float] | None = None
    on_error: str = "raise"
    truncation: str = "none"
    truncation_penalty: float = -1.0
    normalize: str = "none"
    normalize_clip: float | None = None
    whiten: bool = False
    model_batch_size: int = 16
    model_max_length: int = 1024
    model_chat_template: bool = True
    isolation: bool = True
    timeout_s: float | None = 300.0
    code: CodeRewardConfig = field(default_factory=CodeRewardConfig)

    def validate(self, path: str) -> None:
        self.code.validate(f"{path}.code")
        if self.timeout_s is not None:
            _check_positive(f"{path}.timeout_s", self.timeout_s)
        if not self.functions:
            raise ConfigError(f"{path}.functions is empty; give at least one reward function")
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ConfigError(
                f"{path}.weights has {len(self.weights)} entries for {len(self.functions)} functions; "
                "give one weight per function or leave it unset"
            )
        _check_choice(f"{path}.on_error", self.on_error, {"raise", "skip"})
        _check_choice(f"{path}.truncation", self.truncation, {"none", "penalty", "exclude"})
        _check_choice(f"{path}.normalize", self.normalize, {"none", "fixed_offset", "running"})
        if self.normalize_clip is not None:
            _check_positive(f"{path}.normalize_clip", self.normalize_clip)
        _check_positive(f"{path}.model_batch_size", self.model_batch_size)
        if self.model_max_length < 2:
            raise ConfigError(f"{path}.model_max_length must be >= 2, got {self.model_max_length}")


@dataclass
class KLConfig:
    """KL to the reference model.

    ``placement``: a registered :class:`~policygrad.core.kl.KLPlacement` (``KL_PLACEMENTS``):
    ``none`` (no reference model is loaded), ``reward`` (per-token -beta * KL in the reward,
    PPO-RLHF style) or ``loss`` (a KL term added to the loss, GRPO style). ``kind``: the
    estimator k1/k2/k3; ``None`` means the placement's default (k1 in the reward, k3 in the
    loss). ``controller``: ``fixed`` or ``adaptive`` (Ziegler et al. 2019 with ``target`` and ``horizon``).
    ``importance_weighted``: in the loss, multiply the KL term by pi/pi_old (DeepSeek-V3.2).
    """

    placement: str = "none"
    kind: str | None = None
    beta: float = 0.0
    controller: str = "fixed"
    target: float = 6.0
    horizon: float = 10000.0
    importance_weighted: bool = False

    def validate(self, path: str) -> None:
        _check_choice(f"{path}.placement", self.placement, set(KL_PLACEMENTS))
        if self.kind is not None:
            _check_choice(f"{path}.kind", self.kind, set(KL_KINDS))
        _check_positive(f"{path}.beta", self.beta, allow_zero=True)
        _check_choice(f"{path}.controller", self.controller, {"fixed", "adaptive"})
        _check_positive(f"{path}.target", self.target)
        _check_positive(f"{path}.horizon", self.horizon)
        if self.controller == "adaptive" and not get_kl_placement(self.placement).needs_reference:
            raise ConfigError(
                f"{path}.controller=adaptive with {path}.placement={self.placement!r}: there is no KL for "
                f"the controller to steer; set {path}.placement=reward or loss (with {path}.beta), or "
                f"{path}.controller=fixed"
            )
        if get_kl_placement(self.placement).needs_reference and self.beta == 0 and self.controller == "fixed":
            raise ConfigError(
                f"{path}.placement={self.placement!r} with {path}.beta=0 computes a KL that has no "
                f"effect; set {path}.beta > 0 or {path}.placement=none"
            )

    def resolved_kind(self) -> str:
        """``kind``, or the placement's ``default_kind`` when it is null."""
        if self.kind is not None:
            return self.kind
        return get_kl_placement(self.placement).default_kind


@dataclass
class AdvantageConfig:
    """Overrides of the algorithm preset's estimator. ``estimator: null`` keeps the preset's;
    ``options`` are merged over the preset's options (``gae``: ``gamma``, ``lam``, ``critic_lam``
    for VC-PPO's decoupled GAE, ``length_adaptive_alpha`` for VAPO's length-adaptive lam).
    ``whiten``: whiten advantages over the valid tokens of the batch after estimation
    (``masked_whiten``); ``null`` keeps the preset's choice (on for ``ppo``, off otherwise)."""

    estimator: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    whiten: bool | None = None


# Policy-loss options with a field of their own in ``LossConfig`` (the others go in ``options``).
_LOSS_SHORTHANDS: tuple[str, ...] = ("clip_low", "clip_high", "dual_clip")


@dataclass
class LossConfig:
    """Policy loss. ``policy_loss`` / ``agg_mode``: ``null`` keeps the preset's.

    Options of the policy loss: each loss declares its options and the paper's defaults
    (``policygrad.core.losses.policy_loss_options``: ppo ``clip_low`` 0.2, ``clip_high`` 0.2,
    ``dual_clip`` None; gspo 3e-4 / 4e-4; cispo ``clip_low`` None, ``clip_high`` 0.28). Only the
    options set here reach the loss; the others keep the loss's defaults.

    - ``clip_low`` / ``clip_high`` / ``dual_clip``: shorthands; ``null`` means "not set".
    - ``options``: any declared option by name, e.g. ``{clip_high: 0.28}``; an explicit ``null``
      here is passed as None (cispo ``clip_high: null`` = no upper bound).

    Setting an option in both places is an error; an option the loss does not declare, or a bad
    value, is refused when the config is built. ``entropy_coef`` (>= 0) adds -coef x entropy to
    the loss: a bonus for keeping the policy's entropy up."""

    policy_loss: str | None = None
    agg_mode: str | None = None
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float | None = None
    options: dict[str, Any] = field(default_factory=dict)
    entropy_coef: float = 0.0

    def validate(self, path: str) -> None:
        if self.agg_mode is not None:
            _check_choice(f"{path}.agg_mode", self.agg_mode, set(AGGREGATION_MODES))
        # Negative would reward low entropy: the loss would drive the policy toward collapse onto
        # its likeliest tokens, the failure the bonus exists to prevent.
        _check_positive(
            f"{path}.entropy_coef",
            self.entropy_coef,
            allow_zero=True,
            why=": it weights an entropy bonus (the loss subtracts coef x entropy), and a negative one "
            "would push the policy toward collapse; use 0 (no bonus) or a small positive value such as 0.01",
        )
        for key in self.options:
            if not isinstance(key, str):
                raise ConfigError(
                    f"{path}.options must map option names (strings) to values, got key {key!r}"
                )
        for key in _LOSS_SHORTHANDS:
            if getattr(self, key) is not None and key in self.options:
                raise ConfigError(
                    f"{path}.{key} and {path}.options.{key} both set {key}; set it in one place"
                )

    def set_options(self, path: str = "loss") -> dict[str, tuple[str, Any]]:
        """The options the user set: option name -> (the field that set it, value)."""
        out: dict[str, tuple[str, Any]] = {
            key: (f"{path}.{key}", getattr(self, key))
            for key in _LOSS_SHORTHANDS
            if getattr(self, key) is not None
        }
        out.update({key: (f"{path}.options.{key}", value) for key, value in self.options.items()})
        return out


@dataclass
class OptimConfig:
    """AdamW with gradient clipping, linear warmup and a schedule (``constant`` or ``cosine``
    or ``linear`` decay to 0 over the run). ``ppo_epochs`` x ``num_minibatches`` optimizer steps
    per RL step; ``micro_batch_size`` sequences per forward (gradient accumulation; the summed
    loss equals the minibatch's loss exactly). ``target_kl``: stop the update (the remaining
    minibatches and epochs, critic included) before the first minibatch whose measured
    ``policy/approx_kl`` exceeds it (an early stop of the epoch, as in the reference PPO
    implementations); ``null`` never stops."""

    lr: float = 2e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    schedule: str = "constant"
    ppo_epochs: int = 1
    num_minibatches: int = 1
    micro_batch_size: int = 32
    target_kl: float | None = None

    def validate(self, path: str) -> None:
        if self.target_kl is not None:
            _check_positive(f"{path}.target_kl", self.target_kl)
        _check_positive(f"{path}.lr", self.lr)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(
                f"{path}.betas must be two numbers in [0, 1), e.g. [0.9, 0.999], got {list(self.betas)}"
            )
        _check_positive(f"{path}.eps", self.eps)
        _check_positive(f"{path}.weight_decay", self.weight_decay, allow_zero=True)
        _check_positive(f"{path}.max_grad_norm", self.max_grad_norm)
        _check_positive(f"{path}.warmup_steps", self.warmup_steps, allow_zero=True)
        _check_choice(f"{path}.schedule", self.schedule, {"constant", "cosine", "linear"})
        _check_positive(f"{path}.ppo_epochs", self.ppo_epochs)
        _check_positive(f"{path}.num_minibatches", self.num_minibatches)
        _check_positive(f"{path}.micro_batch_size", self.micro_batch_size)


@dataclass
class CriticConfig:
    """The value model V(s_t) (a transformer with a scalar head; ``policygrad.models.value``).

    ``enabled``: ``null`` follows the algorithm preset (``ppo`` has a critic). ``init_from``:
    ``policy`` (the policy's transformer, zero head: every value starts at 0) or a model folder:
    a one-label reward model (its transformer and score head, as InstructGPT) or a causal LM.
    It must share the policy's tokenizer. The critic has its own AdamW (``lr``, ``weight_decay``,
    ``max_grad_norm``; betas, eps, warmup and schedule from ``optim``) and trains on the same
    ``optim.ppo_epochs`` x ``optim.num_minibatches`` minibatches as the policy, with
    ``micro_batch_size`` sequences per forward (``null``: ``optim.micro_batch_size``).
    ``clip_range``: PPO-style value clipping around the rollout-time values (``null``: off).
    ``pretrain_steps``: the first N of ``steps`` train only the critic, policy frozen, on
    Monte-Carlo returns (lam = 1), as VC-PPO and "Secrets of RLHF" recommend. ``lora``: adapters
    on the critic's transformer (the head always trains fully)."""

    enabled: bool | None = None
    init_from: str = "policy"
    lr: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    clip_range: float | None = None
    pretrain_steps: int = 0
    micro_batch_size: int | None = None
    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self, path: str) -> None:
        if not isinstance(self.init_from, str) or not self.init_from.strip():
            raise ConfigError(f"{path}.init_from must be 'policy' or a model folder")
        _check_positive(f"{path}.lr", self.lr)
        _check_positive(f"{path}.weight_decay", self.weight_decay, allow_zero=True)
        _check_positive(f"{path}.max_grad_norm", self.max_grad_norm)
        if self.clip_range is not None:
            _check_positive(f"{path}.clip_range", self.clip_range)
        _check_positive(f"{path}.pretrain_steps", self.pretrain_steps, allow_zero=True)
        if self.micro_batch_size is not None:
            _check_positive(f"{path}.micro_batch_size", self.micro_batch_size)
        self.lora.validate(f"{path}.lora")


@dataclass
class PtxConfig:
    """PPO-ptx: ``coef`` x a language-modelling loss on pretraining/SFT text added to every
    policy minibatch step (Ouyang et al. 2022, eq. 2; InstructGPT used 27.8). ``dataset``: a
    JSONL file of ``{text_field: "..."}`` rows; ``batch_size`` texts per optimizer step, at most
    ``max_length`` tokens each. ``coef: 0`` turns it off."""

    dataset: str | None = None
    coef: float = 0.0
    text_field: str = "text"
    batch_size: int = 4
    max_length: int = 256

    def validate(self, path: str) -> None:
        _check_positive(f"{path}.coef", self.coef, allow_zero=True)
        _check_positive(f"{path}.batch_size", self.batch_size)
        if self.max_length < 2:
            raise ConfigError(f"{path}.max_length must be >= 2, got {self.max_length}")
        if self.coef > 0 and not self.dataset:
            raise ConfigError(f"{path}.coef={self.coef} needs {path}.dataset (a JSONL file of text)")
        if self.dataset and self.coef == 0:
            raise ConfigError(
                f"{path}.dataset is set but {path}.coef=0 gives it no effect; set {path}.coef > 0 "
                f"(InstructGPT: 27.8) or unset {path}.dataset"
            )


@dataclass
class DynamicSamplingConfig:
    """How ``drop_zero_variance_groups`` (DAPO's dynamic sampling, Yu et al. 2025, section 3.2)
    decides and refills. A group whose rewards are all equal gives every group-relative advantage
    exactly 0, so it costs generation and carries no gradient; DAPO drops such groups and samples
    more prompts until the batch is full of groups with signal.

    ``reward``: the reward component whose within-group variance decides: an entry of
    ``reward.functions`` (for a repeated entry, its k-th occurrence is ``name#k``, k >= 2, as
    the reward components are named); ``null`` = the first entry. It is read before
    normalisation and the truncation penalty, so e.g. a correctness reward decides even when a
    format reward or a length penalty makes every row's total differ.
    ``max_extra_rounds``: extra generation rounds (>= 0) that sample more prompts to refill the
    batch with groups that carry signal; 0 drops the groups and trains on what is left.

    Both need ``drop_zero_variance_groups: true``; set without it they are refused."""

    reward: str | None = None
    max_extra_rounds: int = 0

    def validate(self, path: str) -> None:
        _check_positive(f"{path}.max_extra_rounds", self.max_extra_rounds, allow_zero=True)


@dataclass
class DistributedConfig:
    """How a run started by torchrun (``torchrun --nproc_per_node=N -m policygrad train ...``)
    spreads the trained networks over its processes; ignored in one process.

    ``strategy``: ``ddp`` (every rank holds the whole policy, critic and reference; gradients
    are summed over ranks after the backward passes), ``fsdp`` (FSDP2's ``fully_shard`` per
    decoder layer, then the root, for the policy, the critic and the reference: each rank holds
    1/N of the parameters, gradients and AdamW state; the rollout engine gets the full weights
    after each update), or ``auto`` (``fsdp`` on CUDA, ``ddp`` on CPU). See
    :mod:`policygrad.trainer.distributed` and :mod:`policygrad.trainer.sharding`."""

    strategy: str = "auto"

    def validate(self, path: str) -> None:
        _check_choice(f"{path}.strategy", self.strategy, {"auto", "ddp", "fsdp"})

    def resolved(self, device_type: str) -> str:
        """``ddp`` or ``fsdp`` (``auto``: fsdp on CUDA, ddp elsewhere)."""
        if self.strategy != "auto":
            return self.strategy
        return "fsdp" if device_type == "cuda" else "ddp"


def reward_component_names(functions: list[str]) -> list[str]:
    """The component names of ``reward.functions``, in order: each entry (``reward_model`` for a
    ``reward_model:/folder`` entry), and ``name#k`` for the k-th occurrence (k >= 2) of a repeated
    name (``policygrad.rewards.registry`` names them so)."""
    seen: dict[str, int] = {}
    names = []
    for entry in functions:
        entry = "reward_model" if entry.startswith("reward_model:") else entry
        seen[entry] = seen.get(entry, 0) + 1
        names.append(entry if seen[entry] == 1 else f"{entry}#{seen[entry]}")
    return names


@dataclass
class TrainConfig:
    """A whole run. ``policygrad train`` with no arguments runs these defaults: GRPO on the
    bundled SmolLM2-135M-Instruct and the built-in arithmetic task.

    ``drop_zero_variance_groups``: DAPO's dynamic sampling (Yu et al. 2025, section 3.2): groups
    whose ``dynamic_sampling.reward`` component is the same for every sample carry no loss, and
    up to ``dynamic_sampling.max_extra_rounds`` extra rounds refill the batch (see
    :class:`DynamicSamplingConfig`).

    Checkpoints (``RUN_DIR/checkpoints/step_N``): every ``save_every`` steps (0: off) and every
    ``save_every_minutes`` minutes of training (0: off), on Ctrl-C / SIGTERM after the current
    step, on an error after the first completed step, and at the end, before the final
    evaluation. ``overwrite``: replace the run in ``output_dir`` (only the files a run writes are
    deleted, after the whole new config is validated); it is never saved in ``config.yaml``.
    ``max_skipped_updates``: end the run with an error after this many consecutive steps that
    applied no update (every optimizer step skipped as non-finite, no token carried loss, or every
    gradient exactly 0: every advantage 0 and no other loss term);
    0 never stops. A run that ends with no update applied is an error however short it was.

    ``report_to``: the trackers that receive every step's metrics besides ``metrics.jsonl``:
    ``tensorboard`` (``RUN_DIR/tensorboard``), ``wandb`` (offline unless ``WANDB_MODE`` says
    otherwise, files under ``RUN_DIR/wandb``), ``mlflow`` (a file store under ``RUN_DIR/mlruns``
    unless ``MLFLOW_TRACKING_URI`` is set), ``trackio`` (trackio's local storage, ``TRACKIO_DIR``
    or its default), or ``[none]``; each needs its library (the ``wandb``, ``mlflow``, ``trackio``
    extras). ``tensorboard: false`` removes TensorBoard from the list. ``project`` names the W&B
    project, MLflow experiment and trackio project; ``run_name`` the run (default: the name of
    ``output_dir``). See :mod:`policygrad.trainer.trackers`.

    ``eval_samples``: n > 1 sampled completions per held-out problem at ``eval_temperature``
    besides the greedy one, reported as pass@k (unbiased estimator) and maj@k for each k in
    ``eval_k`` (default [1, n]); 0 evaluates greedily only. ``export_merged``: at the end of
    the run, also write ``RUN_DIR/merged_model``, the policy with any LoRA adapter merged in."""

    algorithm: str = "grpo"
    steps: int = 300
    seed: int = 0
    output_dir: str = "runs/default"
    overwrite: bool = False
    max_minutes: float | None = 24.0
    eval_every: int = 0
    eval_before: bool = True
    eval_after: bool = True
    save_every: int = 0
    save_every_minutes: float = 10.0
    max_skipped_updates: int = 20
    log_completions: int = 2
    drop_zero_variance_groups: bool = False
    num_threads: int | None = None
    tensorboard: bool = True
    progress: bool = True
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    project: str = "policygrad"
    run_name: str | None = None
    eval_samples: int = 0
    eval_k: list[int] = field(default_factory=list)
    eval_temperature: float = 1.0
    export_merged: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    kl: KLConfig = field(default_factory=KLConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ptx: PtxConfig = field(default_factory=PtxConfig)
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _check_choice("algorithm", self.algorithm, set(ALGORITHMS))
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1 (or null: torch's default), got {self.num_threads}")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ConfigError(f"max_minutes must be > 0 (or null for no time limit), got {self.max_minutes}")
        if self.rollout.engine == "hf" and self.rollout.dtype != "auto":
            raise ConfigError(
                f"rollout.dtype={self.rollout.dtype!r} applies to the vllm engine only: the hf engine "
                "samples with the policy itself (set model.dtype instead), so keep rollout.dtype=auto or use "
                "rollout.engine=vllm"
            )
        _check_positive("steps", self.steps, allow_zero=True)
        _check_positive("eval_every", self.eval_every, allow_zero=True)
        _check_positive("save_every", self.save_every, allow_zero=True)
        self._validate_reporting_and_eval()
        _check_positive("save_every_minutes", self.save_every_minutes, allow_zero=True)
        _check_positive("max_skipped_updates", self.max_skipped_updates, allow_zero=True)
        sections = ("model", "data", "rollout", "reward", "kl", "loss", "optim", "critic", "ptx")
        for name in (*sections, "dynamic_sampling", "distributed"):
            getattr(self, name).validate(name)
        if self.eval_every and self.data.eval_size == 0:
            raise ConfigError(
                f"eval_every={self.eval_every} with data.eval_size=0 would evaluate no problem; set "
                "data.eval_size > 0 (held-out problems per evaluation) or eval_every=0"
            )
        self._validate_code_rewards()
        if self.kl_placement.needs_reference and (self.rollout.top_k or self.rollout.top_p < 1.0):
            raise ConfigError(
                f"kl.placement={self.kl.placement!r} with rollout.top_k/top_p truncation is not supported: "
                "the truncated sampler's log-probs are not comparable to the reference's full softmax, so "
                "the KL would not be 0 even for an unchanged policy; set rollout.top_k=0 and "
                "rollout.top_p=1.0, or kl.placement=none"
            )
        self._validate_policy_loss()
        self._validate_estimator()
        batch = self.rollout.prompts_per_step * self.rollout.group_size
        if batch < self.optim.num_minibatches:
            raise ConfigError(
                f"optim.num_minibatches={self.optim.num_minibatches} exceeds the batch of {batch} "
                "sequences (rollout.prompts_per_step x rollout.group_size); lower it"
            )
        if self.estimator_spec.needs_values and not self.uses_critic:
            raise ConfigError(
                f"advantage estimator {self.estimator_name!r} reads a critic's values, but there is no "
                "critic; set critic.enabled=true or use a critic-free estimator"
            )
        if self.critic.pretrain_steps and not self.uses_critic:
            raise ConfigError(
                f"critic.pretrain_steps={self.critic.pretrain_steps} needs a critic; set "
                "critic.enabled=true or algorithm=ppo"
            )
        if self.steps and self.critic.pretrain_steps >= self.steps:
            raise ConfigError(
                f"critic.pretrain_steps={self.critic.pretrain_steps} leaves no policy step out of "
                f"steps={self.steps}; the first critic.pretrain_steps steps train only the critic"
            )
        self._validate_dynamic_sampling()

    def _validate_reporting_and_eval(self) -> None:
        trackers = ("tensorboard", "wandb", "mlflow", "trackio", "none")
        for i, name in enumerate(self.report_to):
            _check_choice(f"report_to[{i}]", name, set(trackers))
        if len(set(self.report_to)) != len(self.report_to):
            raise ConfigError(f"report_to={self.report_to} names a tracker twice; name each once")
        if "none" in self.report_to and len(self.report_to) > 1:
            raise ConfigError(f"report_to={self.report_to}: 'none' cannot be combined with trackers; drop it")
        if not self.project.strip():
            raise ConfigError("project must be a non-empty name (W&B / trackio project, MLflow experiment)")
        _check_positive("eval_samples", self.eval_samples, allow_zero=True)
        _check_positive("eval_temperature", self.eval_temperature)
        if self.eval_k and self.eval_samples < 2:
            raise ConfigError(f"eval_k={self.eval_k} needs eval_samples >= 2 (samples per problem); set it")
        for k in self.eval_k:
            if not 1 <= k <= self.eval_samples:
                raise ConfigError(
                    f"eval_k contains {k}; each k must be in 1 .. eval_samples={self.eval_samples}"
                )

    def _validate_code_rewards(self) -> None:
        """A code dataset needs a reward that can score a program: its rows carry tests, and the
        built-in answer and length rewards would give every sample of a group the same score
        (every advantage 0, nothing learned)."""
        from policygrad.data.sources import is_code_dataset

        if not is_code_dataset(self.data.dataset):
            return
        blind = {"answer_correctness", "answer_format", "length_penalty"}
        if all(isinstance(f, str) and f.strip() in blind for f in self.reward.functions):
            raise ConfigError(
                f"data.dataset={self.data.dataset!r} holds code rows (tests, no final answer), but "
                f"reward.functions={self.reward.functions} cannot score a program: every sample would get "
                "the same score and nothing would be learned; set reward.functions=[code_tests]"
            )

    @property
    def trackers(self) -> list[str]:
        """``report_to`` resolved: ``none`` removed, and TensorBoard dropped by ``tensorboard: false``."""
        return [t for t in self.report_to if t != "none" and (t != "tensorboard" or self.tensorboard)]

    @property
    def eval_ks(self) -> list[int]:
        """The k of pass@k / maj@k: ``eval_k``, or [1, n] with n = ``eval_samples`` (none when n < 2)."""
        if self.eval_samples < 2:
            return []
        return sorted(set(self.eval_k)) if self.eval_k else [1, self.eval_samples]

    def _validate_policy_loss(self) -> None:
        """The loss is registered; every option set is one it declares, with a valid value."""
        if self.loss.policy_loss is not None:
            _check_choice("loss.policy_loss", self.loss.policy_loss, set(list_policy_losses()))
        name = self.policy_loss_name
        declared = ", ".join(f"{k} (default {v!r})" for k, v in policy_loss_options(name).items())
        declared = declared or "(none)"
        for key, (path, value) in self.loss.set_options().items():
            try:
                check_policy_loss_options(name, {key: value})
            except (ValueError, TypeError) as e:
                if key not in policy_loss_options(name):
                    raise ConfigError(
                        f"{path}: {e}; unset {path} or choose a policy loss that has it"
                    ) from None
                raise ConfigError(
                    f"{path}={value!r} is not valid for policy loss {name!r}: {e} (its options: {declared})"
                ) from None
        try:  # each value passed alone; now all of them together
            check_policy_loss_options(name, self.loss_options)
        except (ValueError, TypeError) as e:
            raise ConfigError(
                f"loss: the options {self.loss_options!r} are not valid together for policy loss "
                f"{name!r}: {e} (its options: {declared})"
            ) from None

    def _validate_estimator(self) -> None:
        """The estimator is registered, its options valid, and G at least its minimum group size."""
        if self.advantage.estimator is not None:
            _check_choice("advantage.estimator", self.advantage.estimator, set(list_advantage_estimators()))
        name, options = self.estimator_name, self.estimator_options
        try:
            check_estimator_options(name, options)
        except (ValueError, TypeError) as e:
            raise ConfigError(f"advantage.options: {e}") from None
        spec = self.estimator_spec
        need = spec.min_group_size(options)
        if self.rollout.group_size >= need:
            return
        # The options that raise the minimum (e.g. reinforce_pp's group_baseline): without any one
        # of them the estimator would need fewer samples per prompt.
        culprits = [
            key
            for key in options
            if spec.min_group_size({k: v for k, v in options.items() if k != key}) < need
        ]
        with_options = "".join(f" with {k}={options[k]!r}" for k in culprits)
        fix = f"set rollout.group_size >= {need}"
        if culprits:
            fix += " or change " + ", ".join(f"advantage.options.{k}" for k in culprits)
        else:
            fix += " or choose an estimator that does not compare samples of the same prompt"
        raise ConfigError(
            f"algorithm={self.algorithm!r} needs rollout.group_size >= {need} (advantage estimator "
            f"{name!r}{with_options} compares samples of the same prompt), got {self.rollout.group_size}; "
            f"{fix}"
        )

    def _validate_dynamic_sampling(self) -> None:
        ds = self.dynamic_sampling
        if not self.drop_zero_variance_groups:
            set_fields = []
            if ds.reward is not None:
                set_fields.append(f"dynamic_sampling.reward={ds.reward!r}")
            if ds.max_extra_rounds:
                set_fields.append(f"dynamic_sampling.max_extra_rounds={ds.max_extra_rounds}")
            if set_fields:
                raise ConfigError(
                    f"{' and '.join(set_fields)} has no effect; set drop_zero_variance_groups=true "
                    "(dynamic sampling is off) or unset it"
                )
            return
        names = reward_component_names(self.reward.functions)
        if ds.reward is not None and ds.reward not in names:
            raise ConfigError(
                f"dynamic_sampling.reward={ds.reward!r} is not a reward component; choose one of {names} "
                "(the entries of reward.functions; the k-th occurrence of a repeated entry is name#k)"
            )

    @property
    def preset(self) -> AlgorithmPreset:
        return ALGORITHMS[self.algorithm]

    # Resolved choices: the preset unless the user overrode it.
    @property
    def estimator_name(self) -> str:
        return self.advantage.estimator or self.preset.estimator

    @property
    def estimator_options(self) -> dict[str, Any]:
        options = dict(self.preset.estimator_options) if not self.advantage.estimator else {}
        options.update(self.advantage.options)
        return options

    @property
    def estimator_spec(self) -> EstimatorSpec:
        """What the estimator needs: values, trainer-supplied inputs, minimum group size."""
        return estimator_spec(self.estimator_name)

    @property
    def policy_loss_name(self) -> str:
        return self.loss.policy_loss or self.preset.policy_loss

    @property
    def loss_options(self) -> dict[str, Any]:
        """The policy-loss options the user set (shorthand fields that are not null, then
        ``loss.options``); the loss's own defaults apply to the rest."""
        return {key: value for key, (_, value) in self.loss.set_options().items()}

    @property
    def kl_placement(self) -> KLPlacement:
        """The registered KL placement of ``kl.placement``."""
        return get_kl_placement(self.kl.placement)

    @property
    def dynamic_sampling_reward(self) -> str:
        """The reward component whose within-group variance decides dynamic sampling:
        ``dynamic_sampling.reward``, or the first entry of ``reward.functions``."""
        return self.dynamic_sampling.reward or reward_component_names(self.reward.functions)[0]

    @property
    def agg_mode(self) -> str:
        return self.loss.agg_mode or self.preset.loss_agg_mode

    @property
    def uses_critic(self) -> bool:
        """A value model is trained: ``critic.enabled``, or the preset's choice when it is null."""
        return self.preset.critic if self.critic.enabled is None else self.critic.enabled

    @property
    def whiten_advantages(self) -> bool:
        """``advantage.whiten``, or the preset's choice when it is null."""
        return self.preset.whiten_advantages if self.advantage.whiten is None else self.advantage.whiten

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------
# Building the tree from YAML and overrides.


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(path: str, value: Any, annotation: Any) -> Any:
    """Convert a YAML value to the annotated type, or raise a ConfigError naming ``path``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping of its fields, got {value!r}")
        return _build(annotation, value, path)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", typing.Union)):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(path, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{path}={value!r} has the wrong type ({annotation}): {'; '.join(errors)}")
    if annotation is Any:
        return value
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path} must be true or false, got {value!r}")
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{path} must be an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, str):
            # YAML 1.1 reads a number without a dot in its mantissa (1e-5) as a string.
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{path} must be a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{path} must be a finite number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} must be a string, got {value!r}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {value!r}")
        if origin is tuple:
            return tuple(_coerce(f"{path}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
        return [_coerce(f"{path}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a mapping, got {value!r}")
        return {key: _yaml_number(item) for key, item in value.items()}
    return value


# A number in exponent form without a dot in its mantissa (3e-4), which YAML 1.1 reads as a string.
_EXPONENT_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _yaml_number(value: Any) -> Any:
    """``"3e-4"`` -> 3e-4 inside option mappings (``loss.options``, ``advantage.options``), whose
    values have no annotated type to coerce to; every other value is returned unchanged."""
    if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value.strip()):
        return float(value)
    return value


def _build(cls, data: dict[str, Any], prefix: str = ""):
    types = _field_types(cls)
    unknown = sorted(set(data) - set(types))
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"unknown config key {where}{unknown[0]}; valid keys here: {', '.join(sorted(types))}"
        )
    kwargs = {}
    for name, value in data.items():
        path = f"{prefix}.{name}" if prefix else name
        kwargs[name] = _coerce(path, value, types[name])
    return cls(**kwargs)


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = {}
            node[key] = child
        if not isinstance(child, dict):
            raise ConfigError(f"cannot set {dotted}: {key} is not a section")
        node = child
    node[keys[-1]] = value


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ``["--kl.beta=0.04", "--steps", "10"]`` into a nested dict (values parsed as YAML)."""
    tree: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"expected --key=value, got {arg!r}")
        key, sep, raw = arg[2:].partition("=")
        if not sep:
            if i + 1 >= len(args):
                raise ConfigError(f"--{key} needs a value: --{key}=VALUE")
            raw = args[i + 1]
            i += 1
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"--{key}: cannot parse value {raw!r}: {e}") from None
        _set_path(tree, key.replace("-", "_"), value)
        i += 1
    return tree


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(path: str | None = None, overrides: list[str] | dict[str, Any] | None = None) -> TrainConfig:
    """Build a validated :class:`TrainConfig` from an optional YAML file and overrides.

    Raises:
        ConfigError: unknown key, wrong type or invalid value, naming the dotted field.
        FileNotFoundError: the YAML file does not exist.
    """
    data: dict[str, Any] = {}
    if path is not None:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: a config file must be a YAML mapping of fields")
        data = loaded
    if overrides:
        over = parse_overrides(overrides) if isinstance(overrides, list) else overrides
        data = _merge(data, over)
    return _build(TrainConfig, data)
