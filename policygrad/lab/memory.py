"""The memory bill of an RL post-training job, before it runs (``policygrad memory``).

Accounting (Rajbhandari et al. 2019, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", section 3.1, for the bytes per parameter; the policy, reference, reward model and value
model of RLHF-PPO as in Ziegler et al. 2019 and Ouyang et al. 2022):

- a trainable parameter costs 16 bytes with mixed-precision Adam as the trainer runs it: fp32
  master weights (4), fp32 gradients (4) and two fp32 Adam moments (4 + 4), bf16 copies of the
  weights made only for compute (ZeRO's count, bf16 weights and gradients plus an fp32 master
  copy, also comes to 16);
- a frozen parameter costs 2 bytes (bf16 weights only), except the reference's: 4 (float32, like
  the policy's master weights, so that it computes the policy's own log-probs under the same
  autocast and the KL is 0 before the first update);
- the models: the policy (trainable); a reference (frozen, when a KL to it is used); a reward
  model (frozen, only when the reward comes from a model: a verifier needs none); a critic the
  size of the policy (trainable, PPO only); an inference engine's copy of the policy (frozen bf16
  weights) plus its KV cache ``2 (K and V) x layers x kv_heads x head_dim x B x T x 2 bytes``;
- with LoRA the base weights are frozen (2 B/param) and only the adapters are trainable
  (16 B/param); an adapter on a linear layer ``in -> out`` has ``r * (in + out)`` parameters
  (Hu et al. 2021, eq. 3), and the reference is the base with the adapters switched off (no copy);
- the logits tensor ``B x T x V`` in bf16, which computing log-probs materialises unless it is
  chunked or fused.

Per rank (``--world-size N --strategy ddp|fsdp``, as ``torchrun`` runs the trainer): with ``ddp``
every rank holds every model whole; with ``fsdp`` (Zhao et al. 2023, "PyTorch FSDP"; ZeRO stage 3)
the policy, critic and reference are sharded, so a rank holds 1/N of their weights, gradients and
optimiser state (each parameter split along its first dimension, padded to a multiple of N when
the shapes are known), while the reward model and the inference engine's copy stay whole; the
KV cache and the logits are of the rank's B/N sequences.

The activations saved for the backward (:func:`activation_bytes_per_token`, a Llama-family layer
stack with policygrad's lean SwiGLU/RMSNorm layers, with or without full gradient checkpointing)
are a row of their own when a micro-batch is given; :func:`resolve_gradient_checkpointing` is the
rule ``model.gradient_checkpointing: auto`` follows. Fragmentation and temporary buffers are not
counted. GB are 10^9 bytes.
Parameter counts come from the model's ``config.json`` alone: the model is instantiated on the
``meta`` device (shapes, no storage), so no weights are read.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import TYPE_CHECKING

from policygrad.arguments import OneLineArgumentParser
from policygrad.lab.common import (
    DEFAULT_OUTPUT_DIR,
    check_output_dir,
    ensure_output_dir,
    format_table,
    pyplot,
    save_figure,
    write_json,
)
from policygrad.lab.memory_bill import STRATEGIES, MemoryPlan, format_count
from policygrad.lab.memory_plan import algorithm_models, check_options, plan_memory
from policygrad.parallel.footprint import ModelShape, format_gb, llama_linear_shapes, model_shape_from_config

if TYPE_CHECKING:
    from policygrad.parallel.run_memory import RunPlan

# The bill's parts are priced in :mod:`policygrad.parallel.footprint` (the model's shape and
# activations, shared with the trainer's ``gradient_checkpointing: auto``),
# :mod:`policygrad.lab.memory_bill` (its lines) and :mod:`policygrad.lab.memory_plan` (one
# configuration's bill); this module reads the shape from the command line, plots, and runs it.


# ---------------------------------------------------------------------------------------------- shapes


def parse_count(text: str | float | int, name: str) -> int:
    """``"7e9"``, ``"7B"``, ``"135M"``, ``"128k"``, ``7e9`` -> an int count.

    Raises:
        ValueError: not a positive number (names the option).
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip().replace("_", "").replace(",", "")
        scale = 1.0
        suffixes = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
        if s and s[-1].lower() in suffixes:
            scale = suffixes[s[-1].lower()]
            s = s[:-1]
        try:
            value = float(s) * scale
        except ValueError:
            raise ValueError(f"{name}: {text!r} is not a number; write e.g. 7e9, 7B or 135M") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {text!r}")
    return int(round(value))


def _override_fields(shape: ModelShape, **values: int | None) -> None:
    """Set each field of ``shape`` given a value (not None) to that value as an int."""
    for field, value in values.items():
        if value is not None:
            setattr(shape, field, int(value))


def resolve_shape(
    model: str | None = None,
    *,
    params: int | None = None,
    vocab: int | None = None,
    layers: int | None = None,
    hidden: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    intermediate: int | None = None,
) -> ModelShape:
    """A :class:`ModelShape` from a model's config, from numbers, or the config with numbers
    overriding its fields (for hypothetical models: ``params=7e9, vocab=128000``).

    Without ``model`` and ``params`` the bundled default model is used.

    Raises:
        ValueError: a non-positive number, or a config that cannot be read.
    """
    for name, value in (
        ("--vocab", vocab),
        ("--layers", layers),
        ("--hidden", hidden),
        ("--kv-heads", kv_heads),
        ("--head-dim", head_dim),
        ("--intermediate", intermediate),
    ):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if model is None and params is None:
        # imported here: it loads torch, and this module must import without it
        from policygrad.models.bundled import DEFAULT_MODEL

        model = DEFAULT_MODEL
    if model is not None:
        shape = model_shape_from_config(model)
    else:
        shape = ModelShape(params=int(params))
    if params is not None:
        shape.params = int(params)
        shape.source = f"{shape.source}, params given" if model is not None else "given"
        if model is not None:
            shape.linear_shapes = None  # a different size: the config's layers no longer apply
    _override_fields(
        shape,
        vocab_size=vocab,
        num_layers=layers,
        hidden_size=hidden,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
    )
    if model is None and shape.hidden_size and shape.num_kv_heads is None and shape.head_dim is None:
        # No grouped-query attention assumed: K and V are as wide as the residual stream.
        shape.num_kv_heads, shape.head_dim = 1, shape.hidden_size
    if intermediate is not None:
        shape.intermediate_size = int(intermediate)
        if not (shape.hidden_size and shape.num_layers):
            raise ValueError("--intermediate needs --hidden and --layers to lay out the linear layers")
        kv_dim = shape.num_kv_heads * shape.head_dim if shape.num_kv_heads and shape.head_dim else None
        shape.linear_shapes = llama_linear_shapes(
            shape.hidden_size, shape.num_layers, int(intermediate), kv_dim=kv_dim
        )
    return shape


# ---------------------------------------------------------------------------------------------- activations

# model.precision -> (bytes of the float32-or-not residual stream r, bytes of a matmul input c,


# ---------------------------------------------------------------------------------------------- the bill


# ---------------------------------------------------------------------------------------------- plot and CLI


_COLORS = {
    "policy": "#1f77b4",
    "reference": "#7f7f7f",
    "reward model": "#bcbd22",
    "critic": "#d62728",
    "inference engine": "#9467bd",
    "KV cache": "#c5b0d5",
    "logits B x T x V": "#ff9896",
}


def _color(component: str) -> str:
    return _COLORS.get(component.split(" (")[0], "#17becf")


def plot_plans(plans: list[MemoryPlan], path: str) -> str:
    """Stacked horizontal bars, one per plan, one segment per component (GB); returns ``path``."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 0.8 + 0.7 * len(plans)))
    labels = []
    seen: set[str] = set()
    for row, plan in enumerate(plans):
        left = 0.0
        for it in plan.items:
            if it.bytes == 0:
                continue
            width = it.bytes / 1e9
            hatch = "//" if it.state == "activation" else ("" if it.state == "trainable" else "..")
            label = it.component if it.component not in seen else None
            seen.add(it.component)
            ax.barh(
                row, width, left=left, color=_color(it.component), edgecolor="white", hatch=hatch, label=label
            )
            left += width
        ax.text(left, row, f"  {left:,.1f} GB", va="center", fontsize=8)
        labels.append(plan.algorithm + (f" (LoRA r={plan.lora_rank})" if plan.lora_rank else ""))
    ax.set_yticks(range(len(plans)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(
        "GB (1e9 bytes); solid: trainable 16 B/param, dotted: frozen 2 (reference 4) B/param, "
        "hatched: activations"
    )
    ax.set_title(f"Memory bill, {format_count(plans[0].shape.params)}-parameter policy")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_xlim(0, max(p.total_bytes for p in plans) / 1e9 * 1.25)
    return save_figure(fig, path)


def run_memory(
    shape: ModelShape,
    algorithm: str = "grpo",
    *,
    output_dir: str | None = DEFAULT_OUTPUT_DIR,
    **options,
) -> MemoryPlan:
    """:func:`plan_memory`, plus (with ``output_dir``) ``memory.json`` and ``memory.png`` comparing
    the plan with SFT, a critic-free algorithm (GRPO) and PPO under the same options.

    Returns:
        the :class:`MemoryPlan` of ``algorithm`` with ``json_path`` / ``png_path`` set.
    """
    plan = plan_memory(shape, algorithm, **options)
    if output_dir is None:
        return plan
    out = ensure_output_dir(output_dir)
    compare = []
    for name in ("sft", "grpo", "ppo"):
        if name != algorithm:
            opts = dict(options)
            if name == "sft":  # no rollouts, no scoring: no engine, no reward model
                opts.update(inference_engine=False, reward_model=False, servers=0)
            compare.append(plan_memory(shape, name, **opts))
    plans = [plan] + compare
    order = {"sft": 0, "grpo": 1, "ppo": 3}
    plans.sort(key=lambda p: order.get(p.algorithm, 2))
    plan.json_path = write_json(
        os.path.join(out, "memory.json"),
        {"plan": plan.to_dict(), "compared": [p.to_dict() for p in compare]},
    )
    plan.png_path = plot_plans(plans, os.path.join(out, "memory.png"))
    return plan


MEMORY_DESCRIPTION = """The memory bill of an RL job: 16 bytes per trainable parameter (fp32 master weights
and gradients, two fp32 Adam moments), 2 per frozen one (4 for the reference: float32 like the
policy's master weights); reward model, critic and
inference engine as the algorithm needs; KV cache and the B x T x V logits tensor; per rank with
--world-size and --strategy.
Parameter counts come from the model's config.json (no weights are read); --params and the shape
options describe a hypothetical model instead.

policygrad memory --config [CONFIG.yaml] [--key=value ...] plans a training run instead, as
policygrad train would run it on this host's CPU: the peak of its process, and whether it fits
the memory available (a run that does not is refused by policygrad train before a model loads)."""


def build_parser() -> argparse.ArgumentParser:
    p = OneLineArgumentParser(prog="policygrad memory", description=MEMORY_DESCRIPTION)
    p.add_argument(
        "--model",
        default=None,
        help="bundled:NAME, a model folder or a cached hub id "
        "(default: the bundled model, unless --params is given)",
    )
    p.add_argument("--algorithm", default="grpo", help=f"one of {', '.join(sorted(algorithm_models()))}")
    p.add_argument("--params", default=None, help="parameter count of a hypothetical model: 7e9, 7B, 135M")
    p.add_argument("--vocab", default=None, help="vocabulary size V (for the logits tensor)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (KV cache, LoRA)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size (KV cache without GQA, LoRA)")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (KV cache)")
    p.add_argument("--head-dim", type=int, default=None, help="width of one attention head (KV cache)")
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (LoRA on a --params model)")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank r (0 = full fine-tune)")
    p.add_argument(
        "--lora-targets",
        default="all-linear",
        help="all-linear, or comma-separated module names such as q_proj,v_proj",
    )
    p.add_argument("--batch", type=int, default=None, help="B sequences (logits, KV cache)")
    p.add_argument("--seq-len", type=int, default=None, help="T tokens per sequence (logits, KV cache)")
    p.add_argument("--inference-engine", action="store_true", help="a separate engine's copy + KV cache")
    p.add_argument(
        "--servers",
        type=int,
        default=0,
        help="rollout server processes (rollout.engine=server), priced apart",
    )
    p.add_argument("--reward-model", action="store_true", help="a reward model (a verifier needs none)")
    p.add_argument("--no-reference", action="store_true", help="no KL to a reference: drop it")
    p.add_argument("--critic-params", default=None, help="critic size (default: the policy's)")
    p.add_argument("--reward-params", default=None, help="reward-model size (default: the policy's)")
    p.add_argument("--vine-rollouts", type=int, default=9, help="VinePPO: K rollouts per state (default 9)")
    p.add_argument(
        "--vine-splits", type=int, default=8, help="VinePPO: S split points per response (default 8)"
    )
    p.add_argument("--world-size", type=int, default=1, help="ranks N (torchrun processes): figures per rank")
    p.add_argument(
        "--strategy",
        default="ddp",
        choices=STRATEGIES,
        help="ddp: whole models on every rank; fsdp: policy, critic and reference sharded N ways",
    )
    p.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, help="where memory.json and memory.png go")
    p.add_argument(
        "--config",
        action="store_true",
        help="plan a training run: policygrad memory --config [CONFIG.yaml] [--key=value ...]",
    )
    return p


def run_plan_table(plan: RunPlan) -> str:
    """A run's plan (:class:`~policygrad.parallel.run_memory.RunPlan`) as text: one line per item,
    then the peak."""
    rows = [
        [it.component, it.state, format_count(it.params), format_gb(it.bytes), it.note]
        for it in plan.items
    ]
    return "\n".join(
        [
            f"planned peak of the trainer process: {plan.engine} engine, {plan.precision}, "
            f"B {plan.sequences} x T {plan.seq_len} (longest prompt {plan.prompt_tokens} tokens)",
            format_table(["component", "state", "params", "GB", "how"], rows),
            "",
            f"planned peak: {format_gb(plan.peak_bytes)} GB (the resident lines and the largest working "
            "line)",
            f"at least: {format_gb(plan.floor_bytes)} GB (the resident lines and a training micro-batch, "
            "checkpointed where model.gradient_checkpointing=auto may turn it on; what policygrad train "
            "compares with the memory available)",
        ]
    )


def plan_config(cfg) -> str:
    """``policygrad memory --config``: the plan of the run ``cfg`` on this host, and whether it
    fits the memory available.

    Raises:
        ValueError / ConfigError: the model or data cannot be read; the plan cannot be made.
    """
    # imported here: they load torch, which the other uses of this command do not need
    from policygrad.config.train import ConfigError
    from policygrad.parallel.before_loading import available_to_a_run, plan_run_from_config
    from policygrad.parallel.run_memory import check_run_fits

    plan = plan_run_from_config(cfg)
    if plan is None:
        raise ValueError(
            "model.adapter: a run that starts from a trained adapter has no plan before it loads"
        )
    available = available_to_a_run()
    try:
        check_run_fits(cfg, plan, available_bytes=available)
        verdict = f"fits: {format_gb(available)} GB available on this host"
    except ConfigError as refusal:
        verdict = f"does not fit; policygrad train refuses it: {refusal}"
    return run_plan_table(plan) + "\n" + verdict


def main(argv: list[str]) -> str:
    """``policygrad memory ...``: write the JSON and the PNG; returns the bill and their paths to print."""
    args = build_parser().parse_args(argv)
    counts = {
        name: parse_count(value, flag) if value is not None else None
        for name, flag, value in (
            ("params", "--params", args.params),
            ("vocab", "--vocab", args.vocab),
            ("critic_params", "--critic-params", args.critic_params),
            ("reward_params", "--reward-params", args.reward_params),
        )
    }
    options = {
        "lora_rank": args.lora_rank,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "inference_engine": args.inference_engine,
        "servers": args.servers,
        "reward_model": args.reward_model,
        "critic_params": counts["critic_params"],
        "reward_params": counts["reward_params"],
        "world_size": args.world_size,
        "strategy": args.strategy,
    }
    # Every option is checked, and the output folder made, before a model's config is read: the
    # bundled model's first read converts it (tens of seconds).
    check_options(args.algorithm, **options)
    output_dir = check_output_dir(args.output_dir)
    shape = resolve_shape(
        args.model,
        params=counts["params"],
        vocab=counts["vocab"],
        layers=args.layers,
        hidden=args.hidden,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate=args.intermediate,
    )
    targets = args.lora_targets
    if targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    plan = run_memory(
        shape,
        args.algorithm,
        output_dir=output_dir,
        lora_targets=targets,
        reference=False if args.no_reference else None,
        vine_rollouts=args.vine_rollouts,
        vine_splits=args.vine_splits,
        **options,
    )
    lines = [plan.table]
    if args.inference_engine and args.batch is None:
        lines.append("note: KV cache not counted; give --batch and --seq-len")
    lines.append(f"\nwrote {plan.json_path}\nwrote {plan.png_path}")
    return "\n".join(lines)


__all__ = [
    "build_parser",
    "main",
    "parse_count",
    "plan_memory",  # priced in memory_plan; here too, the bill's entry point (README, "policygrad memory")
    "plot_plans",
    "resolve_shape",
    "run_memory",
]
