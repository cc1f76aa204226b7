"""Speed levers of a policygrad GRPO step, each measured on and off side by side.

```bash
python benchmarks/levers.py                               # every lever, 3 measured steps per variant
python benchmarks/levers.py --lever allocator --lever precision --steps 5
python benchmarks/levers.py --update-readme
```

The step is ``benchmarks/grpo_vs_trl.py``'s policygrad side at equal length (the bundled
SmolLM2-135M-Instruct, 4 prompts x G = 4, every response exactly 64 tokens, vLLM rollouts,
policygrad's default ``optim.micro_batch_size`` (all 16 sequences in one forward), beta = 0 unless
``--beta``). For one lever, every variant is a
worker process of its own, loaded one after the other; after one unmeasured warm-up step each,
the measured steps alternate between the variants (A, B, A, B, ...), so a drift of a shared
machine hits all of them alike. Every worker runs with the allocator the ``policygrad`` command
preloads on this machine (:mod:`policygrad.allocator`; the ``allocator`` lever sets its own).
Reported per variant: the median step time and its phases, the
peak RSS, and the ratio to the lever's first variant (today's default).

Levers:

- ``allocator``: glibc's malloc as it comes, glibc told by ``mallopt`` to serve blocks under
  1 GB from its heap and keep freed memory (no fresh, page-faulting mmap per large tensor), and
  jemalloc and tcmalloc preloaded with ``LD_PRELOAD``
  (Debian's ``libjemalloc2`` / ``libtcmalloc-minimal4``; a variant whose library is missing is
  left out, and said so).
- ``precision``: ``model.precision`` fp32 against bf16-mixed (autocast; fast only on CPUs with
  AVX512-BF16 or AMX).
- ``rollout_dtype``: under bf16-mixed, the vLLM engine's weights in float32 against bfloat16.
- ``lean_mlp``: the SwiGLU/RMSNorm layers that save their inputs only and recompute the rest in
  the backward (policygrad's default) against the plain autograd layers.
- ``checkpointing``: ``model.gradient_checkpointing`` off against on (every layer's forward
  recomputed in the backward; TRL's default).
- ``micro_batch``: ``optim.micro_batch_size`` 4 (one prompt's G samples per forward), 8 and 16
  (the whole batch in one forward, as TRL runs it and as policygrad's default of 32 does here):
  fewer, larger matmuls against more activation memory (the peak RSS column).
- ``compile``: every decoder layer of the policy compiled by ``torch.compile`` (inductor,
  ``dynamic=True``: the packed token counts change from step to step) against eager. The first
  (warm-up) step pays the compilation; the measured steps run the compiled code. A benchmark
  patch, not an option: measured 6x slower on this path (transformers' KV cache recompiles every
  layer; see benchmarks/README.md).
- ``head_matmuls``: under bf16-mixed, the fused LM head's backward with its two gradient
  matmuls in bf16, as autocast runs an unfused linear's (policygrad's default) against float32
  (the code until 2026-12-06). A benchmark patch: the float32 variant upcasts the bf16 block and
  weight copies the default passes (the weight once per backward), a little more casting than the
  old code did.
- ``vllm_compile``: the vLLM sampler as policygrad builds it (``enforce_eager=True``) against
  vLLM's own ``torch.compile`` of the model (``enforce_eager=False``): a slower start (the load
  time is reported) for a possibly faster decode. A benchmark patch, not an option.
- ``attention``: under bf16-mixed, the training forward's attention on SDPA's flash kernel (what
  torch picks on CPU; policygrad's default) against SDPA's math backend (float32 inside for bf16
  inputs; keeps each layer's [B, H, Tq, Tk] probabilities for the backward). A benchmark patch.
- ``skip_rows``: ``optim.skip_zero_advantage_rows`` off against on (policygrad's default): the
  training forward and backward of the rows whose advantages are all 0 (every sample of their
  group scored alike) run, or are skipped; the update is the same either way. How much it saves
  depends on how many groups scored alike (``reward/zero_variance_group_frac``).
- ``binding``: vLLM's OpenMP threads bound to the CPUs (``VLLM_CPU_OMP_THREADS_BIND`` = the
  affinity list, policygrad's default) against unbound (``nobind``) and against binding torch's
  threads too (``OMP_PROC_BIND=close OMP_PLACES=cores``).

Writes ``benchmarks/results/<date>-levers.json`` and prints one markdown table per lever.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    SPLITS,
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
    new_result_path,
    policygrad_config,
    policygrad_splits,
    run_main,
    serve_policygrad,
    today,
    update_readme_section,
    warn_if_busy,
    write_json,
)
from grpo_vs_trl import policygrad_settings  # noqa: E402

README_SECTION = "levers"


def command_allocator() -> str | None:
    """The allocator library the ``policygrad`` command preloads on this machine (None: glibc's);
    every variant of the other levers runs with it, as a user's run does."""
    from policygrad.allocator import plan_preload

    return plan_preload(os.environ, sys.platform)


_BF16 = "model.precision=bf16-mixed"
# levers whose variants do not depend on the machine; the first variant is without the change
_FIXED_VARIANTS: dict[str, list[dict[str, Any]]] = {
    "precision": [
        {"label": "fp32", "overrides": ["model.precision=fp32"]},
        {"label": "bf16-mixed", "overrides": [_BF16]},
    ],
    "rollout_dtype": [
        {"label": "vLLM float32", "overrides": [_BF16, "rollout.dtype=float32"]},
        {"label": "vLLM bfloat16", "overrides": [_BF16, "rollout.dtype=bfloat16"]},
    ],
    "lean_mlp": [{"label": "lean SwiGLU/RMSNorm"}, {"label": "plain autograd layers", "patch": "plain_mlp"}],
    "checkpointing": [
        {"label": "gradient checkpointing off", "overrides": ["model.gradient_checkpointing=false"]},
        {"label": "gradient checkpointing on", "overrides": ["model.gradient_checkpointing=true"]},
    ],
    # sequences per training forward: fewer, larger matmuls against more activation memory
    "micro_batch": [
        {"label": f"micro-batch {n}", "overrides": [f"optim.micro_batch_size={n}"]} for n in (4, 8, 16)
    ],
    "compile": [{"label": "eager"}, {"label": "decoder layers compiled", "patch": "compile_layers"}],
    "head_matmuls": [
        {"label": "head gradient matmuls bf16", "overrides": [_BF16]},
        {"label": "head gradient matmuls float32", "overrides": [_BF16], "patch": "float32_head_matmuls"},
    ],
    "vllm_compile": [{"label": "vLLM eager"}, {"label": "vLLM compiled", "patch": "vllm_compiled"}],
    # the training forward's attention: SDPA's flash kernel (what torch picks on CPU) or its math
    # backend (float32 inside for bf16 inputs; keeps [B, H, Tq, Tk] probabilities for the backward)
    "attention": [
        {"label": "SDPA flash kernel", "overrides": [_BF16]},
        {"label": "SDPA math backend", "overrides": [_BF16], "patch": "sdpa_math"},
    ],
    # rows whose advantages are all 0 (a group that scored alike) carry no gradient
    "skip_rows": [
        {"label": "every row forwarded", "overrides": ["optim.skip_zero_advantage_rows=false"]},
        {"label": "zero-advantage rows skipped", "overrides": ["optim.skip_zero_advantage_rows=true"]},
    ],
    "binding": [
        {"label": "vLLM threads bound"},
        {"label": "vLLM threads unbound", "env": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}},
        {"label": "vLLM and torch bound", "env": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}},
    ],
}


def variants(lever: str) -> list[dict[str, Any]]:
    """The variants of one lever, the first without the lever's change: label, config
    overrides, environment, and a patch the worker applies before it builds the trainer."""
    if lever in _FIXED_VARIANTS:
        return [dict(v) for v in _FIXED_VARIANTS[lever]]
    if lever == "allocator":
        out = [
            {"label": "glibc malloc", "env": {"LD_PRELOAD": ""}},
            {"label": "glibc, memory kept (mallopt)", "patch": "mallopt", "env": {"LD_PRELOAD": ""}},
        ]
        from policygrad.allocator import find_library

        for label in ("jemalloc", "tcmalloc"):
            path = find_library(label)
            if path is None:
                print(f"note: {label} is not installed; its variant is left out", file=sys.stderr)
            else:
                out.append({"label": label, "env": {"LD_PRELOAD": path}})
        return out
    raise ValueError(f"unknown lever {lever!r}")


LEVERS = (
    "allocator",
    "precision",
    "rollout_dtype",
    "lean_mlp",
    "checkpointing",
    "micro_batch",
    "compile",
    "head_matmuls",
    "vllm_compile",
    "binding",
    "attention",
    "skip_rows",
)


def serve(spec: dict[str, Any]) -> None:
    """Worker: apply the variant's patch, then serve policygrad steps."""
    apply_patch(spec.get("patch"))
    serve_policygrad(spec)


def _patch_mallopt() -> None:
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    # M_MMAP_THRESHOLD (-3): blocks under 1 GB come from the heap, not fresh mmaps (which
    # page-fault on first touch); M_TRIM_THRESHOLD (-1): freed heap memory is kept for reuse.
    libc.mallopt(-3, 1 << 30)
    libc.mallopt(-1, (1 << 31) - 1)


def _patch_plain_mlp() -> None:
    import policygrad.trainer.models as models

    models.use_memory_efficient_mlp = lambda _model: 0


def _patch_compile_layers() -> None:
    import torch._dynamo

    import policygrad.trainer.models as models

    # each layer's own index (its KV-cache slot) is a constant of its graph: one compilation
    # per layer and call shape, more than dynamo's default limit of 8 before it falls back
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 4096

    lean = models.use_memory_efficient_mlp

    def lean_then_compile(model):
        # after the lean layers are put in, so the compiled code is the one the run trains
        replaced = lean(model)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        for layer in base.model.layers:
            layer.compile(dynamic=True)
        return replaced

    models.use_memory_efficient_mlp = lean_then_compile


def _patch_float32_head_matmuls() -> None:
    import policygrad.core.logprobs as logprobs

    in_block_dtype = logprobs._block_matmul_grads
    upcast: dict[str, Any] = {}

    def float32_matmuls(d, h, weight, grad_hidden_rows, grad_weight):
        if upcast.get("of") is not weight:  # one float32 copy per backward, as the old code held
            upcast.update({"of": weight, "float32": weight.float()})
        in_block_dtype(d.float(), h.float(), upcast["float32"], grad_hidden_rows, grad_weight)

    logprobs._block_matmul_grads = float32_matmuls


def _patch_sdpa_math() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def math_sdpa(*args, **kwargs):
        with sdpa_kernel([SDPBackend.MATH]):
            return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register("sdpa", math_sdpa)  # the trainer's model (vLLM has its own)


def _patch_vllm_compiled() -> None:
    import vllm

    eager_llm = vllm.LLM

    class CompiledLLM(eager_llm):
        """vLLM's own compilation of the sampler's model (the engine asks for eager mode)."""

        def __init__(self, *args, **kwargs):
            kwargs["enforce_eager"] = False
            super().__init__(*args, **kwargs)

    vllm.LLM = CompiledLLM  # the engine looks the class up on the module when it starts


_PATCHES = {
    "mallopt": _patch_mallopt,
    "plain_mlp": _patch_plain_mlp,
    "compile_layers": _patch_compile_layers,
    "float32_head_matmuls": _patch_float32_head_matmuls,
    "sdpa_math": _patch_sdpa_math,
    "vllm_compiled": _patch_vllm_compiled,
}


def apply_patch(patch: str | None) -> None:
    """Change this process as a variant asks, before anything is built (None: nothing)."""
    if patch is not None:
        _PATCHES[patch]()


def run_lever(args, lever: str, logs: Path) -> dict[str, Any]:
    base = policygrad_settings(
        beta=args.beta,
        seed=args.seed,
        engine=args.pg_engine,
        threads=args.threads,
        steps=args.warmup + args.steps,
        output_dir="",
    )
    found = variants(lever)
    sides: list[dict[str, Any]] = []
    workers: list[Worker] = []
    scratch = Path(tempfile.mkdtemp(prefix=f"pg-levers-{lever}-"))
    try:
        for i, v in enumerate(found):
            overrides = ["rollout.ignore_eos=true", *args.pg_override, *v.get("overrides", [])]
            policygrad_config({**base, "output_dir": str(scratch / "check")}, overrides)  # fail early
            spec = {
                "config": {**base, "output_dir": str(scratch / f"run{i}")},
                "overrides": overrides,
                "threads": args.threads,
                "patch": v.get("patch"),
            }
            path = scratch / f"spec{i}.json"
            path.write_text(json.dumps(spec), encoding="utf-8")
            _say(f"[{lever}] starting '{v['label']}'")
            w = Worker(
                [sys.executable, str(Path(__file__).resolve()), "--worker", "--spec", str(path)],
                name=f"{lever}: {v['label']}",
                log_path=logs / f"{lever}-{i}.log",
                threads=args.threads,
                env={**args.base_env, **v.get("env", {})},
            )
            workers.append(w)
            ready = w.receive(args.load_timeout)
            sides.append(
                {
                    **v,
                    "ready": {k: ready.get(k) for k in ("engine", "dtype", "threads", "load_s")},
                    "steps": [],
                }
            )
        for k in range(args.warmup + args.steps):
            for side, w in zip(sides, workers):
                reply = w.request({"cmd": "step"}, args.step_timeout)
                reply["warmup"] = k < args.warmup
                reply["splits"] = add_other(policygrad_splits(reply))
                side["steps"].append(reply)
                _say(f"[{lever}] {side['label']:28s} step {k}: {reply['wall_s']:6.2f} s")
    finally:
        finals = [w.close() for w in workers]
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
    for side, w, final in zip(sides, workers, finals):
        measured = [s for s in side["steps"] if not s["warmup"]]
        peaks = [as_float(s.get("peak_rss_gb")) for s in side["steps"]]
        if final:
            peaks.append(as_float(final.get("peak_rss_gb")))
        side["summary"] = {key: median(s["splits"].get(key) for s in measured) for key, _ in SPLITS}
        side["summary"]["step"] = median(s["splits"]["step"] for s in measured)
        side["summary"]["peak_rss_gb"] = max((p for p in peaks if math.isfinite(p)), default=math.nan)
        side["summary"]["peak_rss_tree_gb"] = w.tree_rss_peak_gb
        for s in side["steps"]:  # keep the JSON small: the metrics the table and a reader need
            s["metrics"] = {
                k: v
                for k, v in s.get("metrics", {}).items()
                if k.startswith(("time/", "train/", "memory/", "mismatch/"))
                or k in ("reward/zero_variance_group_frac", "optim/skipped_rows_frac")
            }
    first = sides[0]["summary"]["step"]
    for side in sides:
        side["ratio_to_first"] = side["summary"]["step"] / first if first else math.nan
    return {"lever": lever, "variants": sides}


def lever_table(run: dict[str, Any]) -> str:
    sides = run["variants"]
    header = [run["lever"], *(s["label"] for s in sides)]
    rows = [["**step time, median (s)**", *(f"**{fmt(s['summary']['step'])}**" for s in sides)]]
    for key, label in SPLITS:
        values = [as_float(s["summary"].get(key)) for s in sides]
        if all(not math.isfinite(v) or v == 0 for v in values):
            continue
        rows.append([f"  {label}", *(fmt(v) for v in values)])
    rows.append(["peak RSS (GB)", *(fmt(s["summary"]["peak_rss_gb"]) for s in sides)])
    gaps = [
        median(
            st.get("metrics", {}).get("mismatch/logprob_abs_mean") for st in s["steps"] if not st["warmup"]
        )
        for s in sides
    ]
    if any(math.isfinite(g) for g in gaps):
        # the sampler's log-probs against the trainer's: a lever that changes the sampler shows here
        rows.append(
            ["sampler - trainer log-prob, mean abs", *(f"{g:.1e}" if math.isfinite(g) else "-" for g in gaps)]
        )
    rows.append(
        ["load, before the first step (s)", *(fmt(as_float(s["ready"].get("load_s"))) for s in sides)]
    )
    rows.append(["step time / first column", *(fmt(s["ratio_to_first"]) for s in sides)])
    return markdown_table(header, rows)


def report(result: dict[str, Any]) -> str:
    s = result["settings"]
    load = ", ".join(f"{x:.2f}" for x in result["machine"].get("loadavg_at_start") or [])
    lines = [
        f"Measured {result['date']} with `{result['command']}` on {machine_line(result['machine'])}; "
        f"{s['threads']} threads, allocator {os.path.basename(s.get('allocator', 'glibc'))}; "
        f"medians of {s['steps']} measured steps per variant after {s['warmup']} "
        f"warm-up step(s), the variants alternating step by step; beta = {s['beta']:g}, every response "
        f"64 tokens (load average {load} "
        "at the start).",
        "",
    ]
    for run in result["runs"]:
        lines += [lever_table(run), ""]
    return "\n".join(lines)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--lever", action="append", choices=LEVERS, help="a lever to measure (repeatable; default all)"
    )
    parser.add_argument("--steps", type=int, default=3, help="measured steps per variant")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up steps per variant")
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (0: no reference model)")
    add_common_options(parser, "levers")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        serve(json.loads(args.spec.read_text(encoding="utf-8")))
        return 0
    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        parser.error("--steps must be >= 1, --warmup >= 0, --threads >= 1")
    if args.pg_engine == "auto":
        args.pg_engine = "vllm"
    library = command_allocator()
    args.base_env = {"LD_PRELOAD": library} if library else {}
    machine = machine_description()
    warn_if_busy(machine)
    logs = log_dir("levers")
    _say(f"worker logs: {logs}")
    started = time.perf_counter()
    result: dict[str, Any] = {
        "benchmark": "levers",
        "date": today(),
        "command": " ".join(["python", "benchmarks/levers.py", *sys.argv[1:]]),
        "machine": machine,
        "settings": {
            "levers": args.lever or list(LEVERS),
            "steps": args.steps,
            "warmup": args.warmup,
            "beta": args.beta,
            "threads": args.threads,
            "seed": args.seed,
            "pg_engine": args.pg_engine,
            "pg_overrides": args.pg_override,
            "allocator": library or "glibc",
        },
        "runs": [],
    }
    out = args.output or new_result_path("levers", result["date"])
    for lever in args.lever or LEVERS:
        result["runs"].append(run_lever(args, lever, logs))
        write_json(out, result)  # what is measured survives a later lever's failure
    result["wall_minutes"] = (time.perf_counter() - started) / 60
    try:
        result["machine"]["loadavg_at_end"] = list(os.getloadavg())
    except OSError:
        pass
    write_json(out, result)
    text = report(result)
    print(text)
    _say(f"wrote {out} ({result['wall_minutes']:.1f} min)")
    if args.update_readme:
        update_readme_section(README_SECTION, text)
    return 0


if __name__ == "__main__":
    run_main(main)
