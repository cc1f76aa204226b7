"""The ``agent`` section: a user's agent function trained as episodes (:mod:`policygrad.envs.agent`).

An agent is an environment to the episode runner: :func:`apply_agent` turns ``agent.function``
into ``env.name`` = :data:`AGENT_ENVIRONMENT` with the function as its option, and the agent's
``timeout_s`` and ``retries`` into ``rollout.env_step_timeout_s`` and ``rollout.env_retries``, so
every episode option (``rollout.max_turns``, ``max_episode_tokens``, ``env_workers``,
``env_isolation``, ``env_error_budget``) applies to agents as to environments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policygrad.config.checks import MAX_ENV_RETRIES, ConfigError, check_positive
from policygrad.specs.kl import kl_placement_spec

__all__ = [
    "AGENT_ENVIRONMENT",
    "REWRITTEN_HISTORY",
    "SEGMENTS_FIX",
    "AgentConfig",
    "agent_options",
    "apply_agent",
    "check_agent",
    "episode_fields",
    "segments_refused",
]

AGENT_ENVIRONMENT = "policygrad.envs.agent:AgentEnv"
REWRITTEN_HISTORY = ("segment", "fail")
# RolloutConfig's defaults of the two options an agent sets (kept equal by a test).
_STEP_TIMEOUT_DEFAULT, _RETRIES_DEFAULT = 60.0, 1
MAX_AGENT_TIMEOUT_S = 86400.0


@dataclass
class AgentConfig:
    """A user's agent (:mod:`policygrad.envs.agent`); without one, no agent.

    ``function``: ``path/to/file.py:run`` or ``package.module:run``, an ``async def run(client,
    row)`` (or a plain function) returning the episode's reward (a number, or a dict of named
    numbers that are summed); a function given to ``policygrad.train(agent=...)`` is recorded by
    import path. ``timeout_s``: the most seconds of the agent's own work before its first model
    call, between two calls, or to its return (the model's time is not counted); over it the
    episode fails (and its worker process is killed). ``retries``: fresh sessions of an episode
    that failed (at most 10), after which its group leaves the batch. ``rewritten_history``: a
    call whose messages do not extend the session's earlier ones (a library that trims or
    rewrites its history) starts a new ``segment`` of the episode, trained with the episode's
    advantage (this needs one advantage per episode: an outcome estimator, no critic, no KL in
    the reward), or ``fail``s it.
    """

    function: str | None = None
    timeout_s: float = 120.0
    retries: int = 1
    rewritten_history: str = "segment"

    def validate(self, path: str) -> None:
        recorded = isinstance(self.function, str) and self.function.startswith(
            "<"
        )  # a function given in memory
        if (
            self.function is not None
            and (not isinstance(self.function, str) or ":" not in self.function)
            and not recorded
        ):
            raise ConfigError(
                f"{path}.function must be 'path/to/file.py:function' or 'package.module:function', got "
                f"{self.function!r}"
            )
        check_positive(f"{path}.timeout_s", self.timeout_s)
        if self.timeout_s > MAX_AGENT_TIMEOUT_S:
            raise ConfigError(
                f"{path}.timeout_s must be at most {MAX_AGENT_TIMEOUT_S:g} (a day), got {self.timeout_s!r}"
            )
        retries = self.retries
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_ENV_RETRIES:
            raise ConfigError(f"{path}.retries must be an int in [0, {MAX_ENV_RETRIES}], got {retries!r}")
        if self.rewritten_history not in REWRITTEN_HISTORY:
            raise ConfigError(
                f"{path}.rewritten_history must be one of {', '.join(REWRITTEN_HISTORY)}, got "
                f"{self.rewritten_history!r}"
            )


def apply_agent(config: Any) -> None:
    """With ``agent.function`` set, make ``config`` (a ``TrainConfig``) an episode run of the
    agent environment (module docstring); nothing otherwise. Refuses what would be silently
    overridden.

    Raises:
        ConfigError: ``env.name`` names another environment; ``rollout.env_step_timeout_s`` or
            ``rollout.env_retries`` set to other values than the agent's.
    """
    agent = config.agent
    if agent.function is None:
        if config.env.name == AGENT_ENVIRONMENT:
            raise ConfigError(
                f"env.name={AGENT_ENVIRONMENT!r} is set by agent.function; set agent.function instead"
            )
        return
    agent.validate("agent")
    env, rollout = config.env, config.rollout
    # A saved agent config (a new run from it, or a resume) holds what an earlier apply derived:
    # env.name is the agent environment and the two rollout fields are the agent's; the agent
    # section decides them again.
    derived = env.name == AGENT_ENVIRONMENT and set(env.options) <= {"function", "rewritten_history"}
    if not derived and (env.name is not None or env.options):
        raise ConfigError(
            f"agent.function and env.name={env.name!r} (or env.options) are both set; an agent is its own "
            "environment: drop env (or agent.function)"
        )
    for name, value, default, field in (
        ("env_step_timeout_s", float(agent.timeout_s), _STEP_TIMEOUT_DEFAULT, "timeout_s"),
        ("env_retries", agent.retries, _RETRIES_DEFAULT, "retries"),
    ):
        if not derived and getattr(rollout, name) not in (default, value):
            raise ConfigError(f"rollout.{name} does not apply to an agent; set agent.{field} instead")
        setattr(rollout, name, value)
    env.name, env.options = AGENT_ENVIRONMENT, agent_options(agent)


def agent_options(agent: AgentConfig) -> dict[str, Any]:
    """The agent environment's options (``env.options``) of an agent section."""
    return {"function": agent.function, "rewritten_history": agent.rewritten_history}


def check_agent(config: Any) -> None:
    """After :func:`apply_agent`: the agent section is valid and still in step with ``env``.

    Raises:
        ConfigError: naming the field.
    """
    config.agent.validate("agent")
    if config.agent.function is not None and (
        config.env.name != AGENT_ENVIRONMENT or config.env.options != agent_options(config.agent)
    ):
        raise ConfigError(
            "agent.function and env.name are both set; an agent is its own environment: drop env.name"
        )
    if config.agent.function is not None and config.agent.rewritten_history == "segment":
        check_segments(config)
    if config.agent.function is None and config.env.name == AGENT_ENVIRONMENT:
        raise ConfigError(
            f"env.name={AGENT_ENVIRONMENT!r} is set by agent.function; set agent.function instead"
        )


def segments_refused(config: Any) -> str | None:
    """Why ``config`` cannot train an episode's earlier segments with the episode's one advantage
    (:mod:`policygrad.learn.segments`), or None: a critic's per-token advantages, a KL penalty in
    the per-token rewards, or discounting (``advantage.options.gamma`` < 1; estimators with
    inputs, ReMax and VinePPO, take no episodes at all)."""
    spec = config.estimator_spec
    gamma = config.estimator_options.get("gamma", 1.0)
    if spec.needs_values:
        return f"the {spec.name} estimator's per-token advantages (a critic)"
    if kl_placement_spec(config.kl.placement).shapes_rewards:
        return f"kl.placement={config.kl.placement} (a KL penalty on each token's reward)"
    if isinstance(gamma, (int, float)) and gamma < 1:
        return f"advantage.options.gamma={gamma} (a discount over an episode's tokens)"
    return None


SEGMENTS_FIX = "use an outcome estimator (grpo, rloo, reinforce) with kl.placement=loss or none"


def check_segments(config: Any) -> None:
    """Refuse an agent run that restarts episodes (``agent.rewritten_history=segment``) with what
    cannot train segments (:func:`segments_refused`).

    Raises:
        ConfigError: naming the option and the two ways out.
    """
    why = segments_refused(config)
    if why is not None:
        raise ConfigError(
            "agent.rewritten_history=segment trains an episode's earlier segments with the episode's one "
            f"advantage, which {why} does not give; {SEGMENTS_FIX}, or set agent.rewritten_history=fail"
        )


def episode_fields(config: Any) -> dict[str, str]:
    """How messages name what a run's episodes come from: ``source`` (``env.name=X`` or
    ``agent.function=Y``), ``rewards`` (whose rewards they are), and the options of their
    ``retries`` and ``timeout``."""
    if config.agent.function is not None:
        source = f"agent.function={config.agent.function}"
        return {
            "source": source,
            "rewards": f"the agent's rewards ({source})",
            "retries": "agent.retries",
            "timeout": "agent.timeout_s",
        }
    source = f"env.name={config.env.name}"
    return {
        "source": source,
        "rewards": f"the environment's rewards ({source})",
        "retries": "rollout.env_retries",
        "timeout": "rollout.env_step_timeout_s",
    }
