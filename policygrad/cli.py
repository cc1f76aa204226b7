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
the new config is validated).

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
        print(TRAIN_USAGE)
        return 0
    config_path, resume, rest = _split_train_args(argv)
    config = _load_train_config(config_path, resume, rest)
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
    from policygrad.config.train import RewardConfig, TrainConfig
    from policygrad.data.sources import is_code_dataset
    from policygrad.evaluate.single_turn import eval_output_path, evaluate_model
    from policygrad.lab.common import OneLineArgumentParser, check_temperature
    from policygrad.rewards.code import TaskReward

    p = OneLineArgumentParser(
        prog="policygrad eval",
        description="Greedy accuracy, pass@k and maj@k of a model; with --env, the success of its "
        "multi-turn episodes.",
    )
    p.add_argument(
        "--model",
        default="bundled:smollm2-135m-instruct",
        help="model folder, LoRA adapter folder (RUN_DIR/checkpoints/step_N/model), hub id or bundled:NAME",
    )
    p.add_argument("--adapter", default=None, help="a PEFT adapter folder on top of --model")
    p.add_argument(
        "--dataset",
        default=None,
        help="JSONL path, Hub dataset id (openai/gsm8k), builtin:arithmetic, builtin:code, builtin:guess "
        "(held-out split) or humaneval (default builtin:arithmetic; with --env, the environment's task)",
    )
    p.add_argument(
        "--env",
        default=None,
        help="evaluate multi-turn episodes of this environment: builtin:guess, builtin:calculator, "
        "builtin:code_feedback, package.module:Class or path/to/file.py:Class",
    )
    p.add_argument(
        "--env-options",
        default=None,
        help="""JSON object of the environment's options, e.g. '{"high": 50}'""",
    )
    p.add_argument(
        "--max-turns", type=int, default=None, help="with --env: the most turns per episode (default 4)"
    )
    p.add_argument(
        "--max-episode-tokens", type=int, default=None, help="with --env: the most tokens after the prompt"
    )
    p.add_argument("--dataset-config", default=None, help="the Hub dataset's config (openai/gsm8k: main)")
    p.add_argument("--split", default=None, help="split of a Hub dataset or dataset folder (default test)")
    p.add_argument("--limit", type=int, default=100, help="first N items (default 100; all when fewer)")
    p.add_argument(
        "--samples", type=int, default=1, help="n samples per item for pass@k, maj@k (default 1: greedy only)"
    )
    p.add_argument("--k", default=None, help="comma-separated k <= n for pass@k and maj@k (default 1,n)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the n samples")
    p.add_argument("--max-new-tokens", type=int, default=256, help="per completion (with --env: per turn)")
    p.add_argument(
        "--engine", default="auto", choices=("auto", "hf", "vllm"), help="auto: vllm when installed"
    )
    p.add_argument("--difficulty", default="medium", help="difficulty of builtin:arithmetic / builtin:code")
    p.add_argument("--prompt-field", default=None)
    p.add_argument("--answer-field", default=None)
    p.add_argument("--batch-size", type=int, default=None, help="prompts per generate call (default: all)")
    p.add_argument("--output", default=None, help="JSONL of every completion (default: eval-<dataset>.jsonl)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--isolation",
        default="auto",
        choices=("auto", "bwrap", "namespaces", "none"),
        help="sandbox of code rows (humaneval, builtin:code): see reward.code.isolation",
    )
    args = p.parse_args(argv)
    checks = (
        ("--limit", args.limit),
        ("--batch-size", args.batch_size),
        ("--samples", args.samples),
        ("--max-new-tokens", args.max_new_tokens),
        ("--max-turns", args.max_turns),
        ("--max-episode-tokens", args.max_episode_tokens),
    )
    for flag, value in checks:
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    ks: list[int] = []
    if args.k:
        try:
            ks = [int(k) for k in args.k.split(",") if k.strip()]
        except ValueError:
            raise ValueError(f"--k {args.k!r} must be comma-separated integers, e.g. --k 1,5") from None
        bad = [k for k in ks if not 1 <= k <= args.samples]
        if bad:
            raise ValueError(f"--k {args.k}: each k must be in 1 .. --samples {args.samples}")
    if args.num_threads is not None:
        if args.num_threads < 1:
            raise ValueError(f"--num-threads must be >= 1, got {args.num_threads}")
        import torch

        torch.set_num_threads(args.num_threads)
    check_temperature(args.temperature)
    if args.env is not None:
        return _eval_env(args, ks)
    for flag, value in (
        ("--env-options", args.env_options),
        ("--max-turns", args.max_turns),
        ("--max-episode-tokens", args.max_episode_tokens),
    ):
        if value is not None:
            raise ValueError(
                f"{flag} applies to multi-turn episodes only; give --env (an environment) or drop {flag}"
            )
    args.dataset = args.dataset or "builtin:arithmetic"
    data = eval_data_config(args, args.dataset)
    TrainConfig(data=data, reward=RewardConfig(functions=list(TaskReward.functions)))  # validates
    # Every argument is checked before the dataset is read or a model is loaded (or converted).
    output = eval_output_path(args.output, args.dataset)
    result = evaluate_model(
        args.model,
        data,
        adapter=args.adapter,
        limit=args.limit,
        samples=args.samples,
        ks=ks,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        output=output,
        seed=args.seed,
        engine=args.engine,
        # Rows with code tests are judged by code_tests in the sandbox; maj@k has no answer to vote on.
        reward_fn=TaskReward({"isolation": args.isolation}),
        **({"answer_fn": None} if is_code_dataset(args.dataset) else {}),
    )
    print(json.dumps(result, indent=2))
    return 0


def eval_data_config(args, dataset: str):
    """The data section of ``policygrad eval``: ``dataset``'s held-out rows, as the flags say.

    Raises:
        ValueError: ``--split`` or ``--dataset-config`` given for a dataset it does nothing for
            (a single file, a built-in dataset; ``--dataset-config``: anything but a Hub dataset).
    """
    from policygrad.config.train import DataConfig
    from policygrad.data.sources import inert_dataset_option

    flags = (
        ("--split", args.split, "split", "a split of a dataset folder or a Hub dataset"),
        ("--dataset-config", args.dataset_config, "config", "a Hub dataset's configuration"),
    )
    for flag, value, option, chooses in flags:
        kind = inert_dataset_option(dataset, option) if value is not None else None
        if kind:
            raise ValueError(
                f"{flag} {value} does nothing for --dataset {dataset}, {kind}: it chooses {chooses}; "
                f"drop {flag}"
            )

    return DataConfig(
        dataset=dataset,
        difficulty=args.difficulty,
        prompt_field=args.prompt_field,
        answer_field=args.answer_field,
        eval_dataset=dataset,
        eval_size=args.limit,
        dataset_config=args.dataset_config,
        eval_split="test" if args.split is None else args.split,
    )


def _env_options(text: str | None) -> dict:
    """``--env-options``: a JSON object (None: no options)."""
    if text is None:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"--env-options {text!r} is not valid JSON ({exc.msg}, column {exc.colno}); give a JSON object, "
            """e.g. --env-options '{"high": 50}'"""
        ) from None
    if not isinstance(options, dict):
        raise ValueError(
            f"--env-options must be a JSON object of the environment's options, got {type(options).__name__} "
            f"{text!r}; e.g. --env-options '{{\"high\": 50}}'"
        )
    return options


def _check_env(name: str, options: dict, raw: str | None) -> None:
    """Build one environment of ``--env`` with ``--env-options`` (before any model loads), its
    errors worded with the flags."""
    from policygrad.envs.registry import check_environment_spec, environment_factory

    try:
        check_environment_spec(name)
    except (ValueError, TypeError, OSError) as exc:
        raise ValueError(f"--env: {str(exc).replace('env.name', '--env')}") from None
    try:
        environment_factory(name, options, isolation=True)  # eval's episodes run in worker processes too
    except (ValueError, TypeError, ImportError, SyntaxError, OSError) as exc:
        text = str(exc).strip().replace("\n", " ")
        # Only the options' own errors are fixed by other options; a missing class, a file that
        # fails to import or a constructor that fails otherwise say their own fix.
        about_options = "env.options" in text
        text = text.replace("env.options do not fit", f"--env-options {raw or '{}'} do not fit")
        text = text.replace("env.options", "--env-options")
        text = text.replace("env.name", "--env")
        if "--env" not in text:  # an import error of the environment's module
            text = f"--env {name}: {text}"
        raise ValueError(f"{text}; give options {name} accepts" if about_options else text) from None


def _eval_env(args, ks: list[int]) -> int:
    """``policygrad eval --env``: greedy (and sampled) episodes, success and pass@k."""
    from policygrad.evaluate.episodes import default_env_dataset, evaluate_env_model
    from policygrad.evaluate.single_turn import eval_output_path

    options = _env_options(args.env_options)
    dataset = args.dataset or default_env_dataset(args.env)
    data = eval_data_config(args, dataset)
    output = eval_output_path(args.output, dataset)
    _check_env(args.env, options, args.env_options)
    result = evaluate_env_model(
        args.model,
        data,
        env=args.env,
        env_options=options,
        adapter=args.adapter,
        limit=args.limit,
        samples=args.samples,
        ks=ks,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        max_turns=args.max_turns if args.max_turns is not None else 4,
        max_episode_tokens=args.max_episode_tokens,
        batch_size=args.batch_size,
        output=output,
        seed=args.seed,
        engine=args.engine,
    )
    failed, sampled = result["failed"], result.get("samples_failed", 0)
    if failed or sampled:  # counted as unsuccessful in success and pass@k: said, not silent
        counts = f"{failed} of {result['n']} greedy" + (
            f" and {sampled} sampled" if "samples_failed" in result else ""
        )
        print(
            f"note: {counts} episodes failed in the environment and count as unsuccessful in success "
            f"and pass@k (the first: {result['first_error']}); each episode's error is in {result['output']}",
            file=sys.stderr,
        )
    print(json.dumps(result, indent=2))
    return 0


LAB_USAGE = """usage: policygrad lab {gradient-snr,kl-estimators,mismatch,passk} [options]

  gradient-snr    gradient signal-to-noise and cosine to a reference of advantage estimators
  kl-estimators   bias and spread of k1/k2/k3, and which KL each placement's gradient follows
  mismatch        sampler vs trainer and bf16 vs fp32 log-prob mismatch, growth with length
  passk           pass@k vs k of a base and a trained model: does RL teach or select? (also HTML)

Each prints a table and writes a JSON result and a PNG plot under --output-dir (lab-results/).
"""


def cmd_memory(argv: list[str]) -> int:
    # imported per command: each command loads only its own modules (help and argument errors come fast)
    from policygrad.lab import memory

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


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "memory": cmd_memory, "lab": cmd_lab, "report": cmd_report}


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
    argv = sys.argv[1:] if argv is None else argv
    _show_library_messages()
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: policygrad {train,eval,memory,lab,report} ...\n\n"
            "  train   run a training job (no arguments: the default GRPO job on the bundled model)\n"
            "  eval    greedy accuracy / pass@k of a model on a dataset (--env: of multi-turn episodes)\n"
            "  memory  the memory bill of an RL job (models, optimiser state, KV cache, logits)\n"
            "  lab     experiments: gradient-snr, kl-estimators, mismatch, passk\n"
            "  report  one HTML page with a run's curves, config and completions\n"
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
