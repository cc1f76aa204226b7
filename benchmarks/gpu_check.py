"""GPU check: a few GRPO steps of a realistic model shape on one CUDA device, with numbers.

Run on a machine with a CUDA GPU, no network, and only torch, transformers, peft and accelerate
installed (no vLLM, no policygrad install: the repository is put on ``sys.path``)::

    python benchmarks/gpu_check.py                      # Qwen2.5-0.5B's shape, ~2-4 minutes
    python benchmarks/gpu_check.py --shape tiny --allow-cpu   # the same path on a CPU, seconds

What it does: builds a randomly initialised model from a config of Qwen2.5-0.5B's shape (24
layers, hidden 896, 14 heads, 2 KV heads, MLP 4864, tied embeddings, vocabulary 151,936) with a
word-level tokenizer made in memory (``t0`` .. ``tV-1``: any sampled id decodes), writes it to a
temporary folder, and trains it with the trainer's real path (hf engine, ``model.precision``
auto = float32 master weights with bf16 autocast on a bf16 GPU, a KL to the reference in the
loss) for ``--steps`` GRPO steps on prompts of ``--prompt-tokens`` words. Every response runs
to exactly ``--new-tokens`` tokens (``rollout.ignore_eos``), so each step does the same work.
The reward is the share of even token ids in a completion (it varies, so advantages are not 0).

What it reports (the first step is warm-up and left out of the medians): step time; generation
tokens/s; training FLOP/s and MFU against the device's dense bf16 peak (FLOPs: 6 N per trained
token for forward and backward, 2 N per token of each no-grad pass and of generation, N the
parameters that multiply, attention's quadratic term left out, so MFU is a slight undercount);
peak CUDA memory; and, after one more step at lr 1e-6, the share of float32 master weights that
moved (and of their bf16 roundings, which is what bf16 weights stepped by AdamW would keep).
Then (``--staleness-steps``, default 10; 0 skips it) the same config from the same initial
weights runs at ``rollout.max_staleness`` 0 and 1, and the report's ``staleness`` part gives
each one's median step time, the trainer's wait for rollouts, the share of generation hidden
behind training (``async/overlap``), the sampler/trainer gap and the behaviour KL. The hf engine
samples on the same device as the trainer, so the overlap it can reach is bounded by what the
device runs concurrently; a separate inference device is where the lag pays most. Then, where
vLLM is installed (``--server-steps``, default 6; 0 skips it), the report's ``servers`` part
compares generation colocated with the trainer (the in-process vLLM engine) with a rollout
server apart from it (on a second GPU when there is one) at k = 0 and 1.
The report is printed and written to ``--out`` as JSON.

Roofline (``--no-roofline`` skips the probe): before the model is built, the device's bf16 and
fp32 matmul peaks and its memory bandwidth are measured (``benchmarks/_roofline.py``); after the
steps each phase (generation, log-prob passes, loss forward, backward, optimizer) gets its
counted FLOPs and bytes (attention included, see ``_roofline``), achieved FLOP/s and bytes/s, and
their fractions of the measured peaks and of the vendor's dense bf16 peak and HBM bandwidth
(``BF16_PEAKS``, ``HBM_BANDWIDTH``): the MFU of the training phases and how close decoding runs
to the memory bound. The table is printed to stderr after the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from policygrad.config.train import load_config  # noqa: E402
from policygrad.run import Run  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _roofline  # noqa: E402

SHAPES = {
    # Qwen2.5-0.5B's config.json (model_type qwen2), weights random.
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
    },
    # The same code path in seconds on a CPU (a smoke test of this script).
    "tiny": {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "vocab_size": 512,
    },
}

# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) from the vendors' data sheets, matched
# against torch.cuda.get_device_name(); --peak-tflops overrides.
BF16_PEAKS = [
    ("H200", 989.4e12),
    ("H100 PCIe", 756.0e12),
    ("H100 NVL", 835.0e12),
    ("H100", 989.4e12),
    ("GH200", 989.4e12),
    ("B200", 2250e12),
    ("A100", 312.0e12),
    ("L40S", 362.1e12),
    ("L40", 181.0e12),
    ("A10G", 70.0e12),
    ("A10", 125.0e12),
    ("L4", 121.0e12),
    ("RTX 4090", 165.2e12),
    ("RTX 3090", 71.0e12),
]


# Memory bandwidth (bytes/s) from the same data sheets, matched the same way; --hbm-tbps overrides.
HBM_BANDWIDTH = [
    ("H200", 4.8e12),
    ("H100 PCIe", 2.0e12),
    ("H100 NVL", 3.9e12),
    ("H100", 3.35e12),
    ("GH200", 4.0e12),
    ("B200", 8.0e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
    ("L40S", 864e9),
    ("L40", 864e9),
    ("A10G", 600e9),
    ("A10", 600e9),
    ("L4", 300e9),
    ("RTX 4090", 1008e9),
    ("RTX 3090", 936e9),
]


def _lookup(table: list[tuple[str, float]], device_name: str) -> float | None:
    for key, value in table:
        if key in device_name:
            return value
    return None


def bf16_peak(device_name: str) -> float | None:
    """The dense bf16 peak of a device named ``device_name`` (None: not in the table)."""
    return _lookup(BF16_PEAKS, device_name)


def hbm_bandwidth(device_name: str) -> float | None:
    """The memory bandwidth (bytes/s) of a device named ``device_name`` (None: not in the table)."""
    return _lookup(HBM_BANDWIDTH, device_name)


def word_tokenizer(vocab_size: int):
    """A word-level fast tokenizer with ids 0..V-1: ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2, then
    ``t3`` .. ``tV-1``; text splits on whitespace."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def build_model(folder: str, shape: dict, device: torch.device):
    """A randomly initialised float32 model of ``shape`` on ``device``, also written to ``folder``
    (the trainer's reference and engine read its architecture there), and its tokenizer. The
    tokenizer is handed to the trainer as an object: loaded from a folder whose config says
    ``qwen2``, transformers would build Qwen2's own tokenizer around the word vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    fields = dict(shape)
    kind = fields.pop("model_type")
    config = AutoConfig.for_model(kind, **fields, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):  # initialise where it is fast
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=1, pad_token_id=0)
    model.save_pretrained(folder, safe_serialization=True)
    model.name_or_path = model.config._name_or_path = folder
    tokenizer = word_tokenizer(shape["vocab_size"])
    tokenizer.save_pretrained(folder)
    return model, tokenizer


def multiplying_params(model) -> int:
    """Parameters that take part in a matmul per token: all but an untied input embedding (a
    lookup); with tied embeddings the shared matrix is the output head's matmul."""
    total = sum(p.numel() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed
    return total if tied else total - embed.numel()


def even_share(_prompts, completions, **_fields):
    """Share of the completion's tokens whose id is even (``t<id>`` words): varies by sample."""
    out = []
    for text in completions:
        ids = [int(w[1:]) for w in text.split() if w.startswith("t") and w[1:].isdigit()]
        out.append(sum(i % 2 == 0 for i in ids) / max(len(ids), 1))
    return out


def write_prompts(path: str, count: int, words: int, vocab: int) -> None:
    g = torch.Generator().manual_seed(1)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            ids = torch.randint(3, vocab, (words,), generator=g).tolist()
            f.write(json.dumps({"prompt": " ".join(f"t{i}" for i in ids), "answer": "0"}) + "\n")


def run(args) -> dict:
    """The check (see the module docstring); the temporary model folder is deleted after."""
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        raise SystemExit("error: no CUDA device; this check is for a GPU (--allow-cpu runs it on the CPU)")
    device = torch.device("cuda" if cuda else "cpu")
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (bf16_peak(name) if cuda else None)
    shape = SHAPES[args.shape]
    peaks = None
    if not args.no_roofline:  # before the model: the device is empty and cold
        peaks = probe_peaks(device, args, shape)
    work = tempfile.mkdtemp(prefix="policygrad-gpu-check-")
    try:
        report = _run(args, device, name, peak, shape, work, peaks)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the model folder: ~2 GB for the real shape
    return report


def probe_peaks(device, args, shape: dict) -> dict:
    """The device's measured matmul FLOP/s (fp32, bf16; 8192^3 and the model's [tokens x hidden]
    @ [hidden x intermediate]) and memory bandwidth (a 4 GB copy and sum); on a CPU a small,
    fast version of the same (a smoke test, not a measurement)."""
    m = args.micro_batch_size * (args.prompt_tokens + args.new_tokens)
    model_shape = (m, shape["hidden_size"], shape["intermediate_size"])
    if device.type == "cuda":
        return _roofline.measure_peaks(device=str(device), model_shape=model_shape)
    return _roofline.measure_peaks(
        torch.get_num_threads(), "cpu", model_shape=model_shape, square=512, stream_mb=64, budget_s=0.2
    )


def roofline(trainer, rows: list[dict], args, peaks: dict | None, vendor: dict) -> dict:
    """Per phase of the measured steps: FLOPs and bytes counted by ``benchmarks/_roofline.py``
    (forward 2 N_body per computed token + 2 N_head per response token + attention; backward
    2 x forward + recomputation; decode bytes = weights once per step + the KV each token reads;
    AdamW + clipping 40 B per float32 parameter), the achieved rates and their fractions of the
    measured peaks (``measured``) and of the vendor's bf16 peak and HBM bandwidth (``vendor``).
    Compute in the autocast dtype when there is one (the hf engine's weights are read as their
    bf16 autocast copies, cached for the whole generate call)."""
    policy = trainer.policy
    fields, counts = _roofline.model_dims(policy)
    dims = _roofline.dims_from_config(fields, **counts)
    param_dtype = _roofline.dtype_name(next(policy.parameters()).dtype)
    compute = _roofline.dtype_name(trainer.precision.autocast_dtype or next(policy.parameters()).dtype)
    gc = bool(getattr(policy, "is_gradient_checkpointing", False))
    B = args.prompts * args.group_size
    step = {
        "batch": B,
        "prompt_tokens": B * args.prompt_tokens,
        "distinct_prompt_tokens": args.prompts * args.prompt_tokens,
        "response_tokens": B * args.new_tokens,
        "response_len_padded": args.new_tokens,
    }
    steps, all_counts = [], []
    for r in rows:

        def t(key, r=r):
            return float(r.get(f"time/{key}_s", float("nan")))

        nograd = [x for x in (t("ref_logprobs"), t("old_logprobs")) if x > 0]
        splits = {
            "generation": t("generation"),
            "logprob_passes": sum(nograd),
            "forward": t("forward"),
            "backward": t("backward"),
            "optimizer": t("optimizer"),
        }
        steps.append({"splits": splits})
        all_counts.append(
            _roofline.step_counts(
                dims,
                step,
                passes=len(nograd),
                gradient_checkpointing=gc,
                head_recompute=True,  # the fused head loss recomputes the logits in the backward
                share_prompts=not gc,
                weight_bytes=_roofline.DTYPE_BYTES[compute],
                kv_bytes=_roofline.DTYPE_BYTES[compute],
                n_trainable=sum(p.numel() for p in policy.parameters() if p.requires_grad),
                state_bytes=_roofline.DTYPE_BYTES.get(param_dtype, 4),
            )
        )
    kw = {"train_dtype": compute, "decode_dtype": compute}
    out = {
        "compute_dtype": compute,
        "gradient_checkpointing": gc,
        "n_body": dims.n_body,
        "n_head": dims.n_head,
        "measured": _roofline.side_roofline(steps, all_counts, peaks, **kw),
    }
    if vendor:
        out["vendor"] = _roofline.side_roofline(steps, all_counts, vendor, **kw)
    return out


def _run(args, device, name, peak, shape, work, peaks=None) -> dict:
    cuda = device.type == "cuda"
    start = time.perf_counter()
    model, tokenizer = build_model(os.path.join(work, "model"), shape, device)
    params = sum(p.numel() for p in model.parameters())
    data = os.path.join(work, "prompts.jsonl")
    write_prompts(data, args.prompts * (args.steps + 2), args.prompt_tokens, shape["vocab_size"])
    tree = {
        "algorithm": "grpo",
        "steps": args.steps + 1,
        "seed": 0,
        "output_dir": os.path.join(work, "run"),
        "max_minutes": None,
        "eval_before": False,
        "eval_after": False,
        "save_every_minutes": 0,
        "progress": False,
        "tensorboard": False,
        "report_to": ["none"],
        "log_completions": 0,
        "model": {"name": os.path.join(work, "model"), "precision": args.precision},
        "data": {"dataset": data, "eval_size": 0, "max_prompt_length": args.prompt_tokens + 8},
        "rollout": {
            "engine": "hf",
            "prompts_per_step": args.prompts,
            "group_size": args.group_size,
            "max_new_tokens": args.new_tokens,
            "ignore_eos": True,
        },
        "kl": {"placement": "loss", "beta": 0.04},
        "optim": {"lr": 1e-5, "micro_batch_size": args.micro_batch_size},
    }
    cfg = load_config(None, tree)
    staleness_tree = {**tree, "rollout": dict(tree["rollout"])}
    run = Run(cfg, model=model, tokenizer=tokenizer, reward_functions=[even_share])
    trainer = run.trainer
    del model
    setup_s = time.perf_counter() - start
    n_mult = multiplying_params(trainer.policy)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    rows = []
    for _ in range(args.steps):
        rows.append(trainer.step())
    B = args.prompts * args.group_size
    gen_tokens = B * args.new_tokens
    prompt_tokens = B * args.prompt_tokens  # words: one token each
    seq_tokens = prompt_tokens + gen_tokens
    measured = rows[1:]  # the first step is warm-up

    def med(key):
        return statistics.median(float(r.get(key, 0.0)) for r in measured)

    train_flops = 6 * n_mult * seq_tokens
    nograd_passes = (med("time/ref_logprobs_s") > 0) + (med("time/old_logprobs_s") > 0)
    nograd_flops = 2 * n_mult * seq_tokens * nograd_passes
    gen_flops = 2 * n_mult * (prompt_tokens + gen_tokens)
    training_s = med("time/training_s")
    step_s = med("time/step_s")
    report = {
        "device": name,
        "torch": torch.__version__,
        "shape": args.shape,
        "params": params,
        "multiplying_params": n_mult,
        "batch": {"prompts": args.prompts, "group_size": args.group_size, "sequences": B},
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "precision": trainer.precision.name,
        "setup_s": round(setup_s, 1),
        "steps_measured": len(measured),
        "step_s_median": round(step_s, 3),
        "generation_s_median": round(med("time/generation_s"), 3),
        "training_s_median": round(training_s, 3),
        "generation_tokens_per_s": round(gen_tokens / med("time/generation_s"), 1),
        "training_flops_per_step": train_flops + nograd_flops,
        "training_tflops_per_s": round((train_flops + nograd_flops) / training_s / 1e12, 2),
        "step_tflops_per_s": round((train_flops + nograd_flops + gen_flops) / step_s / 1e12, 2),
        "bf16_peak_tflops": peak / 1e12 if peak else None,
        "mfu_training": round((train_flops + nograd_flops) / training_s / peak, 4) if peak else None,
        "mfu_step": round((train_flops + nograd_flops + gen_flops) / step_s / peak, 4) if peak else None,
        "peak_cuda_memory_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None,
        "reward_mean_by_step": [round(float(r["reward/mean"]), 4) for r in rows],
        "response_length_by_step": [float(r["response/length_mean"]) for r in rows],
    }
    hbm = args.hbm_tbps * 1e12 if args.hbm_tbps else (hbm_bandwidth(name) if cuda else None)
    report["hbm_tbps"] = hbm / 1e12 if hbm else None
    vendor = {k: v for k, v in (("bf16_square_flops", peak), ("copy_bytes_per_s", hbm)) if v}
    report["peaks_measured"] = peaks
    report["roofline"] = roofline(trainer, measured, args, peaks, vendor)
    # lr 1e-6: do the float32 master weights move? (bf16 weights stepped directly would not.)
    trainer.set_base_lr(1e-6)
    params_now = [p for p in trainer.policy.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params_now]
    m = trainer.step()
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(params_now, before))
    changed_bf16 = sum(
        int((p.detach().to(torch.bfloat16) != b.to(torch.bfloat16)).sum()) for p, b in zip(params_now, before)
    )
    total = sum(b.numel() for b in before)
    report["lr_1e-6_step_applied"] = bool(m.get("optim/steps", 0))
    report["master_dtype"] = str(params_now[0].dtype).removeprefix("torch.")
    report["lr_1e-6_master_changed_frac"] = round(changed / total, 4)
    report["lr_1e-6_bf16_rounding_changed_frac"] = round(changed_bf16 / total, 4)
    run.close()
    if args.staleness_steps:
        del trainer, run
        report["staleness"] = staleness_check(args, staleness_tree, work, tokenizer, device)
    if args.server_steps:
        report["servers"] = server_check(args, staleness_tree, work, tokenizer, device)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    return report


def _branch_rows(
    tree: dict, work: str, name: str, steps: int, rollout: dict, tokenizer, device
) -> list[dict]:
    """``steps`` steps' metrics of ``tree`` with ``rollout`` changed, from the check's initial
    weights (read again from ``work/model``), written under ``work/name``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.join(work, "model"), dtype=torch.float32).to(device)
    branch = {
        **tree,
        "steps": steps,
        "output_dir": os.path.join(work, name),
        "rollout": {**tree["rollout"], **rollout},
    }
    try:
        run = Run(load_config(None, branch), model=model, tokenizer=tokenizer, reward_functions=[even_share])
        try:
            return [run.trainer.step() for _ in range(steps)]
        finally:
            run.close()
    finally:
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _median(rows: list[dict], key: str) -> float | None:
    """The median of ``key`` over ``rows`` (rounded), None where no row has it."""
    values = [float(r[key]) for r in rows if key in r]
    return round(statistics.median(values), 4) if values else None


def staleness_check(args, tree: dict, work: str, tokenizer, device) -> dict:
    """The same config from the same initial weights at ``rollout.max_staleness`` 0 and 1,
    ``--staleness-steps`` steps each (the first left out of the medians): step time, the
    trainer's wait for rollouts, the share of generation hidden behind training, the sampler /
    trainer gap (at k = 1: proximal vs behaviour) and the behaviour KL."""
    out = {}
    for k in (0, 1):
        rows = _branch_rows(
            tree, work, f"run_k{k}", args.staleness_steps, {"max_staleness": k}, tokenizer, device
        )

        def med(key, measured=rows[1:]):
            return _median(measured, key)

        out[f"k{k}"] = {
            "step_s_median": med("time/step_s"),
            "generation_s_median": med("time/generation_s"),
            "generation_wait_s_median": med("time/generation_wait_s") if k else med("time/generation_s"),
            "overlap_median": med("async/overlap") if k else 0.0,
            "staleness_by_step": [float(r.get("async/staleness", 0.0)) for r in rows],
            "mismatch_logprob_abs_mean": med("mismatch/logprob_abs_mean"),
            "behaviour_kl_median": med("async/behaviour_kl"),
            "is_weight_mean_median": med("mismatch/is_weight_mean"),
            "reward_mean_by_step": [round(float(r["reward/mean"]), 4) for r in rows],
        }
    k0, k1 = out["k0"]["step_s_median"], out["k1"]["step_s_median"]
    out["step_time_k1_over_k0"] = round(k1 / k0, 3) if k0 and k1 else None
    return out


def server_check(args, tree: dict, work: str, tokenizer, device) -> dict:
    """Generation colocated with the trainer (the in-process vLLM engine on the trainer's device)
    against a rollout server apart from it (``rollout.engine: server``, one server the run starts,
    on the next GPU when there is one, else on the same device), at ``rollout.max_staleness`` 0
    and 1, ``--server-steps`` steps each from the same initial weights: step time, generation,
    the trainer's wait, the weight push, tokens per second. Skipped (with the reason) where vLLM
    is not installed."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return {"skipped": "vllm is not installed"}
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    placement = {"server_gpus": [str(1 if gpus > 1 else 0)]} if gpus else {}
    sides = {
        "colocated_k0": {"engine": "vllm"},
        "server_k0": {"engine": "server", "servers": 1, **placement},
        "server_k1": {"engine": "server", "servers": 1, "max_staleness": 1, **placement},
    }
    out = {"server_device": f"cuda:{placement['server_gpus'][0]}" if gpus else "cpu"}
    for name, rollout in sides.items():
        try:
            rows = _branch_rows(tree, work, f"run_{name}", args.server_steps, rollout, tokenizer, device)
        except Exception as err:  # a side that cannot run here is reported, the others still run
            out[name] = {"error": f"{type(err).__name__}: {err}"[:500]}
            continue

        def med(key, measured=rows[1:]):
            return _median(measured, key)

        out[name] = {
            "step_s_median": med("time/step_s"),
            "generation_s_median": med("time/generation_s"),
            "generation_wait_s_median": med("time/generation_wait_s") or med("time/generation_s"),
            "weight_sync_s_median": med("time/weight_sync_s"),
            "tokens_per_s_median": med("perf/tokens_per_s"),
            "reward_mean_by_step": [round(float(r["reward/mean"]), 4) for r in rows],
        }
    return out


def _json_safe(value):
    """``value`` with NaN and infinities as None (strict JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def roofline_text(report: dict) -> str:
    """The roofline as markdown: the measured peaks, then each phase against them and against the
    vendor's bf16 peak and HBM bandwidth (MFU and bandwidth utilisation)."""
    roof = report.get("roofline") or {}
    sides = {f"vs measured ({report['device']})": roof.get("measured") or {}}
    if roof.get("vendor"):
        tf, hbm = report.get("bf16_peak_tflops"), report.get("hbm_tbps")
        sides[f"vs vendor ({tf or '-'} TFLOP/s bf16, {hbm or '-'} TB/s)"] = roof["vendor"]
    return "\n".join(
        [
            _roofline.peaks_line(report.get("peaks_measured") or {}),
            "",
            _roofline.roofline_markdown(f"roofline ({roof.get('compute_dtype')})", sides),
        ]
    )


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--steps", type=int, default=4, help="timed GRPO steps, >= 2 (the first is warm-up)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256, help="every response's length")
    p.add_argument("--micro-batch-size", type=int, default=16)
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16-mixed", "bf16-pure"])
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak")
    p.add_argument("--hbm-tbps", type=float, default=None, help="the device's memory bandwidth, TB/s")
    p.add_argument(
        "--no-roofline",
        action="store_true",
        help="skip the matmul / bandwidth probe (the roofline keeps vendor peaks)",
    )
    p.add_argument("--allow-cpu", action="store_true", help="run without a GPU (the tiny shape)")
    p.add_argument("--out", default=None, help="JSON file for the report (default: print only)")
    p.add_argument(
        "--staleness-steps",
        type=int,
        default=10,
        help="steps of each of the rollout.max_staleness 0 and 1 runs compared after the check (0: skip)",
    )
    p.add_argument(
        "--server-steps",
        type=int,
        default=6,
        help="steps of each side of the colocated vs rollout-server comparison (vLLM only; 0: skip)",
    )
    args = p.parse_args(argv)
    lows = {"steps": 2, "prompts": 1, "group_size": 2, "prompt_tokens": 1, "new_tokens": 1}
    lows["micro_batch_size"] = 1
    for name, low in lows.items():
        if getattr(args, name) < low:
            why = " (the first step is warm-up)" if name == "steps" else ""
            p.error(f"--{name.replace('_', '-')} must be >= {low}{why}")
    if args.staleness_steps and args.staleness_steps < 2:
        p.error("--staleness-steps must be 0 or >= 2 (the first step is warm-up)")
    if args.server_steps and args.server_steps < 2:
        p.error("--server-steps must be 0 or >= 2 (the first step is warm-up)")
    if args.peak_tflops is not None and args.peak_tflops <= 0:
        p.error("--peak-tflops must be > 0")
    if args.hbm_tbps is not None and args.hbm_tbps <= 0:
        p.error("--hbm-tbps must be > 0")
    report = _json_safe(run(args))
    text = json.dumps(report, indent=2)
    print(text)
    print(roofline_text(report), file=sys.stderr)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return report


if __name__ == "__main__":
    main()
