"""``policygrad eval``: its flags, checked before any dataset is read or model loaded, the
evaluation of the model (:func:`~policygrad.evaluate.model.evaluate_model`) and its JSON summary
on stdout. A user's mistake raises one named error (the command line prints it as one ``error:``
line and exits with status 2)."""

from __future__ import annotations

import json
import sys

import torch

from policygrad.arguments import OneLineArgumentParser, check_temperature
from policygrad.config.agent import AGENT_ENVIRONMENT
from policygrad.config.train import DataConfig, RewardConfig, TrainConfig
from policygrad.data.sources import inert_dataset_option, is_code_dataset
from policygrad.envs.agent import agent_factory
from policygrad.envs.registry import check_environment_spec, environment_factory
from policygrad.evaluate.model import default_env_dataset, eval_config, eval_output_path, evaluate_model
from policygrad.rewards.code import TaskReward

__all__ = ["cmd_eval", "eval_data_config"]


def cmd_eval(argv: list[str]) -> int:
    """``policygrad eval ARGS``: prints the JSON summary and returns 0 (exit status).

    Raises:
        ValueError: a bad flag, named. ConfigError / OSError / EvaluationFailed: as
            :func:`~policygrad.evaluate.model.evaluate_model`.
    """
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
        "--agent",
        default=None,
        help="evaluate episodes of this agent (path/to/file.py:run or package.module:run, an agent as "
        "agent.function runs in training); the limits are --max-turns and --max-episode-tokens",
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
        torch.set_num_threads(args.num_threads)
    check_temperature(args.temperature)
    if args.env is not None and args.agent is not None:
        raise ValueError("--env and --agent are both given; an agent is its own environment: give one")
    if args.env is not None or args.agent is not None:
        return _eval_env(args, ks)
    for flag, value in (
        ("--env-options", args.env_options),
        ("--max-turns", args.max_turns),
        ("--max-episode-tokens", args.max_episode_tokens),
    ):
        if value is not None:
            raise ValueError(
                f"{flag} applies to multi-turn episodes only; give --env (an environment) or --agent, "
                f"or drop {flag}"
            )
    args.dataset = args.dataset or "builtin:arithmetic"
    data = eval_data_config(args, args.dataset)
    TrainConfig(data=data, reward=RewardConfig(functions=list(TaskReward.functions)))  # validates
    # Every argument is checked before the dataset is read or a model is loaded (or converted).
    output = eval_output_path(args.output, args.dataset)
    cfg = eval_config(
        args.model, data, seed=args.seed, engine=args.engine, adapter=args.adapter,
        max_new_tokens=args.max_new_tokens,
    )
    result = evaluate_model(
        cfg,
        limit=args.limit,
        output=output,
        samples=args.samples,
        ks=ks,
        temperature=args.temperature,
        batch_size=args.batch_size,
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


def _check_agent(spec: str) -> None:
    """Load ``--agent`` in a worker process (before any model loads), its errors worded with the flag."""
    try:
        check_environment_spec(spec, "--agent")
        agent_factory(AGENT_ENVIRONMENT, {"function": spec}, isolation=True, timeout_s=None)
    except (ValueError, TypeError, ImportError, SyntaxError, OSError) as exc:
        text = str(exc).strip().replace("\n", " ").replace("agent.function", "--agent")
        raise ValueError(text if "--agent" in text else f"--agent {spec}: {text}") from None


def _eval_env(args, ks: list[int]) -> int:
    """``policygrad eval --env`` (or ``--agent``): greedy (and sampled) episodes, success and pass@k."""
    if args.agent is not None and args.env_options is not None:
        raise ValueError("--env-options applies to --env; an agent takes no options")
    options = _env_options(args.env_options)
    dataset = args.dataset or (default_env_dataset(args.env) if args.env else "builtin:arithmetic")
    data = eval_data_config(args, dataset)
    output = eval_output_path(args.output, dataset)
    if args.agent is not None:
        _check_agent(args.agent)
    else:
        _check_env(args.env, options, args.env_options)
    cfg = eval_config(
        args.model, data, seed=args.seed, engine=args.engine, adapter=args.adapter,
        max_new_tokens=args.max_new_tokens, env=args.env, env_options=options if args.env else None,
        agent=args.agent,
        max_turns=args.max_turns if args.max_turns is not None else 4,
        max_episode_tokens=args.max_episode_tokens,
    )
    result = evaluate_model(
        cfg, limit=args.limit, output=output, samples=args.samples, ks=ks, temperature=args.temperature,
        batch_size=args.batch_size,
    )
    failed, sampled = result["failed"], result.get("samples_failed", 0)
    if failed or sampled:  # counted as unsuccessful in success and pass@k: said, not silent
        counts = f"{failed} of {result['n']} greedy" + (
            f" and {sampled} sampled" if "samples_failed" in result else ""
        )
        print(
            f"note: {counts} episodes failed in the {'agent' if args.agent else 'environment'} and count as "
            f"unsuccessful in success and pass@k (the first: {result['first_error']}); each episode's error "
            f"is in {result['output']}",
            file=sys.stderr,
        )
    print(json.dumps(result, indent=2))
    return 0
