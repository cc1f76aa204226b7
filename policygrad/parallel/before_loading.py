"""A run's memory plan from its files (:func:`plan_run_from_config`: the policy's ``config.json``,
its tokenizer and the first training rows, no weights), and the check every CPU run makes with it
before its first model loads (:func:`check_before_loading`). The arithmetic is
:mod:`policygrad.parallel.run_memory`'s."""

from __future__ import annotations

import logging
import os

import torch

from policygrad.config.checks import read_chat_template
from policygrad.data.chat import encode_prompts
from policygrad.data.sources import build_train_source
from policygrad.models.adapters import resolve_model_source
from policygrad.models.loading import load_tokenizer
from policygrad.parallel.footprint import available_memory_bytes, format_gb, model_shape_from_config
from policygrad.parallel.precision import resolve_precision
from policygrad.parallel.run_memory import PROCESS_BYTES, RunPlan, check_run_fits, plan_run
from policygrad.rewards.reward_model import reward_model_folder

__all__ = [
    "PROMPT_SAMPLE",
    "NotPlanned",
    "available_to_a_run",
    "check_before_loading",
    "longest_prompt",
    "plan_run_from_config",
    "reward_model_params",
]

log = logging.getLogger("policygrad")

PROMPT_SAMPLE = 256
"""Training rows read to find the longest prompt."""


class NotPlanned(ValueError):
    """The policy's config lacks a size the plan's activation arithmetic needs (its hidden size,
    layer count or MLP width: GPT-2's configs name no ``intermediate_size``, for one)."""


def longest_prompt(cfg, tokenizer, train_source) -> int:
    """The longest of the first :data:`PROMPT_SAMPLE` training prompts, in tokens, as the run
    formats and tokenizes them; ``data.max_prompt_length`` when one is longer (the run refuses it
    by name later) or when the rows have no prompt to read (an environment's opening)."""
    try:
        rows = [train_source.train_row(i) for i in range(PROMPT_SAMPLE)]
        return max(map(len, encode_prompts(tokenizer, rows, cfg.data)))
    except (ValueError, KeyError, TypeError, IndexError):
        return cfg.data.max_prompt_length


def reward_model_params(folder: str) -> int:
    """Parameters of the ``AutoModelForSequenceClassification`` saved in ``folder``, from its
    ``config.json`` on the ``meta`` device (no weights read).

    Raises:
        ValueError: the folder has no readable config (its loading names the problem next).
    """
    # imported here: transformers is heavy, and only a run with a reward model needs this
    from transformers import AutoConfig, AutoModelForSequenceClassification

    try:
        config = AutoConfig.from_pretrained(os.path.expanduser(folder), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"reward model {folder!r}: cannot read its config.json ({e})") from None
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    return sum(p.numel() for p in model.parameters())


def plan_run_from_config(
    cfg,
    *,
    tokenizer=None,
    train_source=None,
    world_size: int = 1,
    precision: str | None = None,
    engine: str | None = None,
) -> RunPlan | None:
    """:func:`~policygrad.parallel.run_memory.plan_run` of ``cfg`` on this host's CPU: the policy's
    shape from its ``config.json`` (no weights read), ``precision`` (None: what ``model.precision``
    resolves to here), each reward model's parameters (:func:`reward_model_params`), ``engine``
    (None: what ``rollout.engine`` resolves to; ``given`` for an engine object the run is given,
    whose memory is not planned), and the longest prompt
    (:func:`longest_prompt`; the tokenizer and the training rows are read when not given).

    Returns:
        the plan, or None for a run that starts from a trained adapter (its rank and targets are
        the adapter's, unknown until it loads).

    Raises:
        NotPlanned: the model's config lacks the sizes the plan needs (named).
        ValueError / ConfigError: the model or data cannot be read.
    """
    source = resolve_model_source(cfg.model.name, cfg.model.adapter)
    if source.adapter is not None:
        return None
    if precision is None:
        m = cfg.model
        precision = resolve_precision(
            m.precision, torch.device("cpu"), model_dtype=m.dtype, lm_head_dtype=m.lm_head_dtype
        ).name
    shape = model_shape_from_config(source.base)
    missing = [
        name
        for name, value in (
            ("hidden_size", shape.hidden_size),
            ("num_hidden_layers", shape.num_layers),
            ("intermediate_size", shape.intermediate_size),
        )
        if not value
    ]
    if missing:
        raise NotPlanned(f"{source.base}'s config.json names no {', '.join(missing)}")
    if tokenizer is None:
        tokenizer = load_tokenizer(source.tokenizer, trust_remote_code=cfg.model.trust_remote_code)
        if cfg.data.chat_template:  # as the run formats its prompts
            tokenizer.chat_template = read_chat_template(cfg.data.chat_template)
    if train_source is None:
        train_source = build_train_source(cfg.data, seed=cfg.seed)
    if engine is None:
        engine, _ = cfg.rollout.resolved_engine()
    model_bytes = 2 if cfg.model.dtype in ("bfloat16", "float16") else 4  # ``auto`` is float32 on a CPU
    # a local model folder only, as the loader reads it (which names any other entry's problem)
    folders = [f for f in map(reward_model_folder, cfg.reward.functions) if f]
    folders = [f for f in folders if os.path.isfile(os.path.join(os.path.expanduser(f), "config.json"))]
    return plan_run(
        cfg,
        shape,
        prompt_tokens=longest_prompt(cfg, tokenizer, train_source),
        precision=precision,
        engine=engine,
        model_dtype_bytes=model_bytes,
        world_size=world_size,
        sharded=cfg.distributed.resolved("cpu") == "fsdp",
        reward_models=tuple((f, reward_model_params(f)) for f in folders),
    )


def available_to_a_run(read_available=None, processes: int = 1) -> int:
    """The memory a run of ``processes`` processes on this host (this one and its peers at the
    same point) can use: the host's available memory and what each already holds, up to the
    plan's "process" line (:data:`~policygrad.parallel.run_memory.PROCESS_BYTES`), which counts
    it; more than that (a notebook holding a model) stays used. ``read_available``: a seam for
    tests (None: :func:`~policygrad.parallel.footprint.available_memory_bytes`)."""
    held = min(_resident_bytes(), PROCESS_BYTES)
    return (read_available or available_memory_bytes)() + processes * held


def _resident_bytes() -> int:
    """This process's resident set size in bytes (``/proc/self/statm``; 0 where there is none)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def check_before_loading(
    cfg,
    *,
    train_source,
    precision: str,
    world_size: int = 1,
    processes: int = 1,
    engine: str | None = None,
    read_available=None,
) -> RunPlan | None:
    """The run's plan (:func:`plan_run_from_config`), refused by
    :func:`~policygrad.parallel.run_memory.check_run_fits` when it cannot fit the memory available
    on this host. A plan that cannot be made is skipped and the run goes on unchecked, saying so
    at info level (a model config without the sizes the plan needs; a model or data that cannot
    be read, whose loading names the problem next), or at debug level for an adapter to start
    from.

    Args:
        processes: the run's processes on this host (``LOCAL_WORLD_SIZE`` under torchrun).
        engine: as :func:`plan_run_from_config`'s (``given``: the run was given an engine object).
        read_available: a seam for tests (None: the host's available memory).

    Raises:
        ConfigError: the plan does not fit.
    """
    try:
        plan = plan_run_from_config(
            cfg, train_source=train_source, world_size=world_size, precision=precision, engine=engine
        )
    except ValueError as e:  # NotPlanned, or files the models' own loading names next
        log.info("memory: not planned, so not checked against this machine (%s)", e)
        return None
    if plan is None:
        log.debug("memory plan skipped: the run starts from an adapter")
        return None
    available = available_to_a_run(read_available, processes)
    check_run_fits(cfg, plan, available_bytes=available, processes=processes)
    log.info(
        "memory: planned peak %s GB of %s GB available (policygrad memory --config prints the plan)",
        format_gb(plan.peak_bytes * processes),
        format_gb(available),
    )
    return plan
