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
import dataclasses
import functools
import math
import os
import types
from collections.abc import Mapping
from typing import Any

from policygrad.lab.common import (
    DEFAULT_OUTPUT_DIR,
    OneLineArgumentParser,
    check_output_dir,
    ensure_output_dir,
    fmt,
    format_table,
    pyplot,
    save_figure,
    write_json,
)

# distributed.strategy's choices with several processes (the planner prices one without building it)
STRATEGIES = ("ddp", "fsdp")
SHARDED = STRATEGIES[1]  # parameters, gradients and AdamW state split over the ranks

BYTES_TRAINABLE = 16
"""Bytes per trainable parameter as the trainer holds it (``model.precision`` fp32 or bf16-mixed):
fp32 weight 4 + fp32 gradient 4 + Adam m 4 + Adam v 4 (bf16 copies exist only for compute)."""
BYTES_FROZEN = 2
"""Bytes per frozen parameter: the bf16 weight."""
BYTES_BF16 = 2
"""Bytes per element of a bf16 activation (logits, KV cache)."""
BYTES_FP32 = 4
"""Bytes per parameter of a float32 copy."""


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


# ---------------------------------------------------------------------------------------------- shapes


@dataclasses.dataclass
class ModelShape:
    """What the bill needs to know about a model.

    Fields:
        params: total parameters (tied input/output embeddings counted once).
        vocab_size: V, rows of the output head (None when unknown: no logits row).
        num_layers, num_kv_heads, head_dim: for the KV cache (None when unknown).
        hidden_size: width of the residual stream (activations).
        intermediate_size, num_heads: MLP width and attention heads (activations; None when
            unknown).
        linear_shapes: ``(name, in_features, out_features)`` of every linear layer that LoRA can
            target (the output head excluded, as peft's ``all-linear``); None when unknown.
        source: where the numbers came from (a config path, or "given").
    """

    params: int
    vocab_size: int | None = None
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    hidden_size: int | None = None
    linear_shapes: list[tuple[str, int, int]] | None = None
    source: str = "given"
    param_rows: list[tuple[int, int]] | None = None  # (first dim, elements) of every parameter
    intermediate_size: int | None = None
    num_heads: int | None = None

    def kv_cache_bytes(self, batch: int, seq_len: int) -> int:
        """``2 * layers * kv_heads * head_dim * B * T * 2`` bytes (K and V, bf16).

        Raises:
            ValueError: the layer count or KV width is unknown (names the options to give).
        """
        if self.num_layers is None or self.num_kv_heads is None or self.head_dim is None:
            raise ValueError(
                "the KV cache needs the layer count and KV width: give --model, or --layers with "
                "--kv-heads and --head-dim (or --hidden for a model without grouped-query attention)"
            )
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * batch * seq_len * BYTES_BF16

    def lora_params(self, rank: int, target_modules: str | list[str] = "all-linear") -> int:
        """Adapter parameters: ``rank * (in + out)`` summed over the targeted linear layers.

        Args:
            rank: LoRA rank r >= 1.
            target_modules: ``"all-linear"`` or module-name suffixes (``["q_proj", "v_proj"]``).

        Raises:
            ValueError: the linear layers' shapes are unknown, or no layer matches the targets.
        """
        if self.linear_shapes is None:
            raise ValueError(
                "LoRA needs the shapes of the linear layers: give --model, or --hidden, --layers and "
                "--intermediate (a Llama-shaped model is assumed)"
            )
        if target_modules == "all-linear":
            chosen = self.linear_shapes
        else:
            targets = [target_modules] if isinstance(target_modules, str) else list(target_modules)
            chosen = [s for s in self.linear_shapes if any(s[0].split(".")[-1] == t for t in targets)]
        if not chosen:
            names = sorted({s[0].split(".")[-1] for s in self.linear_shapes})
            raise ValueError(
                f"lora target modules {target_modules!r} match no linear layer; this model's are: "
                f"{', '.join(names)}"
            )
        return sum(rank * (fan_in + fan_out) for _, fan_in, fan_out in chosen)


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_shape_from_config(spec: str) -> ModelShape:
    """Parameter count and shapes of a model from its ``config.json``, without loading weights.

    The model class is built from the config on the ``meta`` device (tensors with shapes and no
    storage), so the count is exact for any architecture transformers knows, tied embeddings
    counted once.

    Args:
        spec: ``bundled:NAME``, a local model folder, or a hub id whose files are in the local
            Hugging Face cache.

    Raises:
        ValueError: the model cannot be found, or its config cannot be read (names ``--model``).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    # imported here: it loads torch, and this module must import without it
    from policygrad.models.loading import resolve_model_path

    path = resolve_model_path(spec)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {spec!r}: cannot read its config.json ({e})") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings()
    linears = [
        (name, module.in_features, module.out_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    ]
    text = _text_config(config)
    heads = getattr(text, "num_attention_heads", None)
    hidden = getattr(text, "hidden_size", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or (hidden // heads if hidden and heads else None)
    return ModelShape(
        params=int(params),
        vocab_size=getattr(text, "vocab_size", None),
        num_layers=getattr(text, "num_hidden_layers", None),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        linear_shapes=linears,
        source=os.path.join(path, "config.json") if os.path.isdir(path) else str(path),
        param_rows=[(p.shape[0] if p.dim() else 1, p.numel()) for p in model.parameters()],
        intermediate_size=getattr(text, "intermediate_size", None),
        num_heads=heads,
    )


def llama_linear_shapes(
    hidden: int, layers: int, intermediate: int, *, kv_dim: int | None = None
) -> list[tuple[str, int, int]]:
    """The linear layers of a Llama-shaped decoder: per layer q, k, v, o projections and the
    gate, up, down MLP projections. ``kv_dim`` = kv_heads * head_dim (default ``hidden``)."""
    kv = hidden if kv_dim is None else kv_dim
    shapes = []
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes += [
            (f"{p}.self_attn.q_proj", hidden, hidden),
            (f"{p}.self_attn.k_proj", hidden, kv),
            (f"{p}.self_attn.v_proj", hidden, kv),
            (f"{p}.self_attn.o_proj", hidden, hidden),
            (f"{p}.mlp.gate_proj", hidden, intermediate),
            (f"{p}.mlp.up_proj", hidden, intermediate),
            (f"{p}.mlp.down_proj", intermediate, hidden),
        ]
    return shapes


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
# copies of the normalised input the q, k and v projections save): autocast casts that input to
# bf16/fp16 once per projection (it caches casts of leaf weights only), so each keeps its own copy.
ACTIVATION_PRECISIONS: Mapping[str, tuple[int, int, int]] = types.MappingProxyType(
    {"fp32": (4, 4, 1), "bf16-mixed": (4, 2, 3), "fp16-mixed": (4, 2, 3), "bf16-pure": (2, 2, 1)}
)
FLOAT32_STAT = 4
"""Bytes of a per-row float32 statistic: an RMSNorm's inverse RMS, an attention row's logsumexp."""


def activation_bytes_per_token(
    shape: ModelShape,
    *,
    precision: str = "fp32",
    seq_len: int | None = None,
    checkpointing: bool = False,
) -> int:
    """Bytes the training forward saves for the backward, per token of a micro-batch, for a
    Llama-family decoder (RMSNorm, rotary attention through SDPA, SwiGLU MLP) with policygrad's
    lean layers (:mod:`policygrad.models.swiglu`); the logits and log-probs are not included (the
    bill's logits row).

    Per layer and token, with H the hidden size, I the MLP width, n the attention heads, r the
    bytes of the residual stream (4: float32 parameters; 2 under ``bf16-pure``), c the bytes of a
    matmul input (4 under ``fp32``, 2 under bf16/fp16 autocast) and q = 3 under autocast else 1::

        L1 = 3 H r              RMSNorm inputs of both norms, and the MLP's input x (a norm output)
           + 2 * 4              the two norms' inverse RMS (float32, one per row)
           + q H c              the q/k/v projections' input (one tensor, or three autocast copies)
           + 3 H c              SDPA's query, key and value (key and value repeated to n heads)
           + H c                SDPA's output, which is o_proj's input
           + n * 4              SDPA's logsumexp per head (float32)
           + T c                the additive attention mask row (left padding; T = ``seq_len``)
           + 2 I c              the SwiGLU MLP's gate and up outputs

    The whole stack saves ``L * L1`` plus the final norm's input and inverse RMS (``H r + 4``).
    With full gradient checkpointing each layer keeps only its input (``H r``) and one layer's
    ``L1`` lives while that layer's forward is recomputed in the backward:
    ``L * H r + L1 + H r + 4``.

    Derivation (what autograd keeps, counted with ``torch.autograd.graph.saved_tensors_hooks``
    over unique storages): :class:`~policygrad.models.swiglu.RMSNormFunction` saves x and rstd;
    a linear layer saves its input (and its weight: a parameter, not an activation; under
    autocast the bf16 copies of q/k/v/o's weights, a per-forward constant, are not counted here);
    the rotary multiplications save the cos/sin tables, one pair for the whole model (not
    counted); SDPA saves query, key, value, its output and the logsumexp (and the mask when one
    is given; transformers repeats the KV heads before SDPA); the residual additions save
    nothing; :class:`~policygrad.models.swiglu.SwiGLUFunction` saves x, gate and up. Measured on
    SmolLM2-135M (H 576, I 1536, 9 heads, 30 layers) for 4 x 110 tokens: 938,564 B/token
    under ``fp32`` (this formula: 938,428, the rest the rotary tables and the token ids), 643,964
    under ``bf16-mixed`` apart from the weight copies (formula: 643,828); 71,436 with
    checkpointing before the backward (formula without the recomputed layer: 71,428).

    Args:
        shape: needs ``hidden_size``, ``num_layers`` and ``intermediate_size`` (``num_heads``:
            default 1).
        precision: a key of :data:`ACTIVATION_PRECISIONS` (``model.precision`` resolved).
        seq_len: T, the padded sequence length (the mask row); None: no mask counted.
        checkpointing: full gradient checkpointing (each decoder layer's forward recomputed).

    Raises:
        ValueError: an unknown precision, or a shape without the sizes above (names the options).
    """
    if precision not in ACTIVATION_PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(ACTIVATION_PRECISIONS)}")
    H, L, I = shape.hidden_size, shape.num_layers, shape.intermediate_size
    if not (H and L and I):
        raise ValueError(
            "activations need the hidden size, layer count and MLP width: give --model, or --hidden, "
            "--layers and --intermediate"
        )
    r, c, q = ACTIVATION_PRECISIONS[precision]
    heads = shape.num_heads or 1
    layer = (
        3 * H * r
        + 2 * FLOAT32_STAT
        + q * H * c
        + 3 * H * c
        + H * c
        + heads * FLOAT32_STAT
        + (seq_len or 0) * c
        + 2 * I * c
    )
    final_norm = H * r + FLOAT32_STAT
    if checkpointing:
        return L * H * r + layer + final_norm
    return L * layer + final_norm


def logits_bytes_per_token(shape: ModelShape, *, precision: str = "fp32") -> int:
    """Bytes of one token's logits row ``V x c`` (c: the compute dtype's bytes, as in
    :func:`activation_bytes_per_token`); 0 when the vocabulary is unknown."""
    if precision not in ACTIVATION_PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(ACTIVATION_PRECISIONS)}")
    return (shape.vocab_size or 0) * ACTIVATION_PRECISIONS[precision][1]


SAFETY_MARGIN = 0.1
"""The share of the available memory ``auto`` keeps free (fragmentation, temporary buffers)."""


@dataclasses.dataclass(frozen=True)
class CheckpointingChoice:
    """What :func:`resolve_gradient_checkpointing` decided.

    Fields:
        enabled: recompute every layer's forward in the backward.
        needed_bytes: the planned peak without checkpointing (None for an explicit setting).
        limit_bytes: the available memory less the safety margin (None for an explicit setting).
        why: one line for the log.
    """

    enabled: bool
    needed_bytes: int | None = None
    limit_bytes: int | None = None
    why: str = ""


def resolve_gradient_checkpointing(
    setting: bool | str,
    *,
    state_bytes: int,
    activation_bytes_per_token: int,
    logits_bytes_per_token: int,
    tokens: int,
    available_bytes: int,
    margin: float = SAFETY_MARGIN,
) -> CheckpointingChoice:
    """``model.gradient_checkpointing``: ``True`` / ``False`` pass through; ``"auto"`` is on only
    when the planned peak ``state_bytes + tokens x (activation_bytes_per_token +
    logits_bytes_per_token)`` (model states not yet held, plus one micro-batch's saved activations
    without checkpointing and its logits) exceeds ``available_bytes x (1 - margin)``.

    Args:
        setting: True, False or ``"auto"``.
        state_bytes: weights, gradients and optimiser state still to be allocated (0 when the
            available memory was read after they were).
        activation_bytes_per_token: :func:`activation_bytes_per_token` without checkpointing.
        logits_bytes_per_token: :func:`logits_bytes_per_token`.
        tokens: the micro-batch's sequences x padded length.
        available_bytes: free memory of the device the model trains on.
        margin: the share of ``available_bytes`` kept free.

    Raises:
        ValueError: a setting other than True, False or ``"auto"``; a negative count.
    """
    if isinstance(setting, bool):
        return CheckpointingChoice(setting, why=f"model.gradient_checkpointing={str(setting).lower()}")
    if setting != "auto":
        raise ValueError(f"gradient checkpointing setting {setting!r}: choose true, false or auto")
    for name, value in (
        ("state_bytes", state_bytes),
        ("activation_bytes_per_token", activation_bytes_per_token),
        ("logits_bytes_per_token", logits_bytes_per_token),
        ("tokens", tokens),
        ("available_bytes", available_bytes),
    ):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    needed = int(state_bytes + tokens * (activation_bytes_per_token + logits_bytes_per_token))
    limit = int(available_bytes * (1 - margin))
    enabled = needed > limit
    why = (
        f"a micro-batch of {tokens:,} tokens needs {_gb(needed)} GB without checkpointing "
        f"(model states {_gb(state_bytes)}, activations {_gb(tokens * activation_bytes_per_token)}, "
        f"logits {_gb(tokens * logits_bytes_per_token)}) "
        f"{'over' if enabled else 'within'} {_gb(limit)} GB ({100 - 100 * margin:g}% of "
        f"{_gb(available_bytes)} GB available)"
    )
    return CheckpointingChoice(enabled, needed, limit, why)


def available_memory_bytes(device=None) -> int:
    """Free memory where ``device`` computes: CUDA: free device memory plus what torch's caching
    allocator holds unused; else the host's available memory (psutil's ``available`` when
    psutil is installed, else ``MemAvailable`` of ``/proc/meminfo``).

    Raises:
        OSError: neither psutil nor ``/proc/meminfo`` is there.
    """
    if device is not None and getattr(device, "type", str(device)) == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    with open("/proc/meminfo", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable line")


# ---------------------------------------------------------------------------------------------- the bill


@dataclasses.dataclass
class MemoryItem:
    """One line of the bill.

    Fields:
        component: e.g. ``policy``, ``reference``, ``critic (LoRA adapters)``, ``KV cache``.
        state: ``trainable``, ``frozen``, ``shared``, or ``activation``.
        params: parameters (None for activations).
        bytes_per_param: 16, 2 or 0 (None for activations).
        bytes: the item's bytes.
        note: how it was counted.
    """

    component: str
    state: str
    params: int | None
    bytes_per_param: float | None
    bytes: int
    note: str = ""


@dataclasses.dataclass
class MemoryPlan:
    """The bill of one configuration.

    Fields:
        algorithm, lora_rank, batch, seq_len, inference_engine, reward_model, reference: the inputs.
        shape: the model's :class:`ModelShape` (``linear_shapes`` dropped from ``to_dict``).
        items: the lines of the bill.
        state_bytes: weights, gradients and optimiser state of every model (ZeRO's "model
            states", Rajbhandari et al. 2019, section 3.1).
        total_bytes: ``state_bytes`` + KV cache + logits.
        world_size, strategy: the ranks and how models are spread over them (every figure is
            per rank).
        sft_state_bytes: ``state_bytes`` of supervised fine-tuning of the same model (policy only,
            same LoRA setting).
        ratio_to_sft: ``state_bytes / sft_state_bytes``.
        table: the text table printed by the CLI.
        json_path, png_path: files written (None from :func:`plan_memory` alone).
    """

    algorithm: str
    lora_rank: int
    batch: int | None
    seq_len: int | None
    inference_engine: bool
    reward_model: bool
    reference: bool
    shape: ModelShape
    items: list[MemoryItem]
    state_bytes: int
    total_bytes: int
    sft_state_bytes: int
    ratio_to_sft: float
    world_size: int = 1
    strategy: str = "ddp"
    table: str = ""
    json_path: str | None = None
    png_path: str | None = None
    value_rollout_sequences: int = 0
    value_rollout_tokens: int = 0

    def item(self, component: str) -> MemoryItem:
        """The item named ``component``.

        Raises:
            KeyError: no such item (lists the present ones).
        """
        for it in self.items:
            if it.component == component:
                return it
        raise KeyError(f"no item {component!r}; items: {[it.component for it in self.items]}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (the shape without its list of linear layers)."""
        d = dataclasses.asdict(self)
        d["shape"].pop("linear_shapes", None)
        d["shape"].pop("param_rows", None)
        d.pop("table", None)
        if not self.value_rollout_sequences:  # only VinePPO samples them
            d.pop("value_rollout_sequences")
            d.pop("value_rollout_tokens")
        d["state_gb"] = self.state_bytes / 1e9
        d["total_gb"] = self.total_bytes / 1e9
        d["sft_state_gb"] = self.sft_state_bytes / 1e9
        return d


def _check_algorithm(algorithm: str) -> AlgorithmModels:
    table = algorithm_models()
    if algorithm not in table:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {', '.join(sorted(table))}")
    return table[algorithm]


def _model_items(name: str, params: int, trainable: bool, lora: int, note: str = "") -> list[MemoryItem]:
    """Lines of one model: a full model (16 or 2 B/param), or a LoRA model (frozen base + adapters)."""
    if trainable and lora:
        return [
            MemoryItem(
                f"{name} (base)",
                "frozen",
                params,
                BYTES_FROZEN,
                params * BYTES_FROZEN,
                "LoRA: base weights frozen, bf16",
            ),
            MemoryItem(
                f"{name} (LoRA adapters)",
                "trainable",
                lora,
                BYTES_TRAINABLE,
                lora * BYTES_TRAINABLE,
                "r * (in + out) per targeted linear layer",
            ),
        ]
    if trainable:
        return [
            MemoryItem(
                name,
                "trainable",
                params,
                BYTES_TRAINABLE,
                params * BYTES_TRAINABLE,
                note or "fp32 weights + fp32 grads + 2 fp32 Adam moments",
            )
        ]
    return [MemoryItem(name, "frozen", params, BYTES_FROZEN, params * BYTES_FROZEN, note or "bf16 weights")]


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
    if algorithm == "sft" and (inference_engine or reward_model):
        raise ValueError("sft samples nothing and scores nothing: drop --inference-engine and --reward-model")
    if critic_params is not None and lora_rank and needs.critic:
        raise ValueError(
            "--critic-params with --lora-rank: the critic's adapters are counted from the "
            "policy's layers; drop --critic-params"
        )
    return needs


def _reference_item(params: int, lora: int) -> MemoryItem:
    """The reference: with LoRA the policy's base (no copy), else a float32 copy."""
    if lora:
        return MemoryItem(
            "reference", "shared", params, 0, 0, "the policy's frozen base with the adapters switched off"
        )
    return MemoryItem(
        "reference",
        "frozen",
        params,
        BYTES_FP32,
        params * BYTES_FP32,
        "frozen copy of the initial policy, float32 like the master weights",
    )


def _unsharded_copy_item(params: int, inference_engine: bool) -> MemoryItem:
    """fsdp's whole float32 policy: on the device for the hf engine, in host memory with vLLM."""
    if not inference_engine:
        return MemoryItem(
            "unsharded copy",
            "frozen",
            params,
            BYTES_FP32,
            params * BYTES_FP32,
            "fsdp: the float32 policy the hf engine samples from and exports are written from",
        )
    return MemoryItem(
        "unsharded copy",
        "host",
        params,
        0,
        0,
        f"fsdp with vLLM: the float32 policy for exports and weight pushes, {_gb(params * BYTES_FP32)} GB "
        "of CPU memory, not on the device",
    )


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
    )
    if shape.params <= 0:
        raise ValueError(f"the model's parameter count must be > 0, got {shape.params}")
    use_reference = needs.reference if reference is None else bool(reference and needs.reference)
    full_copy = strategy == SHARDED and world_size > 1 and algorithm != "sft"
    lora = shape.lora_params(lora_rank, lora_targets) if lora_rank else 0
    p = shape.params

    items = _model_items("policy", p, True, lora)
    if use_reference:
        items.append(_reference_item(p, lora))
    if reward_model:
        items += _model_items("reward model", reward_params or p, False, 0, "frozen, bf16")
    if needs.critic:
        cp = critic_params or p
        critic_lora = lora if (lora and critic_params is None) else 0
        items += _model_items("critic", cp, True, critic_lora)
    if full_copy:
        items.append(_unsharded_copy_item(p, inference_engine))
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
        items = [_sharded(it, shape, world_size) for it in items]
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
    sft_items = _model_items("policy", p, True, lora)
    if strategy == SHARDED and world_size > 1:
        sft_items = [_sharded(it, shape, world_size) for it in sft_items]
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
    plan.table = memory_table(plan)
    return plan


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


_SHARDED = ("policy", "reference", "critic")  # what the trainer's fsdp strategy shards


def _sharded(item: MemoryItem, shape: ModelShape, world_size: int) -> MemoryItem:
    """``item`` as one of ``world_size`` FSDP ranks holds it: 1/N of each parameter's rows (the
    first dimension padded to a multiple of N, as ``fully_shard`` pads, when the parameter shapes
    are known; LoRA adapters and given sizes are divided evenly)."""
    if item.component.split(" (")[0] not in _SHARDED or not item.bytes:
        return item
    full = item.params
    local = -(-full // world_size)
    if shape.param_rows and full == shape.params and "LoRA" not in item.component:
        local = sum(-(-rows // world_size) * (numel // rows) for rows, numel in shape.param_rows)
    return dataclasses.replace(
        item,
        bytes=local * item.bytes_per_param,
        note=f"{item.note}; sharded {world_size} ways: {_count(local)} params on this rank",
    )


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f}" if n < 1e10 else f"{n / 1e9:,.1f}"


def _count(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def memory_table(plan: MemoryPlan) -> str:
    """The bill as text: one line per item, then the totals and the comparison with SFT."""
    rows = [
        [
            it.component,
            it.state,
            _count(it.params),
            fmt(it.bytes_per_param, 3) if it.bytes_per_param is not None else "-",
            _gb(it.bytes),
            it.note,
        ]
        for it in plan.items
    ]
    table = format_table(["component", "state", "params", "B/param", "GB", "how"], rows)
    lines = [
        f"memory bill: {plan.algorithm} ({algorithm_models()[plan.algorithm].description}); model "
        f"{_count(plan.shape.params)} params ({plan.shape.source})"
        + (f", LoRA r={plan.lora_rank}" if plan.lora_rank else "")
        + (f"; per rank of {plan.world_size} ({plan.strategy})" if plan.world_size > 1 else ""),
        table,
        "",
        f"weights + grads + optimiser state: {_gb(plan.state_bytes)} GB "
        f"({plan.ratio_to_sft:.2f}x SFT of the same model: {_gb(plan.sft_state_bytes)} GB)",
        f"with KV cache and logits:          {_gb(plan.total_bytes)} GB "
        "(activations and fragmentation not counted; GB = 1e9 bytes)",
    ]
    if plan.value_rollout_sequences:
        lines.append(
            f"VinePPO value rollouts per step: up to {plan.value_rollout_sequences:,} sequences, "
            f"{plan.value_rollout_tokens:,} tokens (the batch: {-(-plan.batch // plan.world_size):,} "
            "sequences; sampled that many at a time, so no more memory)"
        )
    return "\n".join(lines)


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
    ax.set_title(f"Memory bill, {_count(plans[0].shape.params)}-parameter policy")
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
                opts.update(inference_engine=False, reward_model=False)
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
options describe a hypothetical model instead."""


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
    return p


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
    "check_options",
    "SFT_MODELS",
    "algorithm_models",
    "BYTES_FROZEN",
    "BYTES_TRAINABLE",
    "MemoryItem",
    "MemoryPlan",
    "ModelShape",
    "llama_linear_shapes",
    "main",
    "model_shape_from_config",
    "parse_count",
    "plan_memory",
    "resolve_shape",
    "run_memory",
]
