"""The training sections of the configuration tree, and the algorithm presets.

Algorithms are *presets*, not code paths: ``ALGORITHMS[name]`` says which registered advantage
estimator, which estimator options, which policy loss and which loss aggregation the algorithm
uses. What a choice needs comes from the registries' torch-free declarations
(:mod:`policygrad.specs`), never from its name: the estimator's
:class:`~policygrad.specs.estimators.EstimatorSpec` (values, trainer-supplied inputs, minimum
group size), the policy loss's declared options and the KL placement's
:class:`~policygrad.specs.kl.KLPlacementSpec`. So an algorithm added here needs no change in the
training loop, and every option is checked against the registries when the tree is built,
before any model loads.

The sections: :class:`KLConfig` (the KL to the reference), :class:`AdvantageConfig` and
:class:`LossConfig` (overrides of the preset's estimator and policy loss), :class:`OptimConfig`,
:class:`CriticConfig` (the value model), :class:`PtxConfig` (PPO-ptx),
:class:`DynamicSamplingConfig` and :class:`DistributedConfig`. The sampling, model, data and
reward sections are in :mod:`policygrad.config.sections`; the whole tree and its loading
in :mod:`policygrad.config.train`, which re-exports every public name here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from policygrad.config.checks import ConfigError, check_at_most, check_choice, check_positive
from policygrad.config.sections import LoraConfig
from policygrad.specs.aggregation import AGGREGATION_MODES
from policygrad.specs.kl import KL_KINDS, KL_PLACEMENTS, kl_placement_spec

# The most a loss term's coefficient may weigh. The policy-gradient loss is of order 1 (advantages
# are normalised or bounded rewards); a term weighted 100 times more no longer leaves an RL update,
# and far larger ones (1e30) overflow the float32 gradient, which the run then reports as a
# diverged step. The papers' values: entropy bonus 0.001-0.01, VAPO's positive-example loss 0.1.
MAX_LOSS_COEF = 100.0
# The most the adaptive entropy coefficient moves per step (Skywork-OR1: 0.005).
MAX_ENTROPY_COEF_DELTA = 1.0


@dataclass(frozen=True)
class AlgorithmPreset:
    """What an algorithm name means: estimator, its options, loss and aggregation.

    What the estimator needs (a critic's values, inputs such as ReMax's greedy-baseline
    rewards, a minimum group size) is not part of the preset: the estimator declares it in the
    registry (``TrainConfig.estimator_spec``).

    Fields:
        estimator: a registered estimator (``specs.estimators.list_advantage_estimators``).
        estimator_options: keyword options passed to the estimator.
        policy_loss: a registered policy loss (``specs.losses.list_policy_losses``).
        loss_agg_mode: one of ``specs.aggregation.AGGREGATION_MODES``.
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
    "vineppo": AlgorithmPreset("vineppo", {}, "ppo", "token-mean", "Kazemnejad et al. 2024 (VinePPO)"),
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


@dataclass
class KLConfig:
    """KL to the reference model.

    ``placement``: a registered KL placement (:data:`~policygrad.specs.kl.KL_PLACEMENTS`):
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
        check_choice(f"{path}.placement", self.placement, set(KL_PLACEMENTS))
        if self.kind is not None:
            check_choice(f"{path}.kind", self.kind, set(KL_KINDS))
        check_positive(f"{path}.beta", self.beta, allow_zero=True)
        check_choice(f"{path}.controller", self.controller, {"fixed", "adaptive"})
        check_positive(f"{path}.target", self.target)
        check_positive(f"{path}.horizon", self.horizon)
        if self.controller == "adaptive" and not kl_placement_spec(self.placement).needs_reference:
            raise ConfigError(
                f"{path}.controller=adaptive with {path}.placement={self.placement!r}: there is no KL for "
                f"the controller to steer; set {path}.placement=reward or loss (with {path}.beta), or "
                f"{path}.controller=fixed"
            )
        needs_reference = kl_placement_spec(self.placement).needs_reference
        if needs_reference and self.beta == 0 and self.controller == "fixed":
            raise ConfigError(
                f"{path}.placement={self.placement!r} with {path}.beta=0 computes a KL that has no "
                f"effect; set {path}.beta > 0 or {path}.placement=none"
            )

    def resolved_kind(self) -> str:
        """``kind``, or the placement's ``default_kind`` when it is null."""
        if self.kind is not None:
            return self.kind
        return kl_placement_spec(self.placement).default_kind


@dataclass
class AdvantageConfig:
    """Overrides of the algorithm preset's estimator. ``estimator: null`` keeps the preset's;
    ``options`` are merged over the preset's options (``gae``: ``gamma``, ``lam``, ``critic_lam``
    for VC-PPO's decoupled GAE, ``length_adaptive_alpha`` for VAPO's length-adaptive lam;
    ``vineppo``: ``rollouts`` K, ``split`` newline|fixed, ``segment_tokens`` L, ``max_splits`` S,
    ``prompt_value`` rollouts|group, see :func:`~policygrad.core.advantages.vineppo_advantages`).
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
    (``policygrad.specs.losses.policy_loss_options``: ppo ``clip_low`` 0.2, ``clip_high`` 0.2,
    ``dual_clip`` None; gspo 3e-4 / 4e-4; cispo ``clip_low`` None, ``clip_high`` 0.28). Only the
    options set here reach the loss; the others keep the loss's defaults.

    - ``clip_low`` / ``clip_high`` / ``dual_clip``: shorthands; ``null`` means "not set".
    - ``options``: any declared option by name, e.g. ``{clip_high: 0.28}``; an explicit ``null``
      here is passed as None (cispo ``clip_high: null`` = no upper bound).

    Setting an option in both places is an error; an option the loss does not declare, or a bad
    value, is refused when the config is built. ``entropy_coef`` (>= 0) adds -coef x entropy to
    the loss: a bonus for keeping the policy's entropy up.

    ``entropy_target`` (null: a fixed ``entropy_coef``): an adaptive coefficient (He et al. 2025,
    Skywork-OR1's adaptive entropy control) that starts at ``entropy_coef``, moves by
    ``entropy_coef_delta`` per step up while the policy's mean token entropy is below the target
    and down (to 0 at least) while above, and applies the bonus only while below (Skywork-OR1:
    target 0.2, delta 0.005, start 0). The policy losses ``clip_cov`` and ``kl_cov`` (Cui et al.
    2025) fight entropy collapse at the tokens that cause it; ``entropy/*`` metrics show the
    entropy and the log-prob/advantage covariance that lowers it.

    ``positive_lm_coef`` (0: off): VAPO's positive-example language-model loss (Yue et al. 2025,
    section 4.3, coefficient 0.1): ``coef x`` the mean negative log-likelihood of the tokens of
    the step's best samples (those whose score is the batch's highest, when some sample scored
    lower: with a 0/1 verifier, the correct ones), added to the policy loss.

    Bounds: ``entropy_coef`` and ``positive_lm_coef`` in [0, 100] (:data:`MAX_LOSS_COEF`; the
    adaptive coefficient stops there too, with a warning), ``entropy_coef_delta`` in (0, 1],
    ``entropy_target`` below ln V, the entropy of the uniform distribution over the model's
    vocabulary of V tokens (checked once the model is loaded: ln 49152 = 10.8 for the bundled
    model)."""

    policy_loss: str | None = None
    agg_mode: str | None = None
    clip_low: float | None = None
    clip_high: float | None = None
    dual_clip: float | None = None
    options: dict[str, Any] = field(default_factory=dict)
    entropy_coef: float = 0.0
    entropy_target: float | None = None
    entropy_coef_delta: float = 0.005
    positive_lm_coef: float = 0.0

    def validate(self, path: str) -> None:
        if self.agg_mode is not None:
            check_choice(f"{path}.agg_mode", self.agg_mode, set(AGGREGATION_MODES))
        # Negative would reward low entropy: the loss would drive the policy toward collapse onto
        # its likeliest tokens, the failure the bonus exists to prevent.
        check_positive(
            f"{path}.entropy_coef",
            self.entropy_coef,
            allow_zero=True,
            why=": it weights an entropy bonus (the loss subtracts coef x entropy), and a negative one "
            "would push the policy toward collapse; use 0 (no bonus) or a small positive value such as 0.01",
        )
        big = " outweighs the policy-gradient loss (of order 1) more than a hundredfold"
        check_at_most(
            f"{path}.entropy_coef", self.entropy_coef, MAX_LOSS_COEF,
            why=f": a bonus weighted more{big}; use a small value such as 0.01",
        )
        if self.entropy_target is not None:
            check_positive(
                f"{path}.entropy_target",
                self.entropy_target,
                why=": a mean token entropy in nats (Skywork-OR1 uses 0.2); null keeps entropy_coef fixed",
            )
        check_positive(f"{path}.entropy_coef_delta", self.entropy_coef_delta)
        check_at_most(
            f"{path}.entropy_coef_delta", self.entropy_coef_delta, MAX_ENTROPY_COEF_DELTA, low="(0",
            why=": the adaptive coefficient moves by it every step (Skywork-OR1 uses 0.005)",
        )
        if self.entropy_target is None and self.entropy_coef_delta != LossConfig.entropy_coef_delta:
            raise ConfigError(
                f"{path}.entropy_coef_delta={self.entropy_coef_delta!r} has no effect without "
                f"{path}.entropy_target (the adaptive coefficient's target entropy); set one, or drop it"
            )
        check_positive(
            f"{path}.positive_lm_coef",
            self.positive_lm_coef,
            allow_zero=True,
            why=": it weights a likelihood loss on the best samples (VAPO uses 0.1); 0 turns it off",
        )
        check_at_most(
            f"{path}.positive_lm_coef", self.positive_lm_coef, MAX_LOSS_COEF,
            why=f": a likelihood loss weighted more{big} (VAPO uses 0.1)",
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
    implementations); ``null`` never stops.

    ``skip_zero_advantage_rows``: rows whose advantages are all 0 (a group whose samples scored
    alike, under GRPO, RLOO and the other group baselines) have a loss and a gradient of exactly
    0, so their training forward and backward are skipped; the loss's normalisers still count
    them, so the update is the same (up to float rounding, since the batch's shapes change, and
    with dropout up to which masks the rows draw, as with another ``micro_batch_size``), and a
    step where every row is skipped still steps AdamW on a gradient of zeros. The forward's
    metrics (``policy/*``, ``entropy/mean``, ``mismatch/*``) are then over the rows that trained;
    a step where none did logs none of them, and one whose first minibatch skipped every row logs
    no ``entropy/mean`` (the entropy before the step's first optimizer step). No row is skipped
    with a loss term that does not vanish with the advantages (``loss.entropy_coef``,
    ``loss.positive_lm_coef``, ``loss.entropy_target``), with a KL to the reference and beta > 0
    (in the loss; or in the reward, where an advantage is rarely exactly 0 anyway), under
    ``target_kl``, or with a policy loss that does not declare it (``clip_cov``, ``kl_cov``, a
    registered loss without ``vanishes_at_zero_advantage``)."""

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
    skip_zero_advantage_rows: bool = True

    def validate(self, path: str) -> None:
        if self.target_kl is not None:
            check_positive(f"{path}.target_kl", self.target_kl)
        check_positive(f"{path}.lr", self.lr)
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(
                f"{path}.betas must be two numbers in [0, 1), e.g. [0.9, 0.999], got {list(self.betas)}"
            )
        check_positive(f"{path}.eps", self.eps)
        check_positive(f"{path}.weight_decay", self.weight_decay, allow_zero=True)
        check_positive(f"{path}.max_grad_norm", self.max_grad_norm)
        check_positive(f"{path}.warmup_steps", self.warmup_steps, allow_zero=True)
        check_choice(f"{path}.schedule", self.schedule, {"constant", "cosine", "linear"})
        check_positive(f"{path}.ppo_epochs", self.ppo_epochs)
        check_positive(f"{path}.num_minibatches", self.num_minibatches)
        check_positive(f"{path}.micro_batch_size", self.micro_batch_size)


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
        check_positive(f"{path}.lr", self.lr)
        check_positive(f"{path}.weight_decay", self.weight_decay, allow_zero=True)
        check_positive(f"{path}.max_grad_norm", self.max_grad_norm)
        if self.clip_range is not None:
            check_positive(f"{path}.clip_range", self.clip_range)
        check_positive(f"{path}.pretrain_steps", self.pretrain_steps, allow_zero=True)
        if self.micro_batch_size is not None:
            check_positive(f"{path}.micro_batch_size", self.micro_batch_size)
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
        check_positive(f"{path}.coef", self.coef, allow_zero=True)
        check_positive(f"{path}.batch_size", self.batch_size)
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
    the reward components are named); with an environment also ``env`` (the episode's final
    reward plus its turn rewards) or ``return`` (``env`` plus the functions' weighted sum: all
    the sample earned). ``null`` = the first entry, or ``return`` with an environment. It is
    read before normalisation and the truncation penalty, so e.g. a correctness reward decides
    even when a format reward or a length penalty makes every row's total differ.
    ``max_extra_rounds``: extra generation rounds (>= 0) that sample more prompts to refill the
    batch with groups that carry signal; 0 drops the groups and trains on what is left.

    Both need ``drop_zero_variance_groups: true``; set without it they are refused."""

    reward: str | None = None
    max_extra_rounds: int = 0

    def validate(self, path: str) -> None:
        check_positive(f"{path}.max_extra_rounds", self.max_extra_rounds, allow_zero=True)


@dataclass
class DistributedConfig:
    """How a run started by torchrun (``torchrun --nproc_per_node=N -m policygrad train ...``)
    spreads the trained networks over its processes; ignored in one process.

    ``strategy``: ``ddp`` (every rank holds the whole policy, critic and reference; gradients
    are summed over ranks after the backward passes), ``fsdp`` (FSDP2's ``fully_shard`` per
    decoder layer, then the root, for the policy, the critic and the reference: each rank holds
    1/N of the parameters, gradients and AdamW state; the rollout engine gets the full weights
    after each update), or ``auto`` (``fsdp`` on CUDA, ``ddp`` on CPU). See
    :mod:`policygrad.parallel.distributed` and :mod:`policygrad.parallel.sharding`."""

    strategy: str = "auto"

    def validate(self, path: str) -> None:
        check_choice(f"{path}.strategy", self.strategy, {"auto", "ddp", "fsdp"})

    def resolved(self, device_type: str) -> str:
        """``ddp`` or ``fsdp`` (``auto``: fsdp on CUDA, ddp elsewhere)."""
        if self.strategy != "auto":
            return self.strategy
        return "fsdp" if device_type == "cuda" else "ddp"
