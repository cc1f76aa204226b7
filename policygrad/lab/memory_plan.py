"""Which models an algorithm keeps in memory, the bill of one configuration (:func:`plan_memory`;
the accounting: :mod:`policygrad.lab.memory`), and the bill as a text table."""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Mapping

from policygrad.lab.common import fmt, format_table
from policygrad.lab.memory_bill import (
    BYTES_FROZEN,
    SHARDED,
    STRATEGIES,
    MemoryItem,
    MemoryPlan,
    format_count,
    model_items,
    reference_item,
    sharded_item,
    unsharded_copy_item,
)
from policygrad.parallel.footprint import BYTES_BF16, ModelShape, format_gb

__all__ = [
    "SFT_MODELS",
    "AlgorithmModels",
    "algorithm_models",
    "check_options",
    "memory_table",
    "plan_memory",
]


@dataclasses.dataclass(frozen=True)
class AlgorithmModels:
    """Which models an algorithm keeps in memory.

    Fields:
        critic: a trainable value model the size of the policy (actor-critic).
        reference: a frozen reference for the KL term (can be dropped with ``reference=False``).
        description: one line for the table.
        value_rollouts: the estimator samples K extra continuations from states inside each
            response every step (VinePPO's Monte-Carlo values, Kazemnejad et al. 2024).
    """

    critic: bool
    reference: bool
    description: str
    value_rollouts: bool = False


SFT_MODELS = AlgorithmModels(
    critic=False, reference=False, description="supervised fine-tuning: the policy alone"
)
"""``sft``: the baseline every bill is compared with (not a trainer algorithm)."""


@functools.cache
def algorithm_models() -> Mapping[str, AlgorithmModels]:
    """``sft`` and every algorithm the trainer knows, read from its registry
    (:data:`policygrad.config.train.ALGORITHMS`), so a new preset has a bill: a critic when the
    preset trains one, and a reference (for a KL to it) for every RL algorithm."""
    # imported here: trainer.config loads torch, and this module must import without it
    from policygrad.config.train import ALGORITHMS
    from policygrad.core.advantages import estimator_spec

    table = {"sft": SFT_MODELS}
    for name, preset in ALGORITHMS.items():
        critic = "a critic" if preset.critic else "no critic"
        table[name] = AlgorithmModels(
            critic=preset.critic,
            reference=True,
            description=f"{preset.estimator} advantages, {critic}",
            value_rollouts="vine_values" in estimator_spec(preset.estimator).inputs,
        )
    return types.MappingProxyType(table)


def _check_algorithm(algorithm: str) -> AlgorithmModels:
    table = algorithm_models()
    if algorithm not in table:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(sorted(table))}")
    return table[algorithm]


def check_options(
    algorithm: str,
    *,
    lora_rank: int = 0,
    batch: int | None = None,
    seq_len: int | None = None,
    inference_engine: bool = False,
    reward_model: bool = False,
    critic_params: int | None = None,
    reward_params: int | None = None,
    world_size: int = 1,
    strategy: str = "ddp",
    servers: int = 0,
) -> AlgorithmModels:
    """The checks of :func:`plan_memory` that need no model shape, so ``policygrad memory`` refuses
    a bad option before it reads (or converts) any model.

    Returns:
        the models ``algorithm`` needs.

    Raises:
        ValueError: as :func:`plan_memory` (names the option).
    """
    needs = _check_algorithm(algorithm)
    if strategy not in STRATEGIES:
        raise ValueError(f"--strategy must be ddp or fsdp, got {strategy!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"--world-size must be an int >= 1, got {world_size!r}")
    if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
        raise ValueError(f"--lora-rank must be an int >= 0 (0 = full fine-tune), got {lora_rank!r}")
    if strategy == SHARDED and world_size > 1 and lora_rank:  # train refuses it (one process: no strategy)
        # imported here: the trainer package loads torch, and this module must import without it
        from policygrad.errors import fsdp_lora_refusal

        raise ValueError(fsdp_lora_refusal(strategy="--strategy", lora="--lora-rank", ddp="--strategy ddp"))
    if (batch is None) != (seq_len is None):
        raise ValueError("give --batch and --seq-len together (the logits and KV cache are B x T)")
    for name, value in (
        ("--batch", batch),
        ("--seq-len", seq_len),
        ("--critic-params", critic_params),
        ("--reward-params", reward_params),
    ):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if isinstance(servers, bool) or not isinstance(servers, int) or servers < 0:
        raise ValueError(f"--servers must be an int >= 0, got {servers!r}")
    if algorithm == "sft" and (inference_engine or reward_model or servers):
        raise ValueError(
            "sft samples nothing and scores nothing: drop --inference-engine, --servers and --reward-model"
        )
    if critic_params is not None and lora_rank and needs.critic:
        raise ValueError(
            "--critic-params with --lora-rank: the critic's adapters are counted from the "
            "policy's layers; drop --critic-params"
        )
    return needs


def plan_memory(
    shape: ModelShape,
    algorithm: str = "grpo",
    *,
    lora_rank: int = 0,
    lora_targets: str | list[str] = "all-linear",
    batch: int | None = None,
    seq_len: int | None = None,
    inference_engine: bool = False,
    reward_model: bool = False,
    reference: bool | None = None,
    critic_params: int | None = None,
    reward_params: int | None = None,
    world_size: int = 1,
    strategy: str = "ddp",
    vine_rollouts: int = 9,
    vine_splits: int = 8,
    servers: int = 0,
) -> MemoryPlan:
    """The memory bill of ``algorithm`` on a model of ``shape`` (see the module docstring).

    Args:
        shape: from :func:`resolve_shape` or :func:`model_shape_from_config`.
        algorithm: a key of :func:`algorithm_models` (``sft``, ``ppo``, ``grpo``, ``rloo``, ...).
        lora_rank: 0 for a full fine-tune, r >= 1 for LoRA adapters on ``lora_targets``.
        lora_targets: ``"all-linear"`` or module-name suffixes.
        batch: B sequences (logits and KV cache; both need ``seq_len`` too).
        seq_len: T tokens per sequence (prompt + response).
        inference_engine: add a separate engine's bf16 copy of the policy and its KV cache.
        reward_model: add a frozen reward model (the reward comes from a model, not a verifier).
        reference: keep the frozen reference; None = the algorithm's default (a KL is used).
        critic_params: critic size (default: the policy's, as when the critic is initialised from
            the policy or from a reward model of the policy's size).
        reward_params: reward-model size (default: the policy's).
        world_size: ranks N (every figure is one rank's).
        strategy: ``ddp`` (whole models on every rank) or ``fsdp`` (policy, critic and reference
            sharded N ways; the reward model and the engine's copy whole).
        vine_rollouts, vine_splits: K and S of an algorithm with VinePPO's value rollouts
            (``advantage.options.rollouts`` / ``max_splits``): every step samples up to
            ``B x (S + 1) x K`` more sequences (K from each of at most S split points of a response
            and from its prompt), counted in the table; no more memory (the trainer samples them
            in calls of at most B sequences, after the batch's, so the KV cache above holds them).
        servers: rollout server processes (``rollout.engine: server``), each priced apart from
            the trainer: a bf16 copy of the policy and the KV cache of its share of the batch (the
            batch's prompts are spread over the servers).

    Returns:
        :class:`MemoryPlan`; its ``table`` is filled, no file is written.

    Raises:
        ValueError: unknown algorithm (lists the valid ones); negative LoRA rank; batch without
            seq_len or the reverse; non-positive sizes; LoRA without linear-layer shapes; ``sft``
            with an inference engine or a reward model.
    """
    needs = check_options(
        algorithm,
        lora_rank=lora_rank,
        batch=batch,
        seq_len=seq_len,
        inference_engine=inference_engine,
        reward_model=reward_model,
        critic_params=critic_params,
        reward_params=reward_params,
        world_size=world_size,
        strategy=strategy,
        servers=servers,
    )
    if shape.params <= 0:
        raise ValueError(f"the model's parameter count must be > 0, got {shape.params}")
    use_reference = needs.reference if reference is None else bool(reference and needs.reference)
    full_copy = strategy == SHARDED and world_size > 1 and algorithm != "sft"
    lora = shape.lora_params(lora_rank, lora_targets) if lora_rank else 0
    p = shape.params

    items = model_items("policy", p, True, lora)
    if use_reference:
        items.append(reference_item(p, lora))
    if reward_model:
        items += model_items("reward model", reward_params or p, False, 0, "frozen, bf16")
    if needs.critic:
        cp = critic_params or p
        critic_lora = lora if (lora and critic_params is None) else 0
        items += model_items("critic", cp, True, critic_lora)
    if full_copy:
        items.append(unsharded_copy_item(p, inference_engine))
    if inference_engine:
        items.append(
            MemoryItem(
                "inference engine",
                "frozen",
                p,
                BYTES_FROZEN,
                p * BYTES_FROZEN,
                "a bf16 copy of the policy" + (" (adapters merged)" if lora else ""),
            )
        )
    if strategy == SHARDED and world_size > 1:
        items = [sharded_item(it, shape, world_size) for it in items]
    local_batch = -(-batch // world_size) if batch is not None else None  # this rank's sequences
    state_bytes = sum(it.bytes for it in items)
    if inference_engine and batch is not None:
        kv = shape.kv_cache_bytes(local_batch, seq_len)
        items.append(
            MemoryItem(
                "KV cache",
                "activation",
                None,
                None,
                kv,
                f"2 (K, V) x {shape.num_layers} layers x kv width {shape.num_kv_heads * shape.head_dim} "
                f"x B {local_batch} x T {seq_len} x 2 B",
            )
        )
    if batch is not None and shape.vocab_size:
        logits = local_batch * seq_len * shape.vocab_size * BYTES_BF16
        items.append(
            MemoryItem(
                "logits B x T x V",
                "activation",
                None,
                None,
                logits,
                f"{local_batch} x {seq_len} x {shape.vocab_size} x 2 B (bf16), if materialised",
            )
        )
    extra_sequences = extra_tokens = 0
    if needs.value_rollouts and batch is not None:
        extra_sequences, extra_tokens = _value_rollouts(local_batch, seq_len, vine_rollouts, vine_splits)
    total = sum(it.bytes for it in items)
    sft_items = model_items("policy", p, True, lora)
    if strategy == SHARDED and world_size > 1:
        sft_items = [sharded_item(it, shape, world_size) for it in sft_items]
    sft = sum(it.bytes for it in sft_items)
    plan = MemoryPlan(
        algorithm=algorithm,
        lora_rank=lora_rank,
        batch=batch,
        seq_len=seq_len,
        inference_engine=inference_engine,
        reward_model=reward_model,
        reference=use_reference,
        shape=shape,
        items=items,
        state_bytes=state_bytes,
        total_bytes=total,
        sft_state_bytes=sft,
        ratio_to_sft=state_bytes / sft,
        world_size=world_size,
        strategy=strategy,
        value_rollout_sequences=extra_sequences,
        value_rollout_tokens=extra_tokens,
    )
    plan.servers, plan.server_items = servers, _server_items(shape, p, lora, batch, seq_len, servers)
    plan.table = memory_table(plan)
    return plan


def _server_items(
    shape: ModelShape, params: int, lora: int, batch, seq_len, servers: int
) -> list[MemoryItem]:
    """One rollout server's bill: its weights and the KV cache of its share of the batch (none
    without servers)."""
    if not servers:
        return []
    items = [
        MemoryItem(
            "server weights",
            "frozen",
            params,
            BYTES_FROZEN,
            params * BYTES_FROZEN,
            "a bf16 copy of the policy" + (" (adapters merged)" if lora else ""),
        )
    ]
    if batch is not None:
        share = -(-batch // servers)
        items.append(
            MemoryItem(
                "server KV cache",
                "activation",
                None,
                None,
                shape.kv_cache_bytes(share, seq_len),
                f"2 (K, V) x {shape.num_layers} layers x kv width {shape.num_kv_heads * shape.head_dim} "
                f"x B {share} (of {batch}, over {servers} servers) x T {seq_len} x 2 B",
            )
        )
    return items


def _value_rollouts(batch: int, seq_len: int, rollouts: int, splits: int) -> tuple[int, int]:
    """VinePPO's value rollouts of one rank's ``batch`` sequences: (sequences, a bound on their
    tokens). They hold no memory beyond the batch's: the trainer samples them in engine calls of
    at most ``batch`` sequences of at most ``seq_len`` tokens, after the batch's own.

    Raises:
        ValueError: ``rollouts`` < 1 or ``splits`` < 0 (names the option).
    """
    for name, value, low in (("--vine-rollouts", rollouts, 1), ("--vine-splits", splits, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    sequences = batch * (splits + 1) * rollouts
    return sequences, sequences * seq_len  # a bound: a continuation is shorter than the whole sequence


def memory_table(plan: MemoryPlan) -> str:
    """The bill as text: one line per item, then the totals and the comparison with SFT."""
    rows = [
        [
            it.component,
            it.state,
            format_count(it.params),
            fmt(it.bytes_per_param, 3) if it.bytes_per_param is not None else "-",
            format_gb(it.bytes),
            it.note,
        ]
        for it in plan.items
    ]
    table = format_table(["component", "state", "params", "B/param", "GB", "how"], rows)
    lines = [
        f"memory bill: {plan.algorithm} ({algorithm_models()[plan.algorithm].description}); model "
        f"{format_count(plan.shape.params)} params ({plan.shape.source})"
        + (f", LoRA r={plan.lora_rank}" if plan.lora_rank else "")
        + (f"; per rank of {plan.world_size} ({plan.strategy})" if plan.world_size > 1 else ""),
        table,
        "",
        f"weights + grads + optimiser state: {format_gb(plan.state_bytes)} GB "
        f"({plan.ratio_to_sft:.2f}x SFT of the same model: {format_gb(plan.sft_state_bytes)} GB)",
        f"with KV cache and logits:          {format_gb(plan.total_bytes)} GB "
        "(activations and fragmentation not counted; GB = 1e9 bytes)",
    ]
    if plan.servers:
        each = sum(it.bytes for it in plan.server_items)
        lines.append(
            f"rollout servers, apart from the trainer: {plan.servers} x {format_gb(each)} GB = "
            f"{format_gb(plan.servers * each)} GB ("
            + "; ".join(f"{it.component} {format_gb(it.bytes)} GB" for it in plan.server_items)
            + " each)"
        )
    if plan.value_rollout_sequences:
        lines.append(
            f"VinePPO value rollouts per step: up to {plan.value_rollout_sequences:,} sequences, "
            f"{plan.value_rollout_tokens:,} tokens (the batch: {-(-plan.batch // plan.world_size):,} "
            "sequences; sampled that many at a time, so no more memory)"
        )
    return "\n".join(lines)
