"""The Python entry point: :func:`train` runs a job from objects or names, as the CLI runs one
from a YAML file.

    import policygrad
    summary = policygrad.train(model=model, tokenizer=tokenizer, reward_funcs=[my_reward],
                               train_dataset=dataset, steps=100)

Everything :func:`train` accepts maps onto the same validated
:class:`~policygrad.config.train.TrainConfig` and the same
:class:`~policygrad.run.Run` the CLI uses; objects reach the trainer through its
injection points (``model=``, ``reward_functions=``, ``train_source=``, ``eval_rows=``), and
``RUN_DIR/config.yaml`` records each object by its import path (``module:qualname``) when it has
one, else by a placeholder such as ``<callable <lambda> (not importable)>``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from policygrad.config.train import TrainConfig, load_config
from policygrad.data.sources import PromptDataset, load_prompt_records
from policygrad.envs.agent import AgentFunction
from policygrad.rewards.callables import describe_object
from policygrad.run import Run

__all__ = ["train"]

_DEFAULT = object()


def _dotted(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``{"kl.beta": 0.04, "rollout": {"group_size": 4}}`` -> a nested override tree."""
    tree: dict[str, Any] = {}
    for key, value in overrides.items():
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if isinstance(value, Mapping) and isinstance(node.get(parts[-1]), dict):
            node[parts[-1]].update(value)
        else:
            node[parts[-1]] = dict(value) if isinstance(value, Mapping) else value
    return tree


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if both else value
    return out


def _config_tree(config) -> tuple[str | None, dict[str, Any]]:
    """(YAML path or None, a config tree) of ``config``: a TrainConfig, a mapping, a path, None."""
    if config is None:
        return None, {}
    if isinstance(config, TrainConfig):
        return None, config.to_dict()
    if isinstance(config, Mapping):
        return None, _dotted(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config={path!r} does not exist; give a YAML file, dict or TrainConfig")
        return path, {}
    raise TypeError(f"config must be a TrainConfig, a dict or a YAML path, got {type(config).__name__}")


def _is_dataset_dict(obj) -> bool:
    return type(obj).__name__ in ("DatasetDict", "IterableDatasetDict") and isinstance(obj, Mapping)


def _rows(obj, *, name: str, data, split: str, require_answer: bool) -> list[dict[str, Any]]:
    """Prompt rows (field mapping applied) of an in-memory dataset."""
    if _is_dataset_dict(obj):
        if split not in obj:
            splits = sorted(obj)
            raise ValueError(f"{name}: the DatasetDict has splits {splits}, not {split!r}; set data.split")
        obj = obj[split]
    return load_prompt_records(
        obj,
        name=name,
        prompt_field=data.prompt_field,
        answer_field=data.answer_field,
        require_answer=require_answer,
    )


def _describe_dataset(obj) -> str:
    kind = type(obj).__name__
    try:
        size = f"{len(obj)} rows, " if not _is_dataset_dict(obj) else f"splits {sorted(obj)}, "
    except TypeError:
        size = ""
    return f"<dataset {kind} ({size}in memory)>"


def _apply_model(tree: dict[str, Any], model, tokenizer) -> tuple[dict[str, Any], Any]:
    """(config tree with ``model.name`` set when ``model`` is a name, the model object or None)."""
    model_object = None
    if tokenizer is not None and (model is _DEFAULT or isinstance(model, (str, os.PathLike))):
        raise TypeError("tokenizer= goes with a model object; a model name brings its own tokenizer")
    if model is not _DEFAULT and model is not None:
        if isinstance(model, (str, os.PathLike)):
            tree = _merge(tree, {"model": {"name": os.fspath(model)}})
        else:
            model_object = model  # the trainer records it as model.name (or refuses another name)
    return tree, model_object


def _apply_reward_funcs(tree: dict[str, Any], reward_funcs) -> tuple[dict[str, Any], list | None]:
    """(config tree with ``reward.functions`` set when every function is a name, the list of
    functions when one is an object, else None)."""
    reward_objects = None
    if reward_funcs is not None:
        one = isinstance(reward_funcs, str) or callable(reward_funcs)
        funcs = [reward_funcs] if one else list(reward_funcs)
        if all(isinstance(f, str) for f in funcs):
            tree = _merge(tree, {"reward": {"functions": funcs}})
        else:
            reward_objects = funcs
    return tree, reward_objects


def _apply_datasets(
    tree: dict[str, Any], train_dataset, eval_dataset
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(config tree with ``data.dataset`` / ``data.eval_dataset`` set: a path as is, an in-memory
    dataset as its description; the in-memory datasets by those keys)."""
    in_memory = {}
    for key, obj in (("dataset", train_dataset), ("eval_dataset", eval_dataset)):
        if obj is None:
            continue
        if isinstance(obj, (str, os.PathLike)):
            tree = _merge(tree, {"data": {key: os.fspath(obj)}})
        else:
            in_memory[key] = obj
            tree = _merge(tree, {"data": {key: _describe_dataset(obj)}})
    return tree, in_memory


def _in_memory_sources(cfg: TrainConfig, in_memory: dict[str, Any], reward_objects) -> tuple[Any, Any]:
    """(train source, eval rows) of the in-memory datasets, None for each one not given; a train
    DatasetDict without an eval dataset supplies its ``data.eval_split`` when it has one."""
    names = [f for f in (reward_objects or cfg.reward.functions) if isinstance(f, str)]
    require_answer = "answer_correctness" in names
    train_source = eval_rows = None
    if "dataset" in in_memory:
        rows = _rows(
            in_memory["dataset"], name="train_dataset", data=cfg.data, split=cfg.data.split,
            require_answer=require_answer,
        )
        train_source = PromptDataset(rows, seed=cfg.seed, shuffle=cfg.data.shuffle, name="train_dataset")
        if "eval_dataset" not in in_memory and _is_dataset_dict(in_memory["dataset"]):
            if cfg.data.eval_split in in_memory["dataset"]:
                in_memory["eval_dataset"] = in_memory["dataset"][cfg.data.eval_split]
    if "eval_dataset" in in_memory:
        eval_rows = _rows(
            in_memory["eval_dataset"], name="eval_dataset", data=cfg.data, split=cfg.data.eval_split,
            require_answer=True,
        )
    return train_source, eval_rows


def train(
    model: Any = _DEFAULT,
    reward_funcs: str | Callable | Sequence[str | Callable] | None = None,
    train_dataset: Any = None,
    *,
    eval_dataset: Any = None,
    tokenizer=None,
    config: Any = None,
    resume_from: str | os.PathLike | None = None,
    env: Any = None,
    agent: Any = None,
    **overrides: Any,
) -> dict[str, Any]:
    """Run a training job and return its summary (also written to ``RUN_DIR/summary.json``).

    Args:
        model: a model name (``bundled:smollm2-135m-instruct``, a local folder, a LoRA adapter
            folder, a Hub id), or a loaded ``transformers`` causal LM (or a ``peft`` model,
            whose adapter then trains) with its ``tokenizer`` (read from the model's folder when
            omitted). A model object is trained in place. Default: the config's ``model.name``.
        reward_funcs: one or a list of: built-in names (``answer_correctness``, ...),
            ``module:function`` / ``file.py:function`` specs, or Python callables
            ``fn(prompts, completions, **row_fields) -> list[float]``, sync or ``async def``.
            Default: the config's ``reward.functions``.
        train_dataset: a ``datasets.Dataset`` (or ``DatasetDict``: its ``data.split``), a list of
            dicts, a local file or folder, a Hub id (``openai/gsm8k`` with
            ``data={"dataset_config": "main"}``) or ``builtin:arithmetic``. Rows need a prompt
            field (``prompt``, ``question``, ...) and, for answer-checking rewards, an answer
            field; ``data.prompt_field`` / ``data.answer_field`` map others.
        eval_dataset: held-out rows, in any of the same forms (default: the config's).
        config: a :class:`~policygrad.config.train.TrainConfig`, a dict (nested or dotted
            keys) or a YAML path.
        resume_from: a run directory to continue from its latest checkpoint (pass the same
            objects again).
        env: a multi-turn environment: a spec (``builtin:guess``, ``module:Class``,
            ``file.py:Class``) or an :class:`~policygrad.envs.Environment` class (or a factory
            returning a new one), built with ``env={"options": ...}`` from the config; episode
            limits are ``rollout`` options (``max_turns`` ...).
        agent: an agent trained as episodes (:mod:`policygrad.envs.agent`): ``async def
            run(client, row) -> reward`` (or a plain function) using the OpenAI client it is
            given, or its spec (``module:run``, ``file.py:run``); ``agent={"timeout_s": ...}``
            options go in the config. Not together with ``env``.
        **overrides: config fields, applied last: ``steps=10``, ``output_dir="runs/x"``,
            ``rollout={"group_size": 4}`` (merged into the section), or dotted keys through a
            dict, ``**{"kl.beta": 0.04}``.

    Returns:
        The run's summary: ``run_dir``, ``steps``, accuracies before/after when evaluated, ...

    Raises:
        ConfigError: a bad field (named, with the fix).
        FileNotFoundError: a missing file, named.
        ValueError: bad data, named.
        TypeError: a wrong argument type, named.
        TrainingError: the run cannot continue.
    """
    path, tree = _config_tree(config)
    tree = _merge(tree, _dotted(overrides))
    tree, model_object = _apply_model(tree, model, tokenizer)
    tree, reward_objects = _apply_reward_funcs(tree, reward_funcs)
    tree, in_memory = _apply_datasets(tree, train_dataset, eval_dataset)
    env_object = None
    if isinstance(env, str):
        tree = _merge(tree, {"env": {"name": env}})
    elif env is not None:  # validated with the record the trainer will write
        env_object = env
        tree = _merge(tree, {"env": {"name": describe_object(env, kind="environment")}})
    if agent is not None:
        if env is not None:
            raise TypeError("give env or agent, not both: an agent is its own environment")
        if isinstance(agent, str):
            tree = _merge(tree, {"agent": {"function": agent}})
        else:  # run in worker processes when importable (pickled by reference), else in this one
            env_object = AgentFunction(agent)
            tree = _merge(tree, {"agent": {"function": describe_object(agent, kind="agent")}})
    if reward_objects is not None:  # validated with the records the trainer will write
        tree = _merge(tree, {"reward": {"functions": [describe_object(f) for f in reward_objects]}})
    cfg = load_config(path, tree)

    train_source, eval_rows = _in_memory_sources(cfg, in_memory, reward_objects)
    run = Run(
        cfg,
        resume_from=os.fspath(resume_from) if resume_from is not None else None,
        model=model_object,
        tokenizer=tokenizer,
        reward_functions=reward_objects,
        train_source=train_source,
        eval_rows=eval_rows,
        environment=env_object,
    )
    try:
        return run.train()
    finally:
        run.close()
