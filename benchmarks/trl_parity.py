"""policygrad against TRL's GRPOTrainer beyond one step: the optimizer across steps, the sampler's hit
rate, and held-out accuracy after the same number of steps over several seeds.

tests/trainer/test_same_batch_as_trl.py checks one update on a tiny model (the gradient of a
batch, and the optimizer, clip and schedule over a few steps). This script asks the same of the
bundled model on the built-in arithmetic task, where the learning comparisons of
``learn_vs_trl.py`` run; each mode writes ``results/<date>-trl-parity-<mode>.json``:

- ``replay``: a policygrad run of ``--steps`` steps (the default job's settings, ``--task``
  difficulty, ``rollout.engine=hf``, float32); each step's pre-clip gradients go to the optimizer
  and scheduler trl's Trainer builds (``create_optimizer_and_scheduler``) and its clip
  (``Trainer._clip_grad_norm``); the weights of both are compared after every step (the L2 norm
  of their difference and its largest entry: 0 when the two are the same computation).
- ``batch``: per seed, policygrad's first update of the default job on the bundled model
  (``rollout.engine=hf``, float32, clipping off, the aggregation of ``--pg-override
  loss.agg_mode=...``) and TRL's ``_compute_loss`` gradient on the same Experience and weights
  (with the ``loss_type`` of the same objective; the helper of
  tests/trainer/test_same_batch_as_trl.py, which checks this on the tiny model): the gap against
  TRL's norm, the cosine, and the share of weights whose gradients have the same sign where either
  exceeds AdamW's eps (a first AdamW step moves those by about ``lr * sign(g)``).
- ``sampler``: the start model, the task's first ``--prompts`` train prompts x ``--group``
  samples x ``--reps`` repetitions, sampled by policygrad's hf engine with per-prompt seeds (the
  default ``rollout.per_prompt_seeds``: Gumbel-max draws; ``--engine vllm``: the default job's
  float32 vLLM engine, the same seeds as vLLM request seeds) and by transformers' ``generate`` with
  ``do_sample=True, top_k=0, top_p=1.0`` (what TRL passes), temperature 1; correct samples and
  groups with a signal under ``answer_correctness``, and the two-proportion z of the hit rates.
- ``steps``: per seed, ``policygrad train --steps K`` and TRL's GRPOTrainer for K steps (the
  settings of ``learn_vs_trl.py``: policygrad's train rows in its order, fp32, TRL's defaults
  otherwise), each final model scored by ``policygrad eval`` on the task's first ``--eval-size``
  held-out problems; the report gives both sides' accuracies, the exact one-sided rank-sum p of
  "TRL higher" and the Hodges-Lehmann shift TRL - policygrad with its exact interval (at least
  95 %). Accuracy at a fixed step does not depend on speed, so runs may share the CPUs.

Usage::

    python benchmarks/trl_parity.py replay --seed 3 --steps 12
    python benchmarks/trl_parity.py batch --task medium --seeds 3 [--pg-override loss.agg_mode=token-mean]
    python benchmarks/trl_parity.py sampler --prompts 48 --group 8 --reps 4
    python benchmarks/trl_parity.py steps --steps 12 --seeds 6 [--pg-override loss.agg_mode=token-mean]

Every mode runs at ``--threads`` (default 1) intra-op threads.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402 - the benchmarks folder is not a package
    REPO_ROOT,
    machine_description,
    machine_line,
    new_result_path,
    run_main,
    set_threads,
    write_json,
)

CONFIG = REPO_ROOT / "configs" / "grpo.yaml"


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def policygrad_overrides(args, seed: int, steps: int, output_dir: str) -> list[str]:
    """The policygrad command line of a ``steps``-step run of the default job on ``args.task``."""
    return [
        f"--data.difficulty={args.task}",
        f"--seed={seed}",
        f"--steps={steps}",
        "--rollout.engine=hf",
        "--model.dtype=float32",
        "--eval_before=false",
        "--eval_after=false",
        "--eval_every=0",
        "--max_minutes=null",
        f"--num_threads={args.threads}",
        "--progress=false",
        "--tensorboard=false",
        "--log_completions=0",
        f"--output_dir={output_dir}",
        *(o if o.startswith("--") else f"--{o}" for o in args.pg_override),
    ]


# ----------------------------------------------------------------------------------------------
# replay


def replay(args) -> dict[str, Any]:
    """policygrad's pre-clip gradients through TRL's optimizer, clip and schedule, step by step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from policygrad.config.train import load_config
    from policygrad.trainer.factory import build_trainer, prepare_config

    scratch = Path(tempfile.mkdtemp(prefix="pg-bench-trl-parity-"))
    overrides = policygrad_overrides(args, args.seed, args.steps, str(scratch / "run"))
    cfg, rewards = prepare_config(load_config(str(CONFIG), overrides=overrides))
    trainer = build_trainer(cfg, reward_objects=rewards)
    rows = []
    try:
        model = AutoModelForCausalLM.from_pretrained(str(trainer.model_path), dtype=torch.float32)
        ours, theirs = dict(trainer.policy.named_parameters()), dict(model.named_parameters())
        if any(not torch.equal(ours[n], p) for n, p in theirs.items()):
            raise RuntimeError("the two copies of the start model differ")
        o = cfg.optim
        trl_args = GRPOConfig(
            output_dir=str(scratch / "trl"),
            use_cpu=True,
            bf16=False,
            per_device_train_batch_size=cfg.rollout.prompts_per_step * cfg.rollout.group_size,
            num_generations=cfg.rollout.group_size,
            report_to="none",
            learning_rate=o.lr,
            lr_scheduler_type=o.schedule,
            max_grad_norm=o.max_grad_norm,
            weight_decay=o.weight_decay,
            adam_beta1=o.betas[0],
            adam_beta2=o.betas[1],
            adam_epsilon=o.eps,
            max_steps=args.steps,
        )
        data = Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1"}]}])
        grpo = GRPOTrainer(
            model=model,
            reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
            args=trl_args,
            train_dataset=data,
            processing_class=trainer.tokenizer,
        )
        grpo.create_optimizer_and_scheduler(num_training_steps=args.steps)
        by_id = {id(p): n for n, p in ours.items()}
        captured: list[dict[str, Any]] = []
        real_clip = torch.nn.utils.clip_grad_norm_

        def clip(params, *a, **kw):
            params = list(params)
            captured.append({by_id[id(p)]: p.grad.detach().clone() for p in params if id(p) in by_id})
            return real_clip(params, *a, **kw)

        for _ in range(args.steps):
            captured.clear()
            torch.nn.utils.clip_grad_norm_ = clip
            try:
                metrics = trainer.step()
            finally:
                torch.nn.utils.clip_grad_norm_ = real_clip
            if len(captured) != 1:
                raise RuntimeError(f"expected one optimizer step per step, saw {len(captured)}")
            for n, p in theirs.items():
                p.grad = captured[0][n]
            norm = float(grpo._clip_grad_norm(model))
            grpo.optimizer.step()
            grpo.lr_scheduler.step()
            grpo.optimizer.zero_grad(set_to_none=True)
            gap = math.sqrt(
                sum(float((ours[n].double() - p.double()).pow(2).sum()) for n, p in theirs.items())
            )
            largest = max(float((ours[n] - p).abs().max()) for n, p in theirs.items())
            row = {
                "step": trainer.step_idx,
                "reward_mean": metrics.get("reward/mean"),
                "policygrad_grad_norm": metrics.get("optim/grad_norm"),
                "trl_grad_norm": norm,
                "policygrad_next_lr": metrics.get("optim/lr"),
                "trl_next_lr": grpo.lr_scheduler.get_last_lr()[0],
                "weight_gap_l2": gap,
                "weight_gap_max": largest,
            }
            rows.append(row)
            say(json.dumps(row))
    finally:
        trainer.close()
    return {"policygrad_command": "python -m policygrad train " + " ".join(overrides), "steps": rows}


def replay_report(result: dict[str, Any]) -> str:
    rows = result["steps"]
    moved = [r["step"] for r in rows if r["weight_gap_max"] > 0]
    signal = [r["step"] for r in rows if (r["policygrad_grad_norm"] or 0) > 0]
    return (
        f"{len(rows)} steps ({len(signal)} with a gradient: {signal}); weights differ after steps "
        f"{moved or 'none'}; largest difference {max(r['weight_gap_max'] for r in rows):.3g}"
    )


# ----------------------------------------------------------------------------------------------
# batch

# policygrad's aggregation -> the TRL loss_type that computes the same objective
# (tests/trainer/test_same_batch_as_trl.py pairs them on the tiny model)
TRL_LOSS_TYPE = {"seq-mean-token-mean": "grpo", "token-mean": "dapo", "seq-mean-token-sum-norm": "dr_grpo"}
ADAM_EPS = 1e-8  # AdamW's eps in both libraries: a first step moves a weight by ~lr where |g| >> eps


def compare_gradients(ours: dict[str, Any], theirs: dict[str, Any], eps: float = ADAM_EPS) -> dict[str, Any]:
    """Two gradients (parameter name -> tensor, the same names and shapes) compared in float64:
    their norms, ``||ours - theirs|| / ||theirs||``, the cosine, the number of entries where either
    exceeds ``eps`` in magnitude, and the share of those where the signs agree (NaN when none does).

    Raises:
        ValueError: the two name different parameters."""
    if set(ours) != set(theirs):
        raise ValueError(f"the gradients name different parameters: {sorted(set(ours) ^ set(theirs))[:5]}")
    sq_ours = sq_theirs = sq_gap = dot = 0.0
    above = same = 0
    for name, g in theirs.items():
        a, b = ours[name].double(), g.double()
        sq_ours += float(a.pow(2).sum())
        sq_theirs += float(b.pow(2).sum())
        sq_gap += float((a - b).pow(2).sum())
        dot += float((a * b).sum())
        big = (a.abs() > eps) | (b.abs() > eps)
        above += int(big.sum())
        same += int((big & (a.sign() == b.sign())).sum())
    n_ours, n_theirs = math.sqrt(sq_ours), math.sqrt(sq_theirs)
    return {
        "policygrad_norm": n_ours,
        "trl_norm": n_theirs,
        "relative_gap": math.sqrt(sq_gap) / n_theirs,
        "cosine": dot / (n_ours * n_theirs),
        "weights_above_eps": above,
        "same_sign_share": same / above if above else float("nan"),
    }


def batch(args) -> dict[str, Any]:
    """Per seed: policygrad's first update of the default job on the bundled model (hf engine,
    float32, gradient clipping off) and TRL's ``_compute_loss`` gradient on the same Experience
    and weights; the gap relative to TRL's norm, the cosine, and the share of weights whose
    gradient has the same sign (where either exceeds AdamW's eps: AdamW's first step is about
    ``lr * sign(g)`` there, so a flipped sign is a weight moved the other way)."""
    from policygrad.config.train import load_config
    from policygrad.trainer.factory import build_trainer, prepare_config

    sys.path.insert(0, str(REPO_ROOT))
    # the tiny-model test's own capture and TRL side, so the benchmark and the test compare one
    # computation
    from tests.trainer.test_same_batch_as_trl import captured_step, trl_gradient

    rows = []
    for seed in range(args.seed, args.seed + args.seeds):
        scratch = tempfile.TemporaryDirectory(prefix="pg-bench-trl-parity-")
        overrides = policygrad_overrides(args, seed, 1, str(Path(scratch.name) / "run"))
        overrides += ["--optim.max_grad_norm=1e9", "--model.precision=fp32"]
        cfg, rewards = prepare_config(load_config(str(CONFIG), overrides=overrides))
        agg = cfg.agg_mode
        if agg not in TRL_LOSS_TYPE:
            raise SystemExit(
                f"error: loss.agg_mode={agg} has no TRL loss_type; use one of {sorted(TRL_LOSS_TYPE)}"
            )
        trainer = build_trainer(cfg, reward_objects=rewards)
        try:
            exp, weights, grads, metrics = captured_step(trainer)
            if len(grads) > 1:
                raise RuntimeError(f"expected at most one optimizer step, saw {len(grads)}")
            row: dict[str, Any] = {"seed": seed, "agg_mode": agg, "reward_mean": metrics.get("reward/mean")}
            if not grads or not any(bool(g.any()) for g in grads[0].values()):
                row["note"] = "no group with a signal in the first step: nothing to compare"
            else:
                theirs = trl_gradient(trainer, exp, weights[0], loss_type=TRL_LOSS_TYPE[agg])
                row.update(compare_gradients(grads[0], theirs))
            rows.append(row)
            say(json.dumps(row))
        finally:
            trainer.close()
            scratch.cleanup()
    return {"rows": rows}


def batch_report(result: dict[str, Any]) -> str:
    lines = []
    for r in result["rows"]:
        if "relative_gap" not in r:
            lines.append(f"seed {r['seed']}: {r['note']}")
            continue
        lines.append(
            f"seed {r['seed']} ({r['agg_mode']}): gradient norm {r['policygrad_norm']:.5g} vs TRL "
            f"{r['trl_norm']:.5g}, gap {r['relative_gap']:.2e} of TRL's norm, cosine {r['cosine']:.8f}, "
            f"same sign at {100 * r['same_sign_share']:.4f} % of {r['weights_above_eps']} weights"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# sampler


def sampler(args) -> dict[str, Any]:
    """Hits of policygrad's per-prompt-seed sampler and of ``generate``'s multinomial draws."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from policygrad.config.train import load_config
    from policygrad.data.chat import format_prompt
    from policygrad.data.sources import build_train_source
    from policygrad.models.loading import resolve_model_path
    from policygrad.rewards.verifiers import answer_correctness
    from policygrad.rollout.base import prompt_seed
    from policygrad.rollout.hf import HFRolloutEngine

    cfg = load_config(str(CONFIG), overrides=[f"--data.difficulty={args.task}", f"--seed={args.seed}"])
    source = build_train_source(cfg.data, seed=cfg.seed)
    path = resolve_model_path(cfg.model.name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    n, g, new = args.prompts, args.group, cfg.rollout.max_new_tokens
    rows = [source.train_row(i) for i in range(n)]
    prompts = [tok(format_prompt(tok, r["prompt"]), add_special_tokens=False)["input_ids"] for r in rows]
    if args.engine == "vllm":
        from policygrad.models.loading import eos_token_ids
        from policygrad.rollout.vllm import VLLMRolloutEngine

        # the default job's sampler: float32 weights, the per-prompt seeds as vLLM request seeds
        engine = VLLMRolloutEngine(
            path,
            tok,
            eos_token_ids(tok, model),
            dtype="float32",
            seed=args.seed,
            max_model_len=cfg.data.max_prompt_length + new,
            kv_cache_gb=cfg.rollout.vllm_kv_cache_gb,
            cpu_threads=args.threads,
        )
    else:
        engine = HFRolloutEngine(model, tok)

    def score(texts):
        keys = [(r["prompt"], r["answer"]) for r in rows for _ in range(g)]
        got = answer_correctness([k[0] for k in keys], texts, answer=[k[1] for k in keys])
        return torch.tensor(got, dtype=torch.float64).view(n, g)

    width = max(len(p) for p in prompts)
    ids = torch.full((n, width), tok.pad_token_id)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    ids, mask = ids.repeat_interleave(g, 0), mask.repeat_interleave(g, 0)
    scores: dict[str, list] = {"policygrad": [], "generate": []}
    # response lengths in tokens (through the first EOS) and whether EOS never came: the same
    # model sampled at temperature 1 must give both sides the same distribution of both
    lengths: dict[str, list] = {"policygrad": [], "generate": []}
    truncated: dict[str, list] = {"policygrad": [], "generate": []}
    eos = torch.tensor(engine.eos_token_ids)
    for rep in range(args.reps):
        ro = engine.generate(
            prompts,
            group_size=g,
            temperature=1.0,
            max_new_tokens=new,
            prompt_seeds=[prompt_seed(args.seed, rep, i) for i in range(n)],
        )
        responses = [ro.response_ids[b][ro.response_mask[b].bool()] for b in range(n * g)]
        scores["policygrad"].append(score(tok.batch_decode(responses, skip_special_tokens=True)))
        lengths["policygrad"].append(ro.response_mask.sum(1).double())
        truncated["policygrad"].append(ro.truncated.double())
        torch.manual_seed(args.seed * 1000 + rep)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new,
                pad_token_id=tok.pad_token_id,
            )
        scores["generate"].append(score(tok.batch_decode(out[:, width:], skip_special_tokens=True)))
        is_eos = torch.isin(out[:, width:], eos)
        has_eos = is_eos.any(1)
        lengths["generate"].append(torch.where(has_eos, is_eos.int().argmax(1) + 1, new).double())
        truncated["generate"].append((~has_eos).double())
        say(
            f"repetition {rep + 1}/{args.reps}: "
            + ", ".join(f"{k} {int(v[-1].sum())}" for k, v in scores.items())
        )
    if args.engine == "vllm":
        engine.close()
    sides = {}
    for name, parts in scores.items():
        s = torch.cat(parts, dim=0)  # [reps * n, g]
        sides[name] = {
            "correct": int(s.sum()),
            "samples": s.numel(),
            "groups_with_signal": float((s.max(1).values > s.min(1).values).double().mean()),
            "mean_length": float(torch.cat(lengths[name]).mean()),
            "truncated_share": float(torch.cat(truncated[name]).mean()),
        }
    a, b = sides["policygrad"], sides["generate"]
    pooled = (a["correct"] + b["correct"]) / (a["samples"] + b["samples"])
    se = math.sqrt(pooled * (1 - pooled) * (1 / a["samples"] + 1 / b["samples"]))
    z = (b["correct"] / b["samples"] - a["correct"] / a["samples"]) / se if se > 0 else 0.0
    return {
        "settings": {
            "engine": args.engine,
            "prompts": n,
            "group": g,
            "reps": args.reps,
            "temperature": 1.0,
            "top_k": 0,
            "top_p": 1.0,
        },
        "sides": sides,
        "z_generate_minus_policygrad": z,
    }


def sampler_report(result: dict[str, Any]) -> str:
    s, engine = result["sides"], result["settings"].get("engine", "hf")
    return (
        "; ".join(
            f"{k}{f' ({engine} engine)' if k == 'policygrad' else ''}: "
            f"{v['correct']}/{v['samples']} correct, "
            f"groups with a signal {v['groups_with_signal']:.3f}, "
            f"mean length {v['mean_length']:.2f} tokens, truncated {v['truncated_share']:.3f}"
            for k, v in s.items()
        )
        + f"; two-proportion z {result['z_generate_minus_policygrad']:.2f}"
    )


# ----------------------------------------------------------------------------------------------
# steps


EXACT_SPLITS = 200_000  # rank_sum enumerates every split up to this many (10 seeds a side)


def rank_sum(higher: list[float], lower: list[float]) -> tuple[float, float]:
    """Mann-Whitney U of ``higher`` over ``lower`` (ties count a half) and its one-sided p: the
    share of splits of the pooled values with U at least the observed, over every split (exact)
    when there are at most ``EXACT_SPLITS``, else over that many random splits (seeded; ``(hits +
    1) / (splits + 1)``, so p is never 0)."""

    def u(a, b):
        return sum((x > y) + 0.5 * (x == y) for x in a for y in b)

    pooled, n = higher + lower, len(higher)
    observed = u(higher, lower)
    if math.comb(len(pooled), n) <= EXACT_SPLITS:
        splits = [set(idx) for idx in itertools.combinations(range(len(pooled)), n)]
        extra = 0
    else:
        rng = random.Random(0)
        splits = [set(rng.sample(range(len(pooled)), n)) for _ in range(EXACT_SPLITS)]
        extra = 1
    hits = sum(
        u([pooled[i] for i in c], [pooled[i] for i in range(len(pooled)) if i not in c]) >= observed
        for c in splits
    )
    return observed, (hits + extra) / (len(splits) + extra)


def u_null_counts(m: int, n: int) -> list[int]:
    """How many of the C(m + n, m) orderings of m and n distinct values give U = 0, 1, ..., m n
    (U: pairs with the first sample's value higher). The largest value belongs to the first sample
    (beating all n of the second) or to the second, hence f(m, n)[u] = f(m - 1, n)[u - n] +
    f(m, n - 1)[u] (Mann & Whitney 1947)."""
    table = {(0, j): [1] for j in range(n + 1)} | {(i, 0): [1] for i in range(m + 1)}
    for i in range(1, m + 1):
        for j in range(1, n + 1):
            counts = [0] * (i * j + 1)
            for v, c in enumerate(table[i - 1, j]):
                counts[v + j] += c
            for v, c in enumerate(table[i, j - 1]):
                counts[v] += c
            table[i, j] = counts
    return table[m, n]


def hodges_lehmann(a: list[float], b: list[float]) -> tuple[float, float, float, float]:
    """The shift a - b (median of the pairwise differences) with its exact interval: the k-th
    smallest and largest pairwise differences, k the largest with P(U < k) <= 0.025 under the
    null (Lehmann 1975); returns ``(shift, low, high, coverage)``."""
    diffs = sorted(x - y for x in a for y in b)
    m, n = len(a), len(b)
    counts, total = u_null_counts(m, n), math.comb(m + n, m)
    below = list(itertools.accumulate(counts))  # below[c - 1] = #(U < c)
    k = max((c for c in range(1, m * n + 1) if below[c - 1] / total <= 0.025), default=0)
    if k == 0:
        return statistics.median(diffs), float("-inf"), float("inf"), 1.0
    return statistics.median(diffs), diffs[k - 1], diffs[m * n - k], 1 - 2 * below[k - 1] / total


def run_logged(cmd: list[str], log: Path, threads: int) -> str:
    """Run ``cmd`` at ``threads`` intra-op threads, stderr to ``log``; its stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(log, "w", encoding="utf-8") as f:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=f, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}); see {log}")
    return proc.stdout


def evaluate(args, model: str, log: Path) -> float:
    cmd = [sys.executable, "-m", "policygrad", "eval", "--model", model, "--dataset", "builtin:arithmetic"]
    cmd += ["--difficulty", args.task, "--limit", str(args.eval_size), "--max-new-tokens", "32"]
    cmd += ["--engine", "auto", "--num-threads", str(args.threads), "--seed", "0"]
    out = run_logged(cmd, log, args.threads)
    return float(json.loads(out[out.rfind("\n{") + 1 :] if "\n{" in out else out)["accuracy"])


def trl_worker(spec_path: Path) -> None:
    """TRL's GRPOTrainer for ``steps_total`` steps; saves the model and its per-step rewards."""
    from grpo_vs_trl import trl_trainer

    spec = json.loads(spec_path.read_text(encoding="utf-8"))
    set_threads(spec["threads"])
    trainer, _ = trl_trainer(spec)
    trainer.train()
    trainer.save_model(spec["model_out"])
    trainer.processing_class.save_pretrained(spec["model_out"])
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    Path(spec["model_out"], "rewards.json").write_text(json.dumps(rewards), encoding="utf-8")


def steps(args) -> dict[str, Any]:
    from grpo_vs_trl import trl_spec_from

    from policygrad.config.train import load_config

    scratch = Path(tempfile.mkdtemp(prefix="pg-bench-trl-parity-"))
    say(f"runs and logs in {scratch}")
    runs: dict[str, list[dict[str, Any]]] = {"policygrad": [], "trl": []}
    for seed in range(args.seed, args.seed + args.seeds):
        out = scratch / f"policygrad-seed{seed}"
        overrides = policygrad_overrides(args, seed, args.steps, str(out))
        cmd = [sys.executable, "-m", "policygrad", "train", *overrides, f"--save_every={args.steps}"]
        say(f"[seed {seed}] policygrad: {args.steps} steps")
        start = time.perf_counter()
        log = scratch / f"policygrad-seed{seed}.log"
        try:
            run_logged(cmd, log, args.threads)
            model = str(sorted(out.glob("checkpoints/step_*/model"))[-1])
        except RuntimeError:
            # a seed whose few steps found no reward signal: the run stops with an error and the
            # weights are the start model's (TRL's trainer takes the same empty steps silently)
            if "nothing was trained" not in log.read_text(encoding="utf-8"):
                raise
            from policygrad.models.loading import resolve_model_path

            model = str(resolve_model_path(load_config(str(CONFIG)).model.name))
        wall = time.perf_counter() - start
        metrics = [
            json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()
        ]
        acc = evaluate(args, model, scratch / f"eval-policygrad-seed{seed}.log")
        rewards = [m["reward/mean"] for m in metrics if "reward/mean" in m]
        runs["policygrad"].append({"seed": seed, "accuracy": acc, "train_reward": rewards, "wall_s": wall})
        say(f"[seed {seed}] policygrad accuracy {acc:.3f}")
        if args.skip_trl:
            continue
        cfg = load_config(str(CONFIG), overrides=overrides)
        spec = trl_spec_from(
            cfg,
            beta=cfg.kl.beta if cfg.kl.placement != "none" else 0.0,
            steps_total=args.steps,
            threads=args.threads,
            output_dir=str(scratch / f"trl-seed{seed}-trainer"),
            trl_overrides={"bf16": False},
        )
        spec["model_out"] = str(scratch / f"trl-seed{seed}")
        spec_path = scratch / f"trl-seed{seed}.json"
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        say(f"[seed {seed}] TRL: {args.steps} steps")
        start = time.perf_counter()
        cmd = [sys.executable, str(Path(__file__).resolve()), "trl-worker", "--spec", str(spec_path)]
        run_logged(cmd, scratch / f"trl-seed{seed}.log", args.threads)
        wall = time.perf_counter() - start
        acc = evaluate(args, spec["model_out"], scratch / f"eval-trl-seed{seed}.log")
        rewards = json.loads(Path(spec["model_out"], "rewards.json").read_text())
        runs["trl"].append({"seed": seed, "accuracy": acc, "train_reward": rewards, "wall_s": wall})
        say(f"[seed {seed}] TRL accuracy {acc:.3f}")
    result: dict[str, Any] = {"runs": runs, "scratch": str(scratch)}
    if runs["trl"]:
        a = [r["accuracy"] for r in runs["trl"]]
        b = [r["accuracy"] for r in runs["policygrad"]]
        u, p = rank_sum(a, b)
        shift, low, high, coverage = hodges_lehmann(a, b)
        result["comparison"] = {
            "u_trl_higher": u,
            "pairs": len(a) * len(b),
            "p_one_sided": p,
            "hodges_lehmann_trl_minus_policygrad": shift,
            "interval": [low, high],
            "interval_coverage": coverage,
        }
    return result


def steps_report(result: dict[str, Any]) -> str:
    lines = []
    for side, runs in result["runs"].items():
        if runs:
            accs = [r["accuracy"] for r in runs]
            lines.append(
                f"{side}: " + ", ".join(f"{a:.3f}" for a in accs) + f" (median {statistics.median(accs):.3f})"
            )
    c = result.get("comparison")
    if c:
        lines.append(
            f"TRL higher: U = {c['u_trl_higher']:g} of {c['pairs']}, one-sided p = {c['p_one_sided']:.3f}; "
            f"shift TRL - policygrad {c['hodges_lehmann_trl_minus_policygrad']:+.4f} "
            f"[{c['interval'][0]:+.3f}, {c['interval'][1]:+.3f}] ({100 * c['interval_coverage']:.1f} %)"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("replay", "batch", "sampler", "steps", "trl-worker"))
    parser.add_argument("--task", default="hard", help="builtin:arithmetic difficulty (default hard)")
    parser.add_argument("--seed", type=int, default=0, help="run seed (steps: the first of --seeds)")
    parser.add_argument("--steps", type=int, default=12, help="training steps (replay, steps; default 12)")
    parser.add_argument("--seeds", type=int, default=6, help="seeds per side (steps; default 6)")
    parser.add_argument("--skip-trl", action="store_true", help="steps: policygrad's runs only")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out problems (steps; default 200)")
    parser.add_argument("--prompts", type=int, default=48, help="sampler: train prompts (default 48)")
    parser.add_argument("--group", type=int, default=8, help="sampler: samples per prompt (default 8)")
    parser.add_argument("--reps", type=int, default=4, help="sampler: repetitions (default 4)")
    parser.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="sampler: policygrad's engine (default hf; vllm: the default job's, float32)",
    )
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    parser.add_argument(
        "--pg-override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="policygrad override (repeatable)",
    )
    parser.add_argument("--output", type=Path, default=None, help="JSON path")
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode == "trl-worker":
        trl_worker(args.spec)
        return 0
    if min(args.steps, args.seeds, args.eval_size, args.prompts, args.group, args.reps, args.threads) < 1:
        parser.error("--steps, --seeds, --eval-size, --prompts, --group, --reps and --threads must be >= 1")
    set_threads(args.threads)
    machine = machine_description()
    run, report = {
        "replay": (replay, replay_report),
        "batch": (batch, batch_report),
        "sampler": (sampler, sampler_report),
    }.get(args.mode, (steps, steps_report))
    start = time.perf_counter()
    result = {
        "benchmark": f"trl_parity {args.mode}",
        "command": "python benchmarks/trl_parity.py " + " ".join(sys.argv[1:]),
        "machine": machine,
        **run(args),
        "wall_minutes": (time.perf_counter() - start) / 60,
    }
    out = args.output or new_result_path(f"trl-parity-{args.mode}")
    write_json(out, result)
    print(f"{machine_line(machine)}; load average {machine['loadavg_at_start'][0]:.2f} at the start")
    print(report(result))
    say(f"wrote {out}")
    return 0


if __name__ == "__main__":
    run_main(main)
