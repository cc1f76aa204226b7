"""The roofline of a GRPO step: measured peaks of the machine, and FLOPs and bytes counted per phase.

Two halves:

- :func:`measure_peaks` times the hardware: matmul FLOP/s in float32 and bfloat16 (a large square
  matmul and one of the model's own shape, best of several after warm-up) and memory bandwidth (a
  copy of a tensor much larger than the caches, read + write bytes counted, and a read-only sum).
  Run as a script it prints the peaks as JSON (``python benchmarks/_roofline.py --threads 2``),
  which is how ``grpo_vs_trl.py`` measures them in a process of their own before its workers start.
- Pure counting functions (no torch): the FLOPs of each phase of a step and the bytes the
  memory-bound phases (decoding, the optimizer) must move, and :func:`side_roofline` /
  :func:`roofline_markdown`, which divide them by the measured seconds and the peaks.

FLOP counting follows the usual model-FLOP convention (Kaplan et al. 2020, "Scaling Laws for
Neural Language Models", section 2.1: forward ~ 2N per token, training ~ 6N; Chowdhery et al.
2022, PaLM, appendix B: MFU, with the attention term 6N + 12 L H Q T per trained token) with the
following choices:

- N counts the parameters that take part in a matmul: the input embedding is a lookup (no
  FLOPs); a tied lm_head counts once, as the head's matmul. ``N_body`` = those used at every
  position, ``N_head`` = the lm_head, run only where logits are needed (response positions).
- Tokens are the *useful* ones: non-padding prompt and response tokens, and the prompt tokens a
  side actually computes (policygrad runs each distinct prompt of a group once; TRL runs every
  row's prompt). Padding the sides compute anyway is not counted, so a padded batch shows up as a
  lower achieved FLOP/s.
- Attention: per layer and token, ``Q K^T`` and ``A V`` cost 2 d_attn FLOPs per key each, so
  4 L d_attn x context, with the causal context (the keys a token attends to) summed exactly
  over positions for the batch's mean prompt and response lengths.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# ----------------------------------------------------------------------------------------------
# Model dimensions.


@dataclass(frozen=True)
class ModelDims:
    """What the counts need of a model: parameter totals and the attention shape.

    ``n_params`` counts a tied embedding/lm_head matrix once; ``n_embedding`` and ``n_lm_head``
    are the sizes of the two matrices (equal and the same tensor when ``tied``)."""

    n_params: int
    n_embedding: int
    n_lm_head: int
    tied: bool
    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def n_head(self) -> int:
        """Parameters of the lm_head's matmul."""
        return self.n_lm_head

    @property
    def n_body(self) -> int:
        """Parameters in matmuls at every position: all but the embedding lookup and the head."""
        return self.n_params - self.n_embedding - (0 if self.tied else self.n_lm_head)

    @property
    def n_matmul(self) -> int:
        """N of the 2N / 6N rules: body + head (a tied matrix once, the embedding lookup not)."""
        return self.n_body + self.n_head

    @property
    def d_attn(self) -> int:
        """Width of the queries: heads x head_dim."""
        return self.heads * self.head_dim

    def kv_values_per_token(self) -> int:
        """Values cached per token: keys and values of every layer, 2 L n_kv_heads head_dim."""
        return 2 * self.layers * self.kv_heads * self.head_dim


def dims_from_config(config: dict[str, Any], **counts: Any) -> ModelDims:
    """:class:`ModelDims` from a transformers config dict (``num_hidden_layers``,
    ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` or hidden / heads) and the
    parameter counts (``n_params``, ``n_embedding``, ``n_lm_head``, ``tied``)."""
    heads = int(config["num_attention_heads"])
    head_dim = config.get("head_dim") or int(config["hidden_size"]) // heads
    return ModelDims(
        n_params=int(counts["n_params"]),
        n_embedding=int(counts["n_embedding"]),
        n_lm_head=int(counts["n_lm_head"]),
        tied=bool(counts["tied"]),
        layers=int(config["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
    )


def dims_from_ready(ready: dict[str, Any]) -> ModelDims | None:
    """:class:`ModelDims` from a worker's ``ready`` reply (``n_params``, ``n_embedding``,
    ``n_lm_head``, ``tied_embeddings`` and ``model_config``); None when something is missing."""
    cfg = ready.get("model_config")
    if not cfg or ready.get("n_embedding") is None or ready.get("n_lm_head") is None:
        return None
    return dims_from_config(
        cfg,
        n_params=ready["n_params"],
        n_embedding=ready["n_embedding"],
        n_lm_head=ready["n_lm_head"],
        tied=ready.get("tied_embeddings", False),
    )


def model_dims(model) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config fields, parameter counts)`` of a loaded transformers model, for a ready message
    or :func:`dims_from_config`."""
    cfg = model.config
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    fields = {
        k: getattr(text, k, None)
        for k in (
            "num_hidden_layers",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "vocab_size",
        )
    }
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    counts = {
        "n_params": sum(p.numel() for p in model.parameters()),
        "n_embedding": emb.weight.numel() if emb is not None else 0,
        "n_lm_head": head.weight.numel() if head is not None else 0,
        "tied": bool(emb is not None and head is not None and head.weight is emb.weight),
    }
    return fields, counts


# ----------------------------------------------------------------------------------------------
# Counting: FLOPs.


def attention_context(rows: float, prompt_len: float, response_len: float, prompt_rows: float | None = None):
    """Keys attended, summed over the computed positions of a batch (causal attention).

    A sequence of P prompt and R response tokens: position i (1-based) attends to i keys, so the
    prompt's positions sum to P (P + 1) / 2 and the response's to R P + R (R + 1) / 2. The prompt
    part counts ``prompt_rows`` times (the prompts computed: each distinct one once when a side
    shares them; default ``rows``), the response part ``rows`` times. P and R are the batch's
    mean lengths.

    Example: 2 rows of P = 3, R = 2 -> 2 x 6 + 2 x (6 + 3) = 30.
    """
    p, r = float(prompt_len), float(response_len)
    prompt_rows = rows if prompt_rows is None else prompt_rows
    return prompt_rows * p * (p + 1) / 2 + rows * (r * p + r * (r + 1) / 2)


def forward_flops(dims: ModelDims, prompt_tokens: float, response_tokens: float, context: float) -> float:
    """FLOPs of one forward pass that computes log-probs at the response positions.

    forward = 2 N_body (prompt_tokens + response_tokens) + 2 N_head response_tokens
              + 4 L d_attn context

    (2 FLOPs per multiply-add of every matmul weight per token, Kaplan et al. 2020; the lm_head
    only at response positions; attention as in :func:`attention_context`). ``prompt_tokens``
    are the prompt tokens the side computes, ``context`` from :func:`attention_context`."""
    return (
        2.0 * dims.n_body * (prompt_tokens + response_tokens)
        + 2.0 * dims.n_head * response_tokens
        + 4.0 * dims.layers * dims.d_attn * context
    )


def backward_flops(forward: float, *, recompute: float = 0.0) -> float:
    """FLOPs of the backward pass: 2 x forward (gradients with respect to the activations and to
    the weights, one matmul each per forward matmul; Kaplan et al. 2020's 6N = 2N + 4N) plus what
    it recomputes: ``recompute`` = the forward FLOPs again under gradient checkpointing (every
    layer's forward reruns in the backward), plus any recomputed head."""
    return 2.0 * forward + recompute


def decode_flops(
    dims: ModelDims, rows: float, prompt_tokens: float, response_tokens: float, context: float
) -> float:
    """FLOPs of sampling a batch: the prefill runs the body over every prompt token and the head
    once per row (the first sampled token's logits); each generated token after that costs the
    body and the head; attention over the cache as in :func:`attention_context`.

    decode = 2 N_body (prompt_tokens + response_tokens) + 2 N_head response_tokens
             + 4 L d_attn context

    (the head runs once per sampled token: ``rows`` at the prefill + ``response_tokens - rows``
    after it = ``response_tokens``)."""
    del rows  # the head's prefill logits are the first sampled token's: already in response_tokens
    return forward_flops(dims, prompt_tokens, response_tokens, context)


# ----------------------------------------------------------------------------------------------
# Counting: bytes.


def decode_bytes(
    dims: ModelDims,
    *,
    steps: float,
    rows: float,
    prompt_len: float,
    response_len: float,
    weight_bytes: float,
    kv_bytes: float,
) -> dict[str, float]:
    """Bytes a batch's sampling must read from memory, at least.

    weights = N_matmul x weight_bytes x steps: the batch decodes together, so every step (the
        prefill and each later token; ``steps`` = the longest response) reads the matmul weights
        once;
    kv = 2 L n_kv_heads head_dim x kv_bytes x (keys before each generated token, summed): each
        generated token reads the cache of the tokens before it, rows x (R P + R (R - 1) / 2)
        for mean prompt length P and response length R.

    Example: 1 row, P = 3, R = 2 -> the cache read has 3 + 4 = 7 tokens.
    """
    p, r = float(prompt_len), float(response_len)
    kv_tokens = rows * (r * p + r * (r - 1) / 2)
    weights = dims.n_matmul * weight_bytes * steps
    kv = dims.kv_values_per_token() * kv_bytes * kv_tokens
    return {"weights": weights, "kv": kv, "total": weights + kv, "kv_tokens_read": kv_tokens}


def optimizer_bytes(n_trainable: float, *, state_bytes: float = 4.0, clip: bool = True) -> float:
    """Bytes of an AdamW step with gradient clipping, at least.

    AdamW reads the parameters, the gradients and both moments and writes the parameters and both
    moments: 7 x state_bytes per parameter (28 B in float32). Clipping by the global norm reads
    every gradient for the norm and scales it in place (a read and a write): 3 x state_bytes
    more. Total 40 B per float32 parameter with clipping."""
    per = 7.0 + (3.0 if clip else 0.0)
    return per * state_bytes * n_trainable


DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def dtype_name(dtype: Any) -> str:
    """``"float32"``, ``"bfloat16"`` or ``"float16"`` from a torch dtype or its string."""
    text = str(dtype).removeprefix("torch.").lower()
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(text, text)


# ----------------------------------------------------------------------------------------------
# Per-step counts and the table.

# The phases of a step the roofline describes, in display order: (key, label, bound), ``bound``
# saying which peak the fraction is taken against ("flops" or "bytes" or both).
PHASES: tuple[tuple[str, str], ...] = (
    ("generation", "generation (prefill + decode)"),
    ("logprob_passes", "log-prob passes (no grad)"),
    ("forward", "loss forward"),
    ("backward", "backward"),
    ("optimizer", "optimizer (clip + AdamW)"),
)


def step_counts(
    dims: ModelDims,
    step: dict[str, Any],
    *,
    passes: int,
    gradient_checkpointing: bool,
    head_recompute: bool,
    share_prompts: bool,
    weight_bytes: float,
    kv_bytes: float,
    n_trainable: float,
    state_bytes: float = 4.0,
) -> dict[str, dict[str, float]]:
    """FLOPs and bytes of each phase of one step from its token counts.

    ``step`` holds ``batch``, ``prompt_tokens`` (non-padding, every row), ``response_tokens``,
    ``response_len_padded`` (the longest response: decode steps) and, when ``share_prompts``,
    ``distinct_prompt_tokens`` (each distinct prompt once: what a side that shares prompts
    computes in the training and log-prob forwards; sampling always runs every row).

    - generation: :func:`decode_flops`, :func:`decode_bytes`;
    - logprob_passes: ``passes`` x forward (no grad: the reference and/or old policy);
    - forward: one forward (:func:`forward_flops`);
    - backward: :func:`backward_flops`, recomputing the forward less the head under
      ``gradient_checkpointing`` (transformers checkpoints the decoder layers) and the head
      (2 N_head per response token) when ``head_recompute`` (policygrad's fused head loss);
    - optimizer: :func:`optimizer_bytes`, no FLOPs counted (a few per parameter: memory-bound).
    """
    rows = float(step["batch"])
    prompt = float(step["prompt_tokens"])
    resp = float(step["response_tokens"])
    p_mean, r_mean = prompt / rows, resp / rows
    computed_prompt = float(step.get("distinct_prompt_tokens") or prompt) if share_prompts else prompt
    prompt_rows = computed_prompt / p_mean if p_mean else rows
    train_ctx = attention_context(rows, p_mean, r_mean, prompt_rows)
    fwd = forward_flops(dims, computed_prompt, resp, train_ctx)
    head_fwd = 2.0 * dims.n_head * resp
    # checkpointing wraps the decoder layers: everything but the head reruns; a fused head reruns the head
    recompute = (fwd - head_fwd if gradient_checkpointing else 0.0) + (head_fwd if head_recompute else 0.0)
    sample_ctx = attention_context(rows, p_mean, r_mean)
    steps = float(step.get("response_len_padded") or math.ceil(r_mean))
    dbytes = decode_bytes(
        dims, steps=steps, rows=rows, prompt_len=p_mean, response_len=r_mean,
        weight_bytes=weight_bytes, kv_bytes=kv_bytes,
    )  # fmt: skip
    return {
        "generation": {
            "flops": decode_flops(dims, rows, prompt, resp, sample_ctx),
            "bytes": dbytes["total"],
            "bytes_weights": dbytes["weights"],
            "bytes_kv": dbytes["kv"],
        },
        "logprob_passes": {"flops": passes * fwd, "passes": passes},
        "forward": {"flops": fwd},
        "backward": {"flops": backward_flops(fwd, recompute=recompute)},
        "optimizer": {"bytes": optimizer_bytes(n_trainable, state_bytes=state_bytes)},
    }


def matmul_peak(peaks: dict[str, Any], dtype: str) -> float:
    """The best measured matmul FLOP/s of ``dtype`` (square or model-shaped), NaN if unmeasured."""
    d = "bf16" if dtype_name(dtype) in ("bfloat16", "float16") else "fp32"
    values = [peaks.get(f"{d}_square_flops"), peaks.get(f"{d}_model_flops")]
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return max(finite) if finite else math.nan


def bandwidth_peak(peaks: dict[str, Any]) -> float:
    """The best measured memory bandwidth in bytes/s (copy or read), NaN if unmeasured."""
    values = [peaks.get("copy_bytes_per_s"), peaks.get("read_bytes_per_s")]
    finite = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return max(finite) if finite else math.nan


def _median(values: Sequence[float]) -> float:
    finite = sorted(v for v in values if v is not None and math.isfinite(v))
    if not finite:
        return math.nan
    n = len(finite)
    return finite[n // 2] if n % 2 else (finite[n // 2 - 1] + finite[n // 2]) / 2


def side_roofline(
    steps: Sequence[dict[str, Any]],
    counts: Sequence[dict[str, dict[str, float]]],
    peaks: dict[str, Any] | None,
    *,
    train_dtype: str,
    decode_dtype: str,
) -> dict[str, dict[str, float]]:
    """Per phase: median seconds, GFLOP and GB per step, and the medians over steps of the
    achieved GFLOP/s and GB/s with their fractions of the measured peaks (the matmul peak of
    ``decode_dtype`` for generation and of ``train_dtype`` for the rest; the bandwidth peak for
    generation and optimizer). ``steps[i]["splits"]`` holds step i's seconds per phase."""
    peaks = peaks or {}
    bw = bandwidth_peak(peaks)
    out: dict[str, dict[str, float]] = {}
    for key, _label in PHASES:
        dtype = decode_dtype if key == "generation" else train_dtype
        mm = matmul_peak(peaks, dtype)
        secs, flops, nbytes, fps, bps = [], [], [], [], []
        for s, c in zip(steps, counts):
            t = float(s["splits"].get(key) or math.nan)
            f = c.get(key, {}).get("flops", math.nan)
            b = c.get(key, {}).get("bytes", math.nan)
            secs.append(t)
            flops.append(f)
            nbytes.append(b)
            ok = math.isfinite(t) and t > 0
            fps.append(f / t if ok else math.nan)
            bps.append(b / t if ok else math.nan)
        row = {
            "seconds": _median(secs),
            "gflop": _median(flops) / 1e9,
            "gflop_per_s": _median(fps) / 1e9,
            "matmul_peak_dtype": dtype_name(dtype),
            "frac_matmul_peak": _median(fps) / mm if mm and math.isfinite(mm) else math.nan,
            "gb": _median(nbytes) / 1e9,
            "gb_per_s": _median(bps) / 1e9,
            "frac_bandwidth_peak": _median(bps) / bw if bw and math.isfinite(bw) else math.nan,
        }
        out[key] = row
    return out


def step_floor(phases: dict[str, dict[str, float]], peaks: dict[str, Any] | None) -> float:
    """Seconds of one step with every counted phase at its roofline: per phase the larger of its
    GFLOP over the matmul peak of its dtype and its GB over the bandwidth peak, never more than the
    phase measured (a count that overstates a phase's traffic, as the optimizer's 40 B per
    parameter does where caches serve part of it, keeps the measured time); the phases with no
    count (weight sync, other) at zero. ``phases`` is :func:`side_roofline`'s output; NaN when
    ``peaks`` is missing or no phase has a count.

    A lower bound on the step at this precision and this work: a step that must beat it needs
    less work (fewer tokens, a cheaper dtype), not faster code. The bound per phase is the
    roofline model's (Williams, Waterman and Patterson 2009, "Roofline: an insightful visual
    performance model for multicore architectures": attainable FLOP/s = min(peak, intensity x
    bandwidth), so time >= max(FLOP / peak, bytes / bandwidth))."""
    if not peaks:
        return math.nan
    bw = bandwidth_peak(peaks)
    total, counted = 0.0, False
    for row in phases.values():
        mm = matmul_peak(peaks, row.get("matmul_peak_dtype") or "float32")
        bounds = [
            amount * 1e9 / peak
            for amount, peak in ((row.get("gflop"), mm), (row.get("gb"), bw))
            if amount is not None
            and math.isfinite(amount)
            and amount > 0
            and math.isfinite(peak)
            and peak > 0
        ]
        if not bounds:
            continue
        floor = max(bounds)
        seconds = row.get("seconds")
        if seconds is not None and math.isfinite(seconds):
            floor = min(floor, seconds)
        total += floor
        counted = True
    return total if counted else math.nan


def _cell(value: float, digits: int) -> str:
    return f"{value:.{digits}f}" if value is not None and math.isfinite(value) else "-"


def _pct(value: float) -> str:
    return f"{100 * value:.0f} %" if value is not None and math.isfinite(value) else "-"


def peaks_line(peaks: dict[str, Any]) -> str:
    """One sentence with the measured peaks."""
    if not peaks:
        return "Peaks not measured."

    def g(key):
        v = peaks.get(key)
        return f"{v / 1e9:.0f}" if v is not None and math.isfinite(v) else "-"

    shape = "x".join(str(x) for x in peaks.get("model_shape") or ())
    sq = peaks.get("square")
    return (
        f"Measured peaks ({peaks.get('device', 'cpu')}, {peaks.get('threads')} threads): matmul "
        f"{sq}^3 fp32 {g('fp32_square_flops')} / bf16 {g('bf16_square_flops')} GFLOP/s, model-shaped "
        f"[{shape}] fp32 {g('fp32_model_flops')} / bf16 {g('bf16_model_flops')} GFLOP/s; memory copy "
        f"{g('copy_bytes_per_s')} GB/s (read + write), read {g('read_bytes_per_s')} GB/s."
    )


def roofline_markdown(title: str, sides: dict[str, dict[str, dict[str, float]]]) -> str:
    """A markdown table: one row per side and phase, seconds, GFLOP, GFLOP/s, % of the matmul
    peak, GB, GB/s, % of the bandwidth peak."""
    header = [
        title,
        "s",
        "GFLOP",
        "GFLOP/s",
        "% matmul peak",
        "GB moved",
        "GB/s",
        "% bandwidth peak",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join([":---"] + ["---:"] * (len(header) - 1)) + "|"]
    labels = dict(PHASES)
    for side, phases in sides.items():
        for key, row in phases.items():
            if row["gflop"] == 0 and not math.isfinite(row["seconds"]):
                continue  # a phase the side did not run (no log-prob pass at beta = 0)
            dt = "bf16" if row.get("matmul_peak_dtype") in ("bfloat16", "float16") else "fp32"
            pct = _pct(row["frac_matmul_peak"])
            cells = [
                f"{side}: {labels.get(key, key)}",
                _cell(row["seconds"], 2),
                _cell(row["gflop"], 1),
                _cell(row["gflop_per_s"], 1),
                f"{pct} ({dt})" if pct != "-" else "-",
                _cell(row["gb"], 2),
                _cell(row["gb_per_s"], 1),
                _pct(row["frac_bandwidth_peak"]),
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Measuring the peaks (torch imported here only).


def _timer(device: str):
    """``time_fn(fn) -> seconds`` of one call of ``fn``, synchronised on CUDA (events)."""
    import torch

    if device.startswith("cuda"):

        def time_cuda(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1e3

        return time_cuda

    def time_cpu(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return time_cpu


def _best(time_fn, fn, *, warmup: int, reps: int, budget_s: float) -> float:
    """The fastest of ``reps`` timed calls after ``warmup`` untimed ones; stops early (after at
    least 2) once ``budget_s`` has gone."""
    for _ in range(warmup):
        time_fn(fn)
    best, spent = math.inf, 0.0
    for i in range(reps):
        t = time_fn(fn)
        best, spent = min(best, t), spent + t
        if spent > budget_s and i >= 1:
            break
    return best


def measure_peaks(
    threads: int | None = None,
    device: str = "cpu",
    *,
    model_shape: Sequence[int] = (1024, 576, 1536),
    square: int | None = None,
    stream_mb: int | None = None,
    budget_s: float = 2.5,
) -> dict[str, Any]:
    """Measured matmul FLOP/s (float32 and bfloat16) and memory bandwidth of ``device``.

    Matmul: ``square`` x ``square`` @ ``square`` x ``square`` (2048 on a CPU, 8192 on CUDA) and
    the model's shape ``[M x K] @ [K x N]`` (``model_shape`` = (M, K, N), e.g. tokens x hidden @
    hidden x intermediate), 2 M K N FLOPs each, best of several after warm-up. Bandwidth: a copy
    of a ``stream_mb`` MB tensor (512 on a CPU, 4096 on CUDA: far beyond the caches; read + write
    bytes counted) and a ``sum`` over it (read only), best of several. Each measurement stops
    after about ``budget_s`` seconds; the whole probe takes ~20 s on a 2-core CPU.
    On CUDA fp32 matmul runs as true float32 unless TF32 was allowed (torch's default: not)."""
    import torch

    cuda = device.startswith("cuda")
    if threads and not cuda:
        torch.set_num_threads(int(threads))
    square = square or (8192 if cuda else 2048)
    stream_mb = stream_mb or (4096 if cuda else 512)
    time_fn = _timer(device)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(torch.device(device)) if cuda else "cpu",
        "threads": torch.get_num_threads(),
        "square": square,
        "model_shape": list(model_shape),
        "stream_mb": stream_mb,
    }
    start = time.perf_counter()
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for kind, (m, k, n) in (("square", (square, square, square)), ("model", tuple(model_shape))):
            a = torch.randn(m, k, dtype=dtype, device=device)
            b = torch.randn(k, n, dtype=dtype, device=device)
            c = torch.empty(m, n, dtype=dtype, device=device)
            secs = _best(
                time_fn, lambda a=a, b=b, c=c: torch.matmul(a, b, out=c), warmup=2, reps=20, budget_s=budget_s
            )
            out[f"{name}_{kind}_flops"] = 2.0 * m * k * n / secs
            del a, b, c
    numel = stream_mb * 2**20 // 4
    x = torch.ones(numel, dtype=torch.float32, device=device)
    y = torch.empty_like(x)
    secs = _best(time_fn, lambda x=x, y=y: y.copy_(x), warmup=2, reps=10, budget_s=budget_s)
    out["copy_bytes_per_s"] = 2.0 * x.numel() * 4 / secs
    secs = _best(time_fn, lambda x=x: x.sum(), warmup=2, reps=10, budget_s=budget_s)
    out["read_bytes_per_s"] = 1.0 * x.numel() * 4 / secs
    del x, y
    if cuda:
        torch.cuda.empty_cache()
    out["probe_s"] = time.perf_counter() - start
    return out


def measure_peaks_subprocess(threads: int, *, model_shape: Sequence[int], timeout: float = 300.0) -> dict:
    """:func:`measure_peaks` on the CPU in a fresh interpreter with ``threads`` intra-op threads
    (OMP/MKL_NUM_THREADS set as for a benchmark worker), so the caller need not import torch."""
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    argv = [sys.executable, os.path.abspath(__file__), "--threads", str(threads)]
    argv += ["--model-shape", ",".join(str(x) for x in model_shape)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the peak probe failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Measure matmul FLOP/s and memory bandwidth; print JSON.")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--device", default="cpu")
    p.add_argument("--model-shape", default="1024,576,1536", help="M,K,N of the model-shaped matmul")
    args = p.parse_args(argv)
    shape = [int(x) for x in args.model_shape.split(",")]
    print(json.dumps(measure_peaks(args.threads, args.device, model_shape=shape)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
