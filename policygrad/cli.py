"""``policygrad``: the command-line front door.

    policygrad train [CONFIG.yaml] [--key=value ...] [--resume RUN_DIR]
    policygrad eval --model M --dataset D [--limit N] [--samples k] [--output FILE]
    policygrad eval --env builtin:guess [--env-options JSON] [--max-turns N] [--limit N] ...
    policygrad memory --model M --algorithm A [--lora-rank r] [--batch B --seq-len T] ...
    policygrad lab {gradient-snr,kl-estimators,mismatch,passk} [options]
    policygrad report RUN_DIR [RUN_DIR ...] [--output report.html]

A user's mistake (bad config, missing file, bad data) prints one clear ``error:`` line and exits
with status 2; it never ends in a traceback.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import sys

import yaml

TRAIN_USAGE = """usage: policygrad train [CONFIG.yaml] [--key=value ...] [--resume RUN_DIR]

Runs a training job. With no arguments: GRPO on the bundled SmolLM2-135M-Instruct and the
built-in arithmetic task. Every config field can be overridden, e.g. --kl.beta=0.04 --steps=10.
--resume RUN_DIR continues the run in RUN_DIR from its newest complete checkpoint (its saved
config plus any overrides given here: --steps, --max_minutes and similar are applied, --optim.lr
sets the new rate, an option that cannot change on resume is refused by name).
--overwrite=true replaces the run in output_dir (only the files a run writes are deleted, after
the new config is validated). --print-config prints the validated config (the recipe and the
overrides; with --resume the run's saved config and the overrides) as YAML and exits without
loading a model: saved as a file, it runs the same job.

Ctrl-C (or SIGTERM) stops after the current step with a checkpoint; press it again to stop at
once. Checkpoints are also written every save_every_minutes (10) minutes and on an error.
"""


def _user_errors():
    # imported per command: each command loads only its own modules (help and argument errors come fast)
    from policygrad.config.train import ConfigError
    from policygrad.errors import TrainingError

    # OSError covers missing files and unwritable folders; ImportError and SyntaxError come from a
    # user's reward-function file. POLICYGRAD_DEBUG=1 shows the full traceback instead.
    errors: tuple[type[BaseException], ...] = (
        ConfigError,
        OSError,
        ValueError,
        TypeError,
        TrainingError,
        ImportError,
        SyntaxError,
        yaml.YAMLError,
    )
    try:  # the reward registry loads user code machinery: only when an error is being classified
        from policygrad.rewards.registry import RewardFunctionError

        errors += (RewardFunctionError,)
    except ImportError:
        pass
    return errors


def _split_train_args(argv: list[str]) -> tuple[str | None, str | None, list[str]]:
    """(config path, --resume run directory, the other arguments) of ``policygrad train``'s
    arguments: the config path is a first argument not starting with ``--``."""
    config_path = None
    resume = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--resume" or arg.startswith("--resume="):
            if "=" in arg:
                resume = arg.split("=", 1)[1]
            else:
                if i + 1 >= len(argv):
                    raise ValueError("--resume needs a run directory: --resume RUN_DIR")
                resume = argv[i + 1]
                i += 1
        elif not arg.startswith("--") and config_path is None and not rest:
            config_path = arg
        else:
            rest.append(arg)
        i += 1
    return config_path, resume, rest


def _load_train_config(config_path: str | None, resume: str | None, rest: list[str]):
    """The validated TrainConfig of ``policygrad train``: on --resume, the run's saved config (or
    ``config_path``) with ``rest`` applied, in the run's own folder; else ``config_path`` (or the
    defaults) with ``rest`` applied."""
    # imported per command: each command loads only its own modules (help and argument errors come fast)
    from policygrad.config.train import ConfigError, load_config, parse_overrides
    from policygrad.run.directory import config_file

    if resume is not None:
        saved = config_file(resume)
        if not os.path.exists(saved):
            raise FileNotFoundError(
                f"--resume {resume}: {saved} not found; is this a policygrad run directory?"
            )
        given = parse_overrides(rest)
        if "overwrite" in given:
            raise ConfigError(f"--overwrite cannot be combined with --resume {resume}; give one of them")
        # The run continues in its own folder: a different --output_dir is refused by the Trainer.
        where = [] if "output_dir" in given else [f"--output_dir={resume}"]
        return load_config(config_path or saved, rest + where + ["--overwrite=false"])
    if config_path is not None and not os.path.exists(config_path):
        raise FileNotFoundError(f"config file {config_path} not found")
    return load_config(config_path, rest)


def cmd_train(argv: list[str]) -> int:
    # imported per command: each command loads only its own modules (help and argument errors come fast)
    from policygrad.parallel.distributed import init_from_env, shutdown
    from policygrad.run import Run
    from policygrad.run.interrupts import EXIT_STATUS, Stopped, StopSignals

    if argv and argv[0] in ("-h", "--help"):
        from policygrad.config.reference import options_text  # torch-free: help comes fast
        from policygrad.config.train import TrainConfig

        print(TRAIN_USAGE)
        print("Options: every field of the config, its default, type and use (--section.key=value):\n")
        print(options_text(TrainConfig))
        return 0
    print_config = "--print-config" in argv
    config_path, resume, rest = _split_train_args([a for a in argv if a != "--print-config"])
    config = _load_train_config(config_path, resume, rest)
    if print_config:  # the resolved config, as a file that runs the same job; nothing is loaded
        print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
        return 0
    dist = init_from_env()  # under torchrun: join the process group (one process: nothing)
    run = None
    try:
        # A signal while the run is built (models, trackers) stops it cleanly: the Run
        # releases the folder and removes what it wrote; train() handles its own from there.
        with StopSignals(at_once=True):
            run = Run(config, resume_from=resume)
            try:
                summary = run.train()
            finally:
                run.close()
    except Stopped as stop:
        if run is None:
            what = "while the run was starting, before its first step; run the same command again to start it"
        else:
            what = f"while the run was shutting down; what it saved in {config.output_dir} stands"
        logging.getLogger("policygrad").warning("stopped by %s %s", stop.signal, what)
        return EXIT_STATUS[stop.signal]
    finally:
        shutdown()
    if dist.is_main:
        print(json.dumps(summary, indent=2))
    return EXIT_STATUS.get(summary.get("interrupted"), 0)


def cmd_eval(argv: list[str]) -> int:
    # imported per command: each command loads only its own modules (help and argument errors come fast)
    from policygrad.evaluate.command import cmd_eval as evaluate_command

    return evaluate_command(argv)


LAB_USAGE = """usage: policygrad lab {gradient-snr,kl-estimators,mismatch,passk} [options]

  gradient-snr    gradient signal-to-noise and cosine to a reference of advantage estimators
  kl-estimators   bias and spread of k1/k2/k3, and which KL each placement's gradient follows
  mismatch        sampler vs trainer and bf16 vs fp32 log-prob mismatch, growth with length
  passk           pass@k vs k of a base and a trained model: does RL teach or select? (also HTML)

Each prints a table and writes a JSON result and a PNG plot under --output-dir (lab-results/).
"""


def cmd_serve(argv: list[str]) -> int:
    """``policygrad serve MODEL [options] [-- vLLM options]``: a rollout server in the foreground
    (stop it with Ctrl-C). A run samples from it with ``rollout.engine=server
    rollout.servers=[http://HOST:PORT]``.

    Raises:
        ValueError: a bad option (one ``error:`` line), a model that is not a local folder.
    """
    # imported per command: each command loads only its own modules (help and argument errors come fast)
    from policygrad.arguments import OneLineArgumentParser
    from policygrad.config.checks import parse_cpus
    from policygrad.models.loading import resolve_model_path
    from policygrad.rollout.serve import main, server_arguments, server_environment

    parser = OneLineArgumentParser(
        prog="policygrad serve",
        description="A vLLM rollout server that policygrad runs sample from and push weights to "
        "(rollout.engine=server). Options after -- go to vLLM's server as they are.",
    )
    parser.add_argument("model", help="model folder (or bundled:NAME), the policy's starting weights")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: this machine only; 0.0.0.0 for every interface, which "
        "opens vLLM's unauthenticated weight routes to the network)",
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context in tokens (default: the model's)"
    )
    parser.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache on CPU, GiB")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="on a GPU")
    parser.add_argument("--cpus", default=None, help='CPUs to run on, e.g. "1" or "2-3" (default: all)')
    parser.add_argument("--seed", type=int, default=0)
    own, _, extra = _split_extra(argv)
    args = parser.parse_args(own)
    model = resolve_model_path(args.model)
    on_cpu = not torch_cuda_available()
    cpus = parse_cpus("--cpus", args.cpus) if args.cpus else None
    for name, value in server_environment(args.kv_cache_gb if on_cpu else None, cpus).items():
        os.environ.setdefault(name, value)
    if cpus:
        os.sched_setaffinity(0, cpus)
    main(
        server_arguments(
            model,
            port=args.port,
            host=args.host,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            seed=args.seed,
            on_cpu=on_cpu,
            gpu_memory_utilization=args.gpu_memory_utilization,
        )
        + extra
    )
    return 0


def _split_extra(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """``argv`` before ``--``, and the options after it (vLLM's own)."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], "--", argv[i + 1 :]
    return list(argv), "", []


def torch_cuda_available() -> bool:
    # imported here: torch loads only for the commands that use it
    import torch

    return torch.cuda.is_available()


def cmd_memory(argv: list[str]) -> int:
    # imported per command: each command loads only its own modules (help and argument errors come fast)
    from policygrad.lab import memory

    if "--config" in argv:  # a training run's plan: the arguments are policygrad train's
        config_path, resume, rest = _split_train_args([a for a in argv if a != "--config"])
        print(memory.plan_config(_load_train_config(config_path, resume, rest)))
        return 0
    print(memory.main(argv))
    return 0


def cmd_lab(argv: list[str]) -> int:
    # imported per command: each command loads only its own modules (help and argument errors come fast)
    import importlib

    from policygrad.lab import LAB_COMMANDS

    if not argv or argv[0] in ("-h", "--help"):
        print(LAB_USAGE)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in LAB_COMMANDS:
        raise ValueError(f"unknown lab experiment {name!r}; choose one of {', '.join(LAB_COMMANDS)}")
    print(importlib.import_module(LAB_COMMANDS[name]).main(rest))
    return 0


def cmd_report(argv: list[str]) -> int:
    # imported per command: each command loads only its own modules (help and argument errors come fast)
    from policygrad.lab import report

    print(report.main(argv))
    return 0


COMMANDS = {
    "train": cmd_train,
    "eval": cmd_eval,
    "serve": cmd_serve,
    "memory": cmd_memory,
    "lab": cmd_lab,
    "report": cmd_report,
}


class _StdoutHandler(logging.Handler):
    """The library's messages (``logging.getLogger("policygrad")``) as plain lines on the
    current ``sys.stdout`` (looked up per message, so captured output sees them)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(self.format(record), flush=True)


def _show_library_messages() -> None:
    logger = logging.getLogger("policygrad")
    logger.setLevel(logging.INFO)
    if not any(isinstance(h, _StdoutHandler) for h in logger.handlers):
        logger.addHandler(_StdoutHandler())


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command itself (console script, python -m), not a call from Python
        from policygrad.allocator import preload_and_reexec

        try:
            preload_and_reexec()  # returns only when there is nothing to preload
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        from policygrad.quiet import apply  # before torch, transformers or vLLM is imported

        apply(verbose="--verbose" in sys.argv[1:])
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--verbose"]
    _show_library_messages()
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: policygrad {train,eval,serve,memory,lab,report} ...\n\n"
            "  train   run a training job (no arguments: the default GRPO job on the bundled model)\n"
            "  eval    greedy accuracy / pass@k of a model on a dataset (--env: of multi-turn episodes)\n"
            "  serve   a vLLM rollout server that runs sample from (rollout.engine=server)\n"
            "  memory  the memory bill of an RL job (models, optimiser state, KV cache, logits)\n"
            "  lab     experiments: gradient-snr, kl-estimators, mismatch, passk\n"
            "  report  one HTML page with a run's curves, config and completions\n\n"
            "  --verbose (with any command): also show what the libraries print at start (vLLM's and\n"
            "  torch's warnings, deprecations, loading bars), hidden by default (policygrad.quiet)\n"
        )
        return 0 if argv else 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"error: unknown command {command!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        return COMMANDS[command](rest)
    except KeyboardInterrupt as e:
        if not getattr(e, "reported", False):  # a run says itself how it stopped
            print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        message = _error_message(command, e)
        if message is None or os.environ.get("POLICYGRAD_DEBUG"):
            raise  # a bug, not a user's mistake: the traceback helps
        if not _said_by_rank_0(e):
            print(f"error: {message}", file=sys.stderr)
        return 2


def _said_by_rank_0(e: Exception) -> bool:
    """Under torchrun every rank reads the same config, so a config error is raised by all of
    them: rank 0 alone prints it. Errors of one rank's work (a reward, a row) print where they
    happen."""
    from policygrad.config.train import ConfigError  # imported here: only on an error

    rank = int(os.environ.get("RANK", "0") or 0)
    return isinstance(e, ConfigError) and rank > 0 and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


# How torch, CUDA and the C library word a failed allocation (torch on Linux CPU: "DefaultCPUAllocator:
# can't allocate memory ... Error code 12 (Cannot allocate memory)").
_OOM_TEXT = (
    "out of memory",
    "not enough memory",
    "failed to allocate memory",
    "can't allocate memory",
    "cannot allocate memory",
)
_OOM_HINT = {
    "train": "lower rollout.prompts_per_step, rollout.group_size, rollout.max_new_tokens or "
    "optim.micro_batch_size, or use model.lora.rank > 0 or model.gradient_checkpointing=true",
    "eval": "lower --batch-size, --samples or --max-new-tokens",
}


def _error_message(command: str, e: Exception) -> str | None:
    """The one-line message of an error a user can cause (bad config or data, a full disk, out of
    memory, a failing reward function, a corrupt checkpoint, ...); None for anything else."""
    first = str(e).strip().replace("\n", " ") or type(e).__name__
    if isinstance(e, MemoryError) or (
        isinstance(e, RuntimeError) and any(t in first.lower() for t in _OOM_TEXT)
    ):
        hint = _OOM_HINT.get(command, "use less memory")
        return f"out of memory ({first[:200]}); {hint}"
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        where = f" writing {e.filename}" if e.filename else ""
        return f"no space left on device{where}; free space, then run the same command again"
    if isinstance(e, _user_errors()):
        return first
    if _lost_a_peer(e):
        rank = os.environ.get("RANK", "0")
        return (
            f"rank {rank} stopped: another process of this run failed or was stopped (its error is printed "
            "by that rank); fix that error, then resume or start the run again"
        )
    return None


# How gloo and nccl word a collective whose peer process is gone.
_PEER_GONE_TEXT = ("closed by peer", "connection reset by peer", "remote worker", "broken pipe")


def _lost_a_peer(e: Exception) -> bool:
    """A collective failed because another rank of a torchrun run died: that rank prints its own
    error, so this one says one line instead of a traceback from inside torch.distributed."""
    if int(os.environ.get("WORLD_SIZE", "1") or 1) < 2 or not isinstance(e, RuntimeError):
        return False
    text = str(e).lower()
    return any(t in text for t in _PEER_GONE_TEXT)


if __name__ == "__main__":
    sys.exit(main())
