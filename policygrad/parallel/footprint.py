"""What a model costs in memory, from its shape alone: the sizes a bill needs (:class:`ModelShape`,
read from a ``config.json`` without weights), the activations a training forward saves per token
(:func:`activation_bytes_per_token`), its logits row, and the rule ``model.gradient_checkpointing:
auto`` follows (:func:`resolve_gradient_checkpointing`, against :func:`available_memory_bytes`).

The training loop (:mod:`policygrad.parallel.recompute`) and the ``policygrad memory`` command both
price a model with these. Importing this module loads neither
torch nor transformers (they are imported where a config is read). GB are 10^9 bytes.
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Mapping

__all__ = [
    "ACTIVATION_PRECISIONS",
    "BYTES_BF16",
    "CheckpointingChoice",
    "ModelShape",
    "SAFETY_MARGIN",
    "activation_bytes_per_token",
    "available_memory_bytes",
    "format_gb",
    "llama_linear_shapes",
    "logits_bytes_per_token",
    "model_shape_from_config",
    "resolve_gradient_checkpointing",
]


def format_gb(n: int) -> str:
    """``n`` bytes as GB (10^9) for a table or a log line: two decimals below 10 GB, one above."""
    return f"{n / 1e9:,.2f}" if n < 1e10 else f"{n / 1e9:,.1f}"


BYTES_BF16 = 2
"""Bytes per element of a bf16 activation (logits, KV cache)."""


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
    max_positions: int | None = None  # the context: max_position_embeddings (None when unknown)

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
    # imported here: they load torch and transformers, and this module must import without them
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
        max_positions=getattr(text, "max_position_embeddings", None),
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
        f"a micro-batch of {tokens:,} tokens needs {format_gb(needed)} GB without checkpointing "
        f"(model states {format_gb(state_bytes)}, "
        f"activations {format_gb(tokens * activation_bytes_per_token)}, "
        f"logits {format_gb(tokens * logits_bytes_per_token)}) "
        f"{'over' if enabled else 'within'} {format_gb(limit)} GB ({100 - 100 * margin:g}% of "
        f"{format_gb(available_bytes)} GB available)"
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
        # imported here: this module must import without torch
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    try:
        # imported here: psutil is optional (/proc/meminfo otherwise)
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
