"""policygrad against TRL's GRPOTrainer: one GRPO step, side by side on the same machine.

Both sides train the bundled SmolLM2-135M-Instruct (the safetensors folder policygrad caches),
float32 weights, on the same prompts of the built-in arithmetic task, in the same order, through
the same chat template: 4 prompts x G = 4 samples = 16 sequences per step, at most 64 new tokens,
temperature 1.0, AdamW at a constant learning rate of 2e-5, gradient clipping at 1.0, reward =
policygrad's ``answer_correctness``; once with beta = 0 (no reference model) and once with
beta = 0.04 (policygrad: ``kl.placement=loss``, ``kl.kind=k3``; TRL's default also weights
that term by pi/pi_old, ``use_bias_correction_kl``: one multiply per token more). Batch size, G, length,
temperature and learning rate are read from the policygrad config, so a ``--pg-override`` of one
of them changes both sides. Each side computes in its own default precision, as its users run
it: policygrad in ``model.precision: auto`` (bf16 autocast on CPUs with AVX512-BF16 or AMX, else
fp32), TRL in ``GRPOConfig``'s default (``bf16`` defaults to true in trl 1.16.0: bf16 autocast);
``--trl-override bf16=false`` gives TRL in fp32, the same-precision row against a policygrad run in
fp32 (``--pg-override model.precision=fp32``). Every table names each side's precision and
allocator.

Each side is a worker process of its own (its own peak RSS), kept alive and driven one step at a
time: a warm-up step each (not measured), then ``--steps`` measured steps each, in turn
(policygrad, TRL, policygrad, TRL, ...), so slow drifts of a shared machine hit both alike.

Step time: policygrad, the wall time around ``Trainer.step()``; TRL, from ``on_step_begin`` to
``on_step_end`` (its generation, loss, backward, gradient clipping, optimizer and scheduler step).
The split of a TRL step comes from timers around its methods: generation = its
``_generate_and_score_completions`` (sampling, decoding, rewards, advantages) minus the no-grad
log-prob passes inside it; log-prob passes = ``_get_per_token_logps_and_entropies`` under no grad
(old and reference log-probs); loss forward = ``compute_loss``; backward = ``accelerator.backward``
(with TRL's default gradient checkpointing this includes the recomputed forward); optimizer =
``_clip_grad_norm`` + ``optimizer.step``. policygrad reports the same phases itself
(``time/*_s`` metrics). Tokens/s = (non-padding prompt tokens + response tokens of the batch) /
step time.

Equal work (``--equal-length``): every response on both sides runs to exactly ``max_new_tokens``
tokens, so a step-time ratio compares the same number of tokens whatever each policy would write
(policygrad: ``rollout.ignore_eos``, an end-of-sequence id sampled as a plain token; TRL:
``generation_kwargs={"min_new_tokens": N}``, transformers suppressing end-of-sequence until N).
Without it the two policies' answers may differ in length after the first update.

Roofline: before the workers start, ``_roofline.measure_peaks`` measures the machine's matmul
FLOP/s (fp32, bf16) and memory bandwidth in a process of its own with the sides' thread count;
each run then gets, per side and phase, the counted FLOPs (and, for generation and the
optimizer, bytes) of its steps, the achieved rates and their fractions of those peaks (the
``roofline`` key of each run, a table in the report; ``--no-roofline`` skips the probe). The
counting is documented in ``benchmarks/_roofline.py``.

Usage::

    python benchmarks/grpo_vs_trl.py --quick --pg-engine hf
    python benchmarks/grpo_vs_trl.py --steps 5 --update-readme
    python benchmarks/grpo_vs_trl.py --steps 5 --equal-length

Writes ``benchmarks/results/<date>-grpo-vs-trl.json`` (every step's raw numbers, the settings and
the machine) and prints one markdown table per beta.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    SPLITS,
    Channel,
    Worker,
    add_common_options,
    add_other,
    as_float,
    fmt,
    log_dir,
    machine_description,
    machine_line,
    markdown_table,
    median,
    nan_to_none,
    new_result_path,
    peak_rss_gb,
    policygrad_config,
    policygrad_splits,
    run_main,
    serve_policygrad,
    set_threads,
    today,
    update_readme_section,
    warn_if_busy,
    write_json,
)
from _roofline import (
    DTYPE_BYTES,
    dims_from_ready,
    dtype_name,
    measure_peaks_subprocess,
    model_dims,
    peaks_line,
    roofline_markdown,
    side_roofline,
    step_counts,
    step_floor,
)

MODEL = "bundled:smollm2-135m-instruct"
README_SECTION = "grpo-vs-trl"


def policygrad_settings(*, beta: float, seed: int, engine: str, threads: int, steps: int, output_dir: str):
    """The policygrad config of the comparison (a nested dict for ``load_config``)."""
    if beta > 0:
        kl = {"placement": "loss", "kind": "k3", "beta": beta}
    else:
        kl = {"placement": "none", "beta": 0.0}
    return {
        "algorithm": "grpo",
        "steps": steps,
        "seed": seed,
        "output_dir": output_dir,
        "overwrite": True,
        "max_minutes": None,
        "eval_before": False,
        "eval_after": False,
        "eval_every": 0,
        "save_every": 0,
        "log_completions": 0,
        "num_threads": threads,
        "tensorboard": False,
        "progress": False,
        "model": {"name": MODEL, "dtype": "float32"},
        "data": {"dataset": "builtin:arithmetic", "eval_size": 0},
        "rollout": {
            "engine": engine,
            "prompts_per_step": 4,
            "group_size": 4,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": 0,
            "max_new_tokens": 64,
            # memory-lean: 16 x 110 tokens need ~80 MB of KV cache, not the default 1 GB
            "vllm_kv_cache_gb": 0.125,
        },
        "reward": {"functions": ["answer_correctness"]},
        "kl": kl,
        "optim": {
            "lr": 2e-5,
            "schedule": "constant",
            "warmup_steps": 0,
            "max_grad_norm": 1.0,
            "weight_decay": 0.0,
            "ppo_epochs": 1,
            "num_minibatches": 1,
            # every row forwarded, as TRL does: the same work on both sides (policygrad's default
            # skips the rows whose advantages are all 0; benchmarks/levers.py --lever skip_rows)
            "skip_zero_advantage_rows": False,
            # optim.micro_batch_size stays at its default (32): the 16 sequences in one forward,
            # as TRL runs them. In bf16 autocast that is 0.81x micro-batches of 4 and no more
            # peak RSS (levers.py --lever micro_batch).
        },
    }


# ----------------------------------------------------------------------------------------------
# The TRL worker.


class _Quit(Exception):
    """The coordinator asked the TRL worker to stop in the middle of ``trainer.train()``."""


def _message_text(value: Any, role: str) -> str:
    """The text of a conversational prompt/completion (a list of messages), or the string itself."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = [m.get("content") for m in value if isinstance(m, dict) and m.get("role") == role]
        return "".join(p for p in parts if isinstance(p, str))
    return str(value)


def answer_correctness_reward(prompts, completions, answer=None, **_):
    """policygrad's ``answer_correctness`` in TRL's ``reward_funcs`` signature (conversational
    prompts and completions are lists of messages; the row's ``answer`` column arrives as a
    keyword)."""
    # imported here: only the TRL worker scores; the coordinator imports this module without torch
    from policygrad.rewards.verifiers import answer_correctness

    texts = [_message_text(c, "assistant") for c in completions]
    prompt_texts = [_message_text(p, "user") for p in prompts]
    return answer_correctness(prompt_texts, texts, answer=answer)


def trl_trainer(spec: dict[str, Any]):
    """TRL's GRPOTrainer on the spec's rows, model and settings; returns ``(trainer, config)``."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rows = spec["rows"]
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r.get("answer")} for r in rows]
    )
    # No precision here: TRL computes in GRPOConfig's default, bf16 autocast (its ``bf16`` defaults
    # to ``not fp16``), as its users run it; ``--trl-override bf16=false`` gives fp32.
    kwargs = {
        "output_dir": spec["output_dir"],
        "use_cpu": True,
        "per_device_train_batch_size": spec["batch"],
        "num_generations": spec["group_size"],
        "max_completion_length": spec["max_new_tokens"],
        "report_to": "none",
        "learning_rate": spec["lr"],
        "beta": spec["beta"],
        "temperature": spec["temperature"],
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "save_strategy": "no",
        "seed": spec["seed"],
        "max_steps": spec["steps_total"],
        # The dataset rows are already in policygrad's order; no shuffling keeps it.
        "shuffle_dataset": False,
    }
    kwargs.update(spec.get("trl_overrides", {}))
    config = GRPOConfig(**kwargs)
    trainer = GRPOTrainer(
        model=spec["model_path"],
        reward_funcs=[answer_correctness_reward],
        args=config,
        train_dataset=dataset,
    )
    return trainer, config


def trl_precision(bf16: bool | None, fp16: bool | None) -> str:
    """The name of TRL's compute precision for GRPOConfig's ``bf16`` and ``fp16`` fields; ``bf16``
    None is GRPOConfig's default, which trl 1.16.0 resolves to ``not fp16``."""
    if bf16 is None:
        bf16 = not fp16
    return "bf16 (autocast)" if bf16 else ("fp16" if fp16 else "fp32")


def expected_trl_precision(trl_overrides: dict[str, Any]) -> str:
    """TRL's precision under ``--trl-override`` (its default, bf16 autocast, without one); the
    worker reports what its GRPOConfig resolved to."""
    return trl_precision(trl_overrides.get("bf16"), trl_overrides.get("fp16"))


def slow_trl_precision(trl_overrides: dict[str, Any], fast_bf16: bool | None = None) -> str | None:
    """Why TRL's precision cannot be measured here, or None: its default, bf16 autocast (no
    ``bf16`` in ``--trl-override``), on a CPU without AVX512-BF16 or AMX, which emulates bf16 (a
    2048^3 bf16 matmul measured about 1 GFLOP/s on an AVX2-only EPYC against 181 in fp32), so a
    TRL step would take many minutes. An explicit ``bf16=true`` runs it anyway.
    ``fast_bf16``: a seam for tests (None: :func:`policygrad.parallel.precision.cpu_has_fast_bf16`)."""
    if "bf16" in trl_overrides or "fp16" in trl_overrides:
        return None
    if fast_bf16 is None:
        # imported here: keeps torch out of the coordinator's start
        from policygrad.parallel.precision import cpu_has_fast_bf16

        fast_bf16 = cpu_has_fast_bf16()
    if fast_bf16:
        return None
    return (
        "TRL's default precision, bf16 autocast, is emulated on this CPU (no AVX512-BF16 or AMX: its "
        "bf16 matmuls run near 1 GFLOP/s), so a TRL step would take many minutes; pass --trl-override "
        "bf16=false for both sides in fp32 (policygrad's model.precision=auto is fp32 here), or "
        "--trl-override bf16=true to run it anyway"
    )


def refuse_slow_trl_precision(parser: argparse.ArgumentParser, trl_override: list[str]) -> None:
    """``parser.error`` with :func:`slow_trl_precision`'s reason, when there is one."""
    slow = slow_trl_precision(parse_trl_overrides(trl_override))
    if slow:
        parser.error(slow)


def trl_spec_from(
    cfg, *, beta: float, steps_total: int, threads: int, output_dir: str, trl_overrides: dict[str, Any]
) -> dict[str, Any]:
    """The TRL side's spec (for :func:`trl_trainer`) matching the policygrad config ``cfg``: its
    first ``prompts_per_step * steps_total`` train rows in order, its model folder, batch, G,
    length, temperature, learning rate and seed; ``beta`` as given."""
    # imported here: they load torch, which the coordinator does not otherwise import
    from policygrad.data.sources import build_train_source
    from policygrad.models.loading import resolve_model_path

    r = cfg.rollout
    source = build_train_source(cfg.data, seed=cfg.seed)
    rows = [source.train_row(i) for i in range(r.prompts_per_step * steps_total)]
    return {
        "model_path": resolve_model_path(cfg.model.name),
        "rows": [{"prompt": row["prompt"], "answer": row.get("answer")} for row in rows],
        "batch": r.prompts_per_step * r.group_size,
        "group_size": r.group_size,
        "max_new_tokens": r.max_new_tokens,
        "temperature": r.temperature,
        "lr": cfg.optim.lr,
        "beta": beta,
        "seed": cfg.seed,
        "steps_total": steps_total,
        "threads": threads,
        "output_dir": output_dir,
        "trl_overrides": trl_overrides,
    }


def _instrument(trainer, timers: dict[str, float], batch_info: dict[str, Any]) -> None:
    """Wrap the trainer's phases so each adds its wall time to ``timers``; the generation wrapper
    also records the batch's shape in ``batch_info``."""
    import torch

    def timed(key, fn, *, nograd_key=None):
        def wrapper(*args, **kw):
            name = nograd_key if nograd_key and not torch.is_grad_enabled() else key
            start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                timers[name] = timers.get(name, 0.0) + time.perf_counter() - start
                timers[f"{name}_calls"] = timers.get(f"{name}_calls", 0) + 1  # the roofline's passes

        return wrapper

    gas = trainer._generate_and_score_completions

    def generate_and_score(*args, **kw):
        start = time.perf_counter()
        out = gas(*args, **kw)
        timers["generate_and_score"] = timers.get("generate_and_score", 0.0) + time.perf_counter() - start
        if isinstance(out, dict) and "prompt_mask" in out and "completion_mask" in out:
            batch_info.update(
                {
                    "batch": int(out["prompt_mask"].shape[0]),
                    "prompt_tokens": int(out["prompt_mask"].sum()),
                    "response_tokens": int(out["completion_mask"].sum()),
                    "prompt_len_padded": int(out["prompt_mask"].shape[1]),
                    "response_len_padded": int(out["completion_mask"].shape[1]),
                }
            )
        return out

    trainer._generate_and_score_completions = generate_and_score
    trainer._generate = timed("sampling", trainer._generate)
    trainer._get_per_token_logps_and_entropies = timed(
        "logps_grad", trainer._get_per_token_logps_and_entropies, nograd_key="logps_nograd"
    )
    trainer.compute_loss = timed("compute_loss", trainer.compute_loss)
    trainer.accelerator.backward = timed("backward", trainer.accelerator.backward)
    trainer._clip_grad_norm = timed("clip", trainer._clip_grad_norm)


def _probe(chan: Channel, timers: dict[str, float], batch_info: dict[str, Any]):
    """The callback that paces TRL's loop: it blocks before each step until the coordinator says
    ``step`` and replies with the step's timings after it."""
    import torch
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        """Blocks before each step until the coordinator says ``step``; replies after it."""

        def __init__(self):
            self.pending: dict[str, Any] | None = None
            self.start = 0.0
            self.optimizer_start = 0.0

        def flush(self):
            if self.pending is not None:
                chan.send(self.pending)
                self.pending = None

        def on_step_begin(self, _args, _state, _control, **_kw):
            self.flush()
            cmd = chan.recv()
            if cmd.get("cmd") != "step":
                raise _Quit
            timers.clear()
            batch_info.clear()
            self.start = time.perf_counter()

        # optimizer.step() runs between these two events (patching it would trip the LR
        # scheduler's check that optimizer.step was not replaced).
        def on_pre_optimizer_step(self, _args, _state, _control, **_kw):
            self.optimizer_start = time.perf_counter()

        def on_optimizer_step(self, _args, _state, _control, **_kw):
            elapsed = time.perf_counter() - self.optimizer_start
            timers["optimizer_step"] = timers.get("optimizer_step", 0.0) + elapsed

        def on_step_end(self, _args, state, _control, **_kw):
            wall = time.perf_counter() - self.start
            nograd = timers.get("logps_nograd", 0.0)
            splits = {
                "step": wall,
                "generation": timers.get("generate_and_score", 0.0) - nograd,
                "logprob_passes": nograd,
                "forward": timers.get("compute_loss", 0.0),
                "backward": timers.get("backward", 0.0),
                "optimizer": timers.get("clip", 0.0) + timers.get("optimizer_step", 0.0),
                "weight_sync": math.nan,
            }
            self.pending = {
                "ok": True,
                "event": "step",
                "wall_s": wall,
                "splits": splits,
                "timers": dict(timers),
                "global_step": state.global_step,
                "peak_rss_gb": peak_rss_gb(),
                "threads": torch.get_num_threads(),
                **batch_info,
            }

        def on_log(self, _args, _state, _control, logs=None, **_kw):
            if self.pending is not None and logs:
                self.pending["trl_logs"] = {k: as_float(v) for k, v in logs.items()}
            self.flush()

        def on_train_end(self, _args, _state, _control, **_kw):
            self.flush()

    return Probe()


def serve_trl(spec: dict[str, Any]) -> None:
    """Worker main loop for the TRL side: build a GRPOTrainer, instrument it, reply ``ready``,
    then let ``trainer.train()`` run with a callback that waits for a ``step`` command before each
    step and replies after it."""
    chan = Channel.claim()
    try:
        t0 = time.perf_counter()
        threads = set_threads(int(spec["threads"]))
        trainer, config = trl_trainer(spec)
        timers: dict[str, float] = {}
        batch_info: dict[str, Any] = {}
        _instrument(trainer, timers, batch_info)
        probe = _probe(chan, timers, batch_info)
        trainer.add_callback(probe)
        model = trainer.model
        model_config, counts = model_dims(model)
        chan.send(
            {
                "ok": True,
                "event": "ready",
                "load_s": time.perf_counter() - t0,
                "dtype": str(next(model.parameters()).dtype),
                "precision": trl_precision(config.bf16, config.fp16),
                "compute_dtype": "bfloat16" if config.bf16 else ("float16" if config.fp16 else "float32"),
                "allocator": os.environ.get("LD_PRELOAD") or "glibc",
                "n_params": counts["n_params"],
                "n_embedding": counts["n_embedding"],
                "n_lm_head": counts["n_lm_head"],
                "tied_embeddings": counts["tied"],
                "model_config": model_config,
                "reference_model": trainer.ref_model is not None,
                "gradient_checkpointing": bool(config.gradient_checkpointing),
                "model_gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
                "optim": str(config.optim),
                "loss_type": str(config.loss_type),
                "threads": threads,
                "grpo_config": {k: str(v) for k, v in config.to_dict().items()},
                "peak_rss_gb": peak_rss_gb(),
            }
        )
    except BaseException as exc:  # noqa: BLE001 - reported to the coordinator
        chan.fail(exc)
        raise SystemExit(1) from None
    try:
        trainer.train()
        probe.flush()
    except _Quit:
        chan.send({"ok": True, "event": "bye", "peak_rss_gb": peak_rss_gb()})
        return
    except BaseException as exc:  # noqa: BLE001 - reported to the coordinator
        chan.fail(exc)
        raise SystemExit(1) from None
    while True:  # max_steps reached: only "quit" is left to answer
        cmd = chan.recv()
        if cmd.get("cmd") == "quit":
            chan.send({"ok": True, "event": "bye", "peak_rss_gb": peak_rss_gb()})
            return
        chan.send({"ok": False, "error": f"TRL ran its max_steps={spec['steps_total']}; no step left"})


# ----------------------------------------------------------------------------------------------
# The coordinator.


def _side_summary(steps: list[dict[str, Any]], peak: float, tree_peak: float) -> dict[str, Any]:
    def tokens(s):
        return as_float(s.get("prompt_tokens")) + as_float(s.get("response_tokens"))

    out: dict[str, Any] = {k: median(s["splits"].get(k) for s in steps) for k, _ in SPLITS}
    out["step"] = median(s["splits"]["step"] for s in steps)
    out["step_min"] = min(s["splits"]["step"] for s in steps)
    out["step_max"] = max(s["splits"]["step"] for s in steps)
    out["tokens_per_s"] = median(tokens(s) / s["splits"]["step"] for s in steps)
    out["response_tokens_per_s"] = median(
        as_float(s.get("response_tokens")) / s["splits"]["step"] for s in steps
    )
    out["prompt_tokens"] = median(s.get("prompt_tokens") for s in steps)
    out["response_length_mean"] = median(
        as_float(s.get("response_tokens")) / as_float(s.get("batch")) for s in steps
    )
    out["peak_rss_gb"] = peak
    out["peak_rss_tree_gb"] = tree_peak
    return out


def _steps_with_splits(side: str, replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for r in replies:
        r["splits"] = add_other(policygrad_splits(r) if side == "policygrad" else dict(r["splits"]))
    return replies


def side_env(side: str, args) -> dict[str, str]:
    """The allocator of a side: policygrad's worker gets the one the ``policygrad`` command
    preloads on this machine (:mod:`policygrad.allocator`), as a user's run has it; TRL's runs
    with glibc's malloc, as a TRL script does, unless ``--trl-allocator same``."""
    from policygrad.allocator import plan_preload

    library = plan_preload(os.environ, sys.platform)
    if library is None or (side == "trl" and args.trl_allocator == "glibc"):
        return {"LD_PRELOAD": ""}
    return {"LD_PRELOAD": library}


def run_beta(
    args, beta: float, machine_logs: Path, machine_peaks: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Both workers for one beta: load, warm up, alternate measured steps, collect."""
    steps_total = args.warmup + args.steps
    tag = f"beta{beta:g}"
    scratch = Path(tempfile.mkdtemp(prefix=f"pg-bench-{tag}-"))
    base = policygrad_settings(
        beta=beta,
        seed=args.seed,
        engine=args.pg_engine,
        threads=args.threads,
        steps=steps_total,
        output_dir=str(scratch / "policygrad-run"),
    )
    overrides = list(args.pg_override) + (["--rollout.ignore_eos=true"] if args.equal_length else [])
    cfg = policygrad_config(base, overrides)  # validates the overrides before any worker starts
    r = cfg.rollout
    pg_spec = {"config": base, "overrides": overrides, "threads": args.threads}
    trl_overrides = parse_trl_overrides(args.trl_override)
    if args.equal_length:  # transformers' generate suppresses EOS until N tokens: every completion is N long
        generation = dict(trl_overrides.get("generation_kwargs") or {})
        trl_overrides["generation_kwargs"] = {**generation, "min_new_tokens": r.max_new_tokens}
    trl_spec = trl_spec_from(
        cfg,
        beta=beta,
        steps_total=steps_total,
        threads=args.threads,
        output_dir=str(scratch / "trl-run"),
        trl_overrides=trl_overrides,
    )
    rows = trl_spec["rows"]
    specs = {}
    for side, spec in (("policygrad", pg_spec), ("trl", trl_spec)):
        path = scratch / f"{side}-spec.json"
        path.write_text(json.dumps(spec), encoding="utf-8")
        specs[side] = path

    workers: dict[str, Worker] = {}
    ready: dict[str, Any] = {}
    replies: dict[str, list[dict[str, Any]]] = {"policygrad": [], "trl": []}
    finals: dict[str, Any] = {}
    try:
        for side in ("policygrad", "trl"):  # one at a time: loading is not measured, but it is heavy
            _say(f"[beta={beta:g}] starting the {side} worker")
            workers[side] = Worker(
                [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--spec", str(specs[side])],
                name=f"{side} worker (beta={beta:g})",
                log_path=machine_logs / f"{tag}-{side}.log",
                threads=args.threads,
                env=side_env(side, args),
            )
            ready[side] = workers[side].receive(args.load_timeout)
            if side == "policygrad":
                detail = f"engine {ready[side].get('engine')}"
            else:
                detail = (
                    f"gradient checkpointing {'on' if ready[side].get('gradient_checkpointing') else 'off'}"
                )
            _say(f"[beta={beta:g}] {side} ready in {ready[side]['load_s']:.1f} s ({detail})")
        for i in range(steps_total):
            label = "warm-up" if i < args.warmup else f"{i - args.warmup + 1}/{args.steps}"
            for side in ("policygrad", "trl"):
                reply = workers[side].request({"cmd": "step"}, args.step_timeout)
                reply["index"] = i
                reply["warmup"] = i < args.warmup
                replies[side].append(reply)
                resp = reply.get("response_tokens")
                _say(
                    f"[beta={beta:g}] {side:10s} step {label:8s} {reply['wall_s']:7.2f} s"
                    + (f"  ({resp} response tokens)" if resp is not None else "")
                )
    finally:
        for side, worker in workers.items():
            finals[side] = worker.close()
        # The raw replies survive whatever happens next.
        raw = {"beta": beta, "ready": ready, "replies": replies, "finals": finals}
        (machine_logs / f"{tag}-raw.json").write_text(json.dumps(nan_to_none(raw)), encoding="utf-8")
        shutil.rmtree(scratch, ignore_errors=True)  # specs and the two run folders; logs stay
    result: dict[str, Any] = {"beta": beta, "rows": rows, "sides": {}}
    for side in ("policygrad", "trl"):
        all_steps = _steps_with_splits(side, replies[side])
        measured = [s for s in all_steps if not s["warmup"]]
        peaks = [as_float(s.get("peak_rss_gb")) for s in all_steps]
        if finals.get(side):
            peaks.append(as_float(finals[side].get("peak_rss_gb")))
        peak = max((p for p in peaks if math.isfinite(p)), default=math.nan)
        worker = workers[side]
        result["sides"][side] = {
            "ready": ready[side],
            "steps": all_steps,
            "peak_rss_gb": peak,
            "peak_rss_tree_gb": worker.tree_rss_peak_gb,
            "max_child_processes": worker.max_children,
            "summary": _side_summary(measured, peak, worker.tree_rss_peak_gb),
            "log": str(worker.log_path),
        }
    pg, trl = (result["sides"][s]["summary"] for s in ("policygrad", "trl"))
    result["ratio_step_time"] = pg["step"] / trl["step"] if trl["step"] else math.nan
    result["ratio_peak_rss"] = pg["peak_rss_gb"] / trl["peak_rss_gb"] if trl["peak_rss_gb"] else math.nan
    result["roofline"] = {
        side: side_roofline_of(side, result["sides"][side], machine_peaks) for side in result["sides"]
    }
    pg_prompts = [s.get("prompt_tokens") for s in result["sides"]["policygrad"]["steps"]]
    trl_prompts = [s.get("prompt_tokens") for s in result["sides"]["trl"]["steps"]]
    result["same_prompt_tokens"] = pg_prompts == trl_prompts
    return result


def side_roofline_of(side: str, data: dict[str, Any], peaks: dict[str, Any] | None) -> dict[str, Any] | None:
    """The roofline of one side of a run (``data`` = ``result["sides"][side]``): per phase the
    median seconds, counted GFLOP and GB per step, achieved GFLOP/s and GB/s and their fractions
    of the measured peaks (``_roofline.side_roofline``), with the per-step counts and what they
    assumed. None when the ready reply lacks the model's dimensions."""
    ready = data["ready"]
    dims = dims_from_ready(ready)
    measured = [s for s in data["steps"] if not s.get("warmup") and s.get("batch")]
    if dims is None or not measured:
        return None
    gc = bool(ready.get("gradient_checkpointing"))
    train_dtype = dtype_name(ready.get("compute_dtype") or ready.get("dtype"))
    if side == "policygrad":
        decode_dtype = dtype_name(ready.get("engine_dtype") or train_dtype)
        # fused head loss: the logits are recomputed in the backward; each distinct prompt runs
        # once in the training forwards unless gradient checkpointing is on
        head_recompute, share = True, not gc
        n_trainable = ready.get("n_trainable") or ready["n_params"]
    else:
        decode_dtype, head_recompute, share, n_trainable = train_dtype, False, False, ready["n_params"]
    if decode_dtype not in DTYPE_BYTES:
        decode_dtype = train_dtype
    counts = []
    for s in measured:
        if side == "policygrad":
            m = s.get("metrics", {})
            passes = sum(as_float(m.get(f"time/{k}_s")) > 0 for k in ("ref_logprobs", "old_logprobs"))
        else:
            passes = int((s.get("timers") or {}).get("logps_nograd_calls") or 0)  # absent: no pass
        counts.append(
            step_counts(
                dims,
                s,
                passes=int(passes),
                gradient_checkpointing=gc,
                head_recompute=head_recompute,
                share_prompts=share,
                weight_bytes=DTYPE_BYTES[decode_dtype],
                kv_bytes=DTYPE_BYTES[decode_dtype],
                n_trainable=n_trainable,
                state_bytes=DTYPE_BYTES.get(dtype_name(ready.get("dtype")), 4),  # parameters and AdamW state
            )
        )
    return {
        "phases": side_roofline(measured, counts, peaks, train_dtype=train_dtype, decode_dtype=decode_dtype),
        "per_step": counts,
        "assumptions": {
            "n_body": dims.n_body,
            "n_head": dims.n_head,
            "n_matmul": dims.n_matmul,
            "train_dtype": train_dtype,
            "decode_dtype": decode_dtype,
            "gradient_checkpointing": gc,
            "head_recomputed_in_backward": head_recompute,
            "prompts_computed": "each distinct prompt once" if share else "every row's prompt",
        },
    }


def parse_trl_overrides(items: list[str]) -> dict[str, Any]:
    import yaml

    out = {}
    for item in items:
        key, sep, raw = item.removeprefix("--").partition("=")
        if not sep or not key:
            raise SystemExit(f"--trl-override needs key=value, got {item!r}")
        out[key] = yaml.safe_load(raw)
    return out


def _measure_peaks(threads: int, cfg) -> dict[str, Any] | None:
    """The machine's matmul and memory-bandwidth peaks, measured in a process of its own with the
    sides' thread count before any worker starts; the model-shaped matmul is one micro-batch's
    response tokens x hidden @ hidden x intermediate. None (and a warning) when the probe fails."""
    # imported here: resolving the bundled model's path loads torch, which the coordinator defers
    from policygrad.models.loading import resolve_model_path

    r = cfg.rollout
    try:
        config = json.loads((Path(resolve_model_path(cfg.model.name)) / "config.json").read_text("utf-8"))
        k, n = int(config["hidden_size"]), int(config.get("intermediate_size") or 4 * config["hidden_size"])
    except (OSError, KeyError, ValueError):
        k, n = 576, 1536
    m = max(1, min(cfg.optim.micro_batch_size or 16, r.prompts_per_step * r.group_size)) * r.max_new_tokens
    _say(f"measuring the matmul and memory-bandwidth peaks ({threads} threads, model shape {m}x{k}x{n})")
    try:
        peaks = measure_peaks_subprocess(threads, model_shape=(m, k, n))
    except (RuntimeError, OSError, ValueError) as exc:
        _say(f"warning: the peak probe failed, no roofline: {exc}")
        return None
    _say(peaks_line(peaks))
    return peaks


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _ratio(a: float, b: float) -> str:
    return fmt(a / b) if math.isfinite(a) and math.isfinite(b) and b else "-"


def beta_table(run: dict[str, Any], trl_version: str | None) -> str:
    """Markdown table of one beta: medians of both sides and their ratio."""
    pg, trl = (run["sides"][s]["summary"] for s in ("policygrad", "trl"))
    pg_ready, trl_ready = run["sides"]["policygrad"]["ready"], run["sides"]["trl"]["ready"]
    engine = pg_ready.get("engine", "?")
    gc = "on" if trl_ready.get("gradient_checkpointing") else "off"

    def how(ready):
        alloc = os.path.basename(ready.get("allocator") or "glibc").split(".so")[0].removeprefix("lib")
        return f"{ready.get('precision', '?')}, {alloc}"

    header = [
        f"beta = {run['beta']:g}",
        f"policygrad ({engine}; {how(pg_ready)})",
        f"TRL {trl_version or ''} (grad. ckpt {gc}; {how(trl_ready)})".replace("  ", " "),
        "policygrad / TRL",
    ]
    rows = [
        [
            "**step time, median (s)**",
            f"**{fmt(pg['step'])}**",
            f"**{fmt(trl['step'])}**",
            f"**{_ratio(pg['step'], trl['step'])}**",
        ]
    ]
    for key, label in SPLITS:
        if key == "weight_sync" and not math.isfinite(as_float(pg.get(key))):
            continue
        rows.append([f"  {label}", fmt(pg[key]), fmt(trl[key]), _ratio(pg[key], trl[key])])
    for key, label, digits in (
        ("tokens_per_s", "tokens/s (prompt + response)", 0),
        ("response_tokens_per_s", "response tokens/s", 1),
        ("response_length_mean", "response length, mean (tokens)", 1),
        ("peak_rss_gb", "peak RSS (GB)", 2),
    ):
        rows.append([label, fmt(pg[key], digits), fmt(trl[key], digits), _ratio(pg[key], trl[key])])
    return markdown_table(header, rows)


def floor_line(run: dict[str, Any], peaks: dict[str, Any] | None) -> str:
    """One sentence per beta: each side's step at the roofline (``_roofline.step_floor``) and
    what that is as a fraction of TRL's measured step; empty without peaks or TRL's step."""
    trl = as_float(run["sides"].get("trl", {}).get("summary", {}).get("step"))
    floors = {
        ("policygrad" if side == "policygrad" else "TRL"): step_floor(roof["phases"], peaks)
        for side, roof in (run.get("roofline") or {}).items()
        if roof
    }
    parts = [
        f"{side} {floor:.2f} s ({floor / trl:.2f}x TRL's measured {trl:.2f} s)"
        for side, floor in floors.items()
        if math.isfinite(floor) and math.isfinite(trl) and trl > 0
    ]
    if not parts:
        return ""
    return (
        f"At the roofline, beta = {run['beta']:g} (each counted phase at the matmul peak of its dtype or "
        f"the bandwidth peak, whichever binds; weight sync and other at zero): " + "; ".join(parts) + "."
    )


def roofline_report(result: dict[str, Any]) -> str:
    """The roofline tables (one per beta) with the measured peaks and what the counts assume."""
    lines = [peaks_line(result["peaks"]), ""]
    for run in result["runs"]:
        sides = {
            ("policygrad" if side == "policygrad" else "TRL"): roof["phases"]
            for side, roof in (run.get("roofline") or {}).items()
            if roof
        }
        if sides:
            lines += [roofline_markdown(f"roofline, beta = {run['beta']:g}", sides), ""]
            floor = floor_line(run, result["peaks"])
            if floor:
                lines += [floor, ""]
    lines.append(
        "Medians per step. FLOPs counted on the useful tokens each side computes (no padding; "
        "policygrad: each distinct prompt once; TRL: every row's prompt): forward = 2 N_body x tokens + "
        "2 N_head x response tokens + 4 L d_attn x causal context; backward = 2 x forward + what it "
        "recomputes (gradient checkpointing: the forward less the head; policygrad's fused head: "
        "the head); log-prob passes = passes x forward; generation = the same 2N counts for prefill and "
        "decode, and bytes = matmul weights read once per decode step + the KV cache each generated "
        "token reads; optimizer bytes = 40 B per fp32 parameter (AdamW 28 + clipping 12). Generation "
        "includes rewards and, for TRL, advantages. % of the matmul peak of the dtype that phase ran "
        "in; bandwidth against the best of copy and read. See `benchmarks/_roofline.py`."
    )
    return "\n".join(lines)


def report(result: dict[str, Any]) -> str:
    """The markdown block printed at the end and written into the README section."""
    m = result["machine"]
    s = result["settings"]
    trl_version = m["packages"].get("trl")
    lines = [
        f"Measured {result['date']} with `{result['command']}` on {machine_line(m)}; "
        f"{s['threads']} threads per side; medians of {s['steps']} measured steps per side after "
        f"{s['warmup']} warm-up step(s), the two sides alternating step by step"
        + (" (quick mode)" if s["quick"] else "")
        + ".",
        "",
    ]
    for run in result["runs"]:
        lines.append(beta_table(run, trl_version))
        lines.append("")
    if result.get("peaks") is not None:
        lines.append(roofline_report(result))
        lines.append("")
    batch = s["prompts_per_step"] * s["group_size"]
    length = (
        f"every response exactly {s['max_new_tokens']} tokens (--equal-length)"
        if s.get("equal_length")
        else f"at most {s['max_new_tokens']} new tokens"
    )
    lines.append(
        f"{s['prompts_per_step']} prompts x G = {s['group_size']} = {batch} sequences per step, "
        f"{length}, temperature {s['temperature']}, "
        f"lr {s['lr']:g} constant, AdamW, clip 1.0; float32 weights and AdamW state on both sides, the "
        "compute precision and the allocator of each side in its column header (policygrad: its defaults "
        "on this CPU; TRL: GRPOConfig's default, bf16 autocast, unless a --trl-override sets bf16/fp16). "
        "TRL's loss forward includes its "
        "log-prob forward with gradients; with gradient checkpointing its backward recomputes the "
        "forward. Peak RSS: `ru_maxrss` of each worker process. "
        + (
            "Every response is max_new_tokens long on both sides, so a step-time ratio is a per-token one."
            if s.get("equal_length")
            else "The sides sample with different random streams and their losses move the policy "
            "differently, so their response lengths differ: compare tokens/s too."
        )
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps",
        type=int,
        default=5,
        help="measured steps per side and beta (>= 1; 5 or more to read a ratio)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up steps per side")
    parser.add_argument("--quick", action="store_true", help="3 measured steps (under 15 minutes in all)")
    parser.add_argument("--betas", default="0,0.04", help="comma-separated KL coefficients")
    add_common_options(parser, "grpo-vs-trl")
    parser.add_argument(
        "--trl-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra GRPOConfig field (repeatable), e.g. gradient_checkpointing=false; bf16=false for "
        "TRL in fp32 (default: GRPOConfig's bf16 autocast)",
    )
    parser.add_argument(
        "--equal-length",
        action="store_true",
        help="every response on both sides runs to max_new_tokens (equal work per step)",
    )
    parser.add_argument(
        "--no-roofline",
        action="store_true",
        help="skip the matmul / memory-bandwidth probe at the start and the roofline table",
    )
    parser.add_argument(
        "--trl-allocator",
        choices=("glibc", "same"),
        default="glibc",
        help="TRL's allocator: glibc's malloc (a TRL script's default) or the one policygrad's command uses",
    )
    parser.add_argument("--worker", choices=("policygrad", "trl"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        spec = json.loads(args.spec.read_text(encoding="utf-8"))
        (serve_policygrad if args.worker == "policygrad" else serve_trl)(spec)
        return 0

    refuse_slow_trl_precision(parser, args.trl_override)
    if args.quick:
        args.steps = 3
    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--steps must be >= 1, --warmup >= 0, --threads >= 1")
    try:
        betas = [float(b) for b in args.betas.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--betas must be comma-separated numbers, got {args.betas!r}")
    if any(b < 0 for b in betas):
        parser.error("--betas must be >= 0")
    if importlib.util.find_spec("trl") is None:
        parser.error('TRL is not installed: pip install -e ".[bench]" (trl 1.16.0)')
    machine = machine_description()
    warn_if_busy(machine)
    logs = log_dir("grpo-vs-trl")
    _say(f"worker logs: {logs}")
    started = time.perf_counter()
    cfg = policygrad_config(
        policygrad_settings(
            beta=0.0,
            seed=args.seed,
            engine=args.pg_engine,
            threads=args.threads,
            steps=1,
            output_dir=str(logs),
        ),
        args.pg_override,
    )
    r = cfg.rollout
    result: dict[str, Any] = {
        "benchmark": "grpo_vs_trl",
        "date": today(),
        "command": " ".join(["python", "benchmarks/grpo_vs_trl.py", *sys.argv[1:]]),
        "machine": machine,
        "settings": {
            "model": MODEL,
            "betas": betas,
            "steps": args.steps,
            "warmup": args.warmup,
            "quick": args.quick,
            "seed": args.seed,
            "threads": args.threads,
            "pg_engine": args.pg_engine,
            "pg_overrides": args.pg_override,
            "trl_overrides": args.trl_override,
            # GRPOConfig's default unless an override sets it; each run's TRL ``ready`` reply has
            # what the worker's config resolved to, and its allocator
            "trl_precision": expected_trl_precision(parse_trl_overrides(args.trl_override)),
            "trl_allocator": args.trl_allocator,
            "equal_length": args.equal_length,
            "prompts_per_step": r.prompts_per_step,
            "group_size": r.group_size,
            "max_new_tokens": r.max_new_tokens,
            "temperature": r.temperature,
            "lr": cfg.optim.lr,
            "micro_batch_size": cfg.optim.micro_batch_size,
            "tokens_per_s": "(non-padding prompt tokens + response tokens) / step time",
        },
        "runs": [],
    }
    result["peaks"] = None if args.no_roofline else _measure_peaks(args.threads, cfg)
    for beta in betas:
        result["runs"].append(run_beta(args, beta, logs, result.get("peaks")))
    result["wall_minutes"] = (time.perf_counter() - started) / 60
    try:
        result["machine"]["loadavg_at_end"] = list(os.getloadavg())
    except OSError:
        pass
    out = args.output or new_result_path("grpo-vs-trl", result["date"])
    write_json(out, result)
    text = report(result)
    print(text)
    for run in result["runs"]:
        if not run["same_prompt_tokens"]:
            _say(f"warning: beta={run['beta']:g}: the two sides' prompt token counts differ per step")
    _say(f"wrote {out} ({result['wall_minutes']:.1f} min)")
    if args.update_readme:
        update_readme_section(README_SECTION, text)
        _say(f"updated the '{README_SECTION}' section of benchmarks/README.md")
    return 0


if __name__ == "__main__":
    run_main(main)
