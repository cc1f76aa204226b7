"""The typed configuration tree of a training run: :class:`TrainConfig`, and its loading.

One dataclass per pipeline stage; a YAML file and ``--key=value`` overrides map onto the tree one
to one (``--kl.beta=0.04`` sets ``TrainConfig.kl.beta``): :func:`load_config`,
:func:`parse_overrides`. Every field is validated when the tree is built, and every error names
the field and says how to fix it. :class:`TrainConfig` checks what spans sections: the algorithm
preset against the registries' torch-free declarations (:mod:`policygrad.specs`), the
estimator's minimum group size, the loss's options (:mod:`policygrad.config.algorithm`), the KL
placement against the sampler's truncation. Importing the config imports no torch,
transformers or vLLM; checking an estimator's or a loss's option values runs it once on a dummy
batch, which imports ``policygrad.core`` then.

The base is :mod:`policygrad.config.checks` (``ConfigError``, the checks) and
:mod:`policygrad.config.coerce` (the coercion of YAML values); the sections are defined in
:mod:`policygrad.config.sections` (the model, data, rollout and environment sections),
:mod:`policygrad.config.rewards` and :mod:`policygrad.config.training` (the algorithm presets
``ALGORITHMS``; the KL, advantage, loss, optimizer, critic, ptx, dynamic-sampling and
distributed sections). Every public name of those is re-exported here, so
``from policygrad.config.train import X`` is the one import for the whole tree.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any

import yaml

from policygrad.config.agent import AgentConfig, apply_agent, check_agent
from policygrad.config.algorithm import validate_estimator, validate_policy_loss
from policygrad.config.checks import MIN_TEMPERATURE, ConfigError, check_choice, check_positive
from policygrad.config.coerce import build_dataclass
from policygrad.config.rewards import CodeRewardConfig, RewardConfig, reward_component_names
from policygrad.config.sections import (
    DataConfig,
    EnvConfig,
    LoraConfig,
    ModelConfig,
    RolloutConfig,
    check_episode_options,
)
from policygrad.config.training import (
    ALGORITHMS,
    AdvantageConfig,
    AlgorithmPreset,
    CriticConfig,
    DistributedConfig,
    DynamicSamplingConfig,
    KLConfig,
    LossConfig,
    OptimConfig,
    PtxConfig,
)
from policygrad.specs.datasets import is_code_dataset
from policygrad.specs.estimators import EstimatorSpec, estimator_spec
from policygrad.specs.kl import kl_placement_spec

log = logging.getLogger("policygrad")

__all__ = [
    "ALGORITHMS",
    "MIN_TEMPERATURE",
    "AdvantageConfig",
    "AlgorithmPreset",
    "CodeRewardConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "DistributedConfig",
    "DynamicSamplingConfig",
    "KLConfig",
    "LoraConfig",
    "LossConfig",
    "ModelConfig",
    "OptimConfig",
    "PtxConfig",
    "RewardConfig",
    "RolloutConfig",
    "TrainConfig",
    "load_config",
    "parse_overrides",
    "reward_component_names",
]


def _check_output_dir(output_dir) -> None:
    """An empty ``output_dir`` names no folder (the run would fail making '')."""
    if not isinstance(output_dir, str) or not output_dir.strip():
        raise ConfigError(
            f"output_dir must name the run's folder, e.g. --output_dir=runs/my_run; got {output_dir!r}"
        )


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
    evaluation. ``keep_checkpoints``: after each save, delete this run's complete checkpoints
    but the newest N (TRL's ``save_total_limit``; null: keep every one). ``overwrite``: replace
    the run in ``output_dir`` (only the files a run writes are deleted, after the whole new config
    is validated); it is never saved in ``config.yaml``.
    ``max_skipped_updates``: end the run with an error after this many consecutive steps that
    applied no update (every optimizer step skipped as non-finite, no token carried loss, or every
    gradient exactly 0: every advantage 0 and no other loss term);
    0 never stops. A run that ends with no update applied is an error however short it was.
    ``memory_check``: a CPU run plans its peak memory before its first model loads and stops
    with an error when its least need exceeds the memory available (the plan prices every
    response at full length; see :mod:`policygrad.parallel.before_loading`); false skips the
    check, for a run known to stay under its plan.

    ``report_to``: the trackers that receive every step's metrics besides ``metrics.jsonl``:
    ``tensorboard`` (``RUN_DIR/tensorboard``), ``wandb`` (offline unless ``WANDB_MODE`` says
    otherwise, files under ``RUN_DIR/wandb``), ``mlflow`` (a file store under ``RUN_DIR/mlruns``
    unless ``MLFLOW_TRACKING_URI`` is set), ``trackio`` (trackio's local storage, ``TRACKIO_DIR``
    or its default), or ``[none]``; each needs its library (the ``wandb``, ``mlflow``, ``trackio``
    extras). ``tensorboard: false`` removes TensorBoard from the list. ``project`` names the W&B
    project, MLflow experiment and trackio project; ``run_name`` the run (default: the name of
    ``output_dir``). See :mod:`policygrad.run.trackers`.

    ``eval_samples``: n > 1 sampled completions per held-out problem at ``eval_temperature``
    besides the greedy one, reported as pass@k (unbiased estimator) and maj@k for each k in
    ``eval_k`` (default [1, n]); 0 evaluates greedily only. ``export_merged``: at the end of
    the run, also write ``RUN_DIR/merged_model``, the policy with any LoRA adapter merged in.

    ``num_threads``: torch's intra-op threads (and the in-process vLLM engine's), fixed for the
    run. null: fitted to the machine's load, at start and before each step: torch's default
    count, fewer when other processes hold cores of the affinity set or the cgroup's CPU quota
    is lower (one ``note:`` line the first time; logged as ``perf/threads``; see
    :mod:`policygrad.parallel.threads`). On a quiet machine that is torch's default."""

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
    keep_checkpoints: int | None = None
    max_skipped_updates: int = 20
    memory_check: bool = True
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
    env: EnvConfig = field(default_factory=EnvConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)

    def __post_init__(self) -> None:
        apply_agent(self)  # an agent is an environment to the runner: env.name and its limits
        if self.reward.functions is None:  # the default depends on the environment (RewardConfig)
            self.reward.functions = [] if self.env.name else ["answer_correctness"]
        self.validate()

    def validate(self) -> None:
        check_choice("algorithm", self.algorithm, set(ALGORITHMS))
        _check_output_dir(self.output_dir)
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(
                f"num_threads must be >= 1 (or null: fitted to the machine's load), got {self.num_threads}"
            )
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ConfigError(f"max_minutes must be > 0 (or null for no time limit), got {self.max_minutes}")
        if self.rollout.engine == "hf" and self.rollout.dtype != "auto":
            raise ConfigError(
                f"rollout.dtype={self.rollout.dtype!r} applies to the vllm engine only: the hf engine "
                "samples with the policy itself (set model.dtype instead), so keep rollout.dtype=auto or use "
                "rollout.engine=vllm"
            )
        check_positive("steps", self.steps, allow_zero=True)
        check_positive("eval_every", self.eval_every, allow_zero=True)
        check_positive("save_every", self.save_every, allow_zero=True)
        self._validate_reporting_and_eval()
        check_positive("save_every_minutes", self.save_every_minutes, allow_zero=True)
        if self.keep_checkpoints is not None:
            check_positive("keep_checkpoints", self.keep_checkpoints)
        check_positive("max_skipped_updates", self.max_skipped_updates, allow_zero=True)
        sections = ("model", "data", "rollout", "reward", "kl", "loss", "optim", "critic", "ptx")
        for name in (*sections, "dynamic_sampling", "distributed", "env"):
            getattr(self, name).validate(name)
        check_agent(self)
        if self.eval_every and self.data.eval_size == 0:
            raise ConfigError(
                f"eval_every={self.eval_every} with data.eval_size=0 would evaluate no problem; set "
                "data.eval_size > 0 (held-out problems per evaluation) or eval_every=0"
            )
        self._validate_code_rewards()
        truncated = self.rollout.top_k or self.rollout.top_p < 1.0
        if kl_placement_spec(self.kl.placement).needs_reference and truncated:
            raise ConfigError(
                f"kl.placement={self.kl.placement!r} with rollout.top_k/top_p truncation is not supported: "
                "the truncated sampler's log-probs are not comparable to the reference's full softmax, so "
                "the KL would not be 0 even for an unchanged policy; set rollout.top_k=0 and "
                "rollout.top_p=1.0, or kl.placement=none"
            )
        validate_policy_loss(self)
        validate_estimator(self)
        check_episode_options(self)
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
        self._validate_staleness()
        self._validate_dynamic_sampling()

    def _validate_staleness(self) -> None:
        k = self.rollout.max_staleness
        if self.steps and k >= self.steps:
            raise ConfigError(
                f"rollout.max_staleness={k} is not below steps={self.steps}: every batch would be sampled by "
                f"the initial weights, and the {k} batches after the last step (kept for a resume) would "
                "cost more sampling than the run; use a max_staleness below steps (1 or 2 is typical)"
            )

    def _validate_reporting_and_eval(self) -> None:
        trackers = ("tensorboard", "wandb", "mlflow", "trackio", "none")
        for i, name in enumerate(self.report_to):
            check_choice(f"report_to[{i}]", name, set(trackers))
        if len(set(self.report_to)) != len(self.report_to):
            raise ConfigError(f"report_to={self.report_to} names a tracker twice; name each once")
        if "none" in self.report_to and len(self.report_to) > 1:
            raise ConfigError(f"report_to={self.report_to}: 'none' cannot be combined with trackers; drop it")
        if not self.project.strip():
            raise ConfigError("project must be a non-empty name (W&B / trackio project, MLflow experiment)")
        check_positive("eval_samples", self.eval_samples, allow_zero=True)
        check_positive("eval_temperature", self.eval_temperature)
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
        names = self.reward_components + (["return"] if self.env.name else [])
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
    def kl_placement(self):
        """The registered :class:`~policygrad.core.kl.KLPlacement` of ``kl.placement`` (its torch
        functions; its declaration, torch-free, is ``specs.kl.kl_placement_spec``)."""
        from policygrad.core.kl import get_kl_placement  # torch: keeps `import policygrad.config` light

        return get_kl_placement(self.kl.placement)

    @property
    def dynamic_sampling_reward(self) -> str:
        """The reward component whose within-group variance decides dynamic sampling:
        ``dynamic_sampling.reward``, or by default ``return`` with an environment (each sample's
        whole raw return) and the first of :attr:`reward_components` without one."""
        return self.dynamic_sampling.reward or ("return" if self.env.name else self.reward_components[0])

    @property
    def reward_components(self) -> list[str]:
        """The names of the scores' components: ``env`` (the episode's return: final reward
        plus turn rewards) with an environment, then one per entry of ``reward.functions``."""
        return (["env"] if self.env.name else []) + reward_component_names(self.reward.functions)

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
# Loading the tree from a YAML file and overrides (built by ``build_dataclass``).


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
            if arg.endswith((".yaml", ".yml")):  # a recipe given after the options
                raise ConfigError(
                    f"the config file {arg!r} must come first: policygrad train {arg} --key=value ..."
                )
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
    return build_dataclass(TrainConfig, data)
