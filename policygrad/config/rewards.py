"""The reward sections of the configuration tree: :class:`RewardConfig` (the functions, their
weights, errors, truncation, normalisation, isolation) with the sandbox of
:class:`CodeRewardConfig`, and :func:`reward_component_names`. :mod:`policygrad.config.train`
re-exports them."""

from __future__ import annotations

from dataclasses import dataclass, field

from policygrad.config.sections import ConfigError, check_choice, check_positive

__all__ = ["CodeRewardConfig", "RewardConfig", "reward_component_names"]


@dataclass
class CodeRewardConfig:
    """The sandbox of the ``code_tests`` reward (and of evaluation on code rows); see
    :mod:`policygrad.sandbox.runner` for what each isolation mode isolates and the threat model.

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
        check_choice(f"{path}.isolation", self.isolation, {"auto", "bwrap", "namespaces", "none"})
        check_positive(f"{path}.timeout_s", self.timeout_s)
        if self.memory_mb < 64:
            raise ConfigError(
                f"{path}.memory_mb must be >= 64 (an interpreter needs it), got {self.memory_mb}"
            )
        for name in ("max_processes", "max_write_mb", "max_output_kb"):
            check_positive(f"{path}.{name}", getattr(self, name))
        check_positive(f"{path}.workers", self.workers, allow_zero=True)


@dataclass
class RewardConfig:
    """Reward functions, summed with weights.

    ``functions``: built-in names (``answer_correctness``, ``answer_format``, ``length_penalty``,
    ``code_tests``: the row's tests run against the completion's program in the sandbox that
    ``code`` configures, :class:`CodeRewardConfig`), ``module:function`` or ``path.py:function``.
    ``weights``: one per function (default 1 each). Unset (null), ``functions`` is
    ``[answer_correctness]`` without an environment and ``[]`` with one (the environment's
    ``final_reward`` scores the episode; functions given with one score its final answer, the
    transcript in the row field ``transcript``).
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

    functions: list[str] | None = None
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
            check_positive(f"{path}.timeout_s", self.timeout_s)
        functions, weights = self.functions, self.weights
        if functions is not None and weights is not None and len(weights) != len(functions):
            raise ConfigError(
                f"{path}.weights has {len(self.weights)} entries for {len(self.functions)} functions; "
                "give one weight per function or leave it unset"
            )
        if weights and not any(weights):
            raise ConfigError(
                f"{path}.weights={list(weights)} are all 0: every score would be 0, so no sample is told "
                "apart and nothing trains; give at least one function a non-zero weight"
            )
        check_choice(f"{path}.on_error", self.on_error, {"raise", "skip"})
        check_choice(f"{path}.truncation", self.truncation, {"none", "penalty", "exclude"})
        check_choice(f"{path}.normalize", self.normalize, {"none", "fixed_offset", "running"})
        if self.normalize_clip is not None:
            check_positive(f"{path}.normalize_clip", self.normalize_clip)
        check_positive(f"{path}.model_batch_size", self.model_batch_size)
        if self.model_max_length < 2:
            raise ConfigError(f"{path}.model_max_length must be >= 2, got {self.model_max_length}")


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
