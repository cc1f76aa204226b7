"""Model folders a run hands out: the model card (``README.md``) every exported folder carries,
and a merged export (LoRA adapters folded into plain weights) that loads anywhere with
``AutoModelForCausalLM.from_pretrained``, without peft.

The card states the base model (and the adapter the run started from), the algorithm and its
main settings, the data, the steps, the last value of the main metrics and the library version.
A checkpoint's ``model/`` folder gets it when the checkpoint is saved; ``export_merged: true``
(or ``policygrad export RUN_DIR``) writes ``RUN_DIR/merged_model`` with its own card.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import torch
import yaml

from policygrad import __version__
from policygrad.models.adapters import is_peft_model, merged_weights, tied_pairs_that_differ
from policygrad.run.directory import metrics_file

__all__ = ["export_merged", "final_metrics", "model_card", "write_model_card"]

log = logging.getLogger("policygrad")

# The metrics a card quotes, when the run logged them.
CARD_METRICS = (
    "eval/accuracy",
    "reward/mean",
    "reward/score_raw_mean",
    "kl/ref",
    "response/length_mean",
    "policy/entropy",
)


def final_metrics(run_dir: str, *, up_to_step: int | None = None) -> dict[str, float]:
    """The last logged value of each of :data:`CARD_METRICS` in ``RUN_DIR/metrics.jsonl``
    (rows after ``up_to_step`` ignored); empty when there is no file."""
    path = metrics_file(run_dir)
    found: dict[str, float] = {}
    if not os.path.exists(path):
        return found
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by an interrupted write
            if up_to_step is not None and row.get("step", 0) > up_to_step:
                continue
            for key in CARD_METRICS:
                if isinstance(row.get(key), (int, float)):
                    found[key] = float(row[key])
    return found


def _folder_name(output_dir) -> str:
    """The run's folder name (``runs/x/`` -> ``x``), or "policygrad run" without one."""
    return os.path.basename(os.path.normpath(str(output_dir))) if output_dir else "policygrad run"


def _library_version() -> str:
    return __version__


def model_card(
    config: dict[str, Any],
    *,
    steps: int,
    metrics: dict[str, float],
    kind: str,
    base_model: str | None = None,
) -> str:
    """The ``README.md`` of an exported model folder.

    Args:
        config: the run's config as a dict (``TrainConfig.to_dict()``, or a saved ``config.yaml``).
        steps: RL steps the weights have been trained for.
        metrics: the last value of the main metrics (:func:`final_metrics`).
        kind: what the folder holds, e.g. ``"LoRA adapter"``, ``"full model"``, ``"merged model"``.
        base_model: the base model's folder or id when it is known better than ``model.name``.
    """
    model = config.get("model", {})
    data = config.get("data", {})
    rollout = config.get("rollout", {})
    kl = config.get("kl", {})
    optim = config.get("optim", {})
    lora = model.get("lora", {})
    reward = config.get("reward", {})
    version = _library_version()
    lines = [
        "---",
        "library_name: transformers" if kind != "LoRA adapter" else "library_name: peft",
        "tags:",
        "- policygrad",
        "- reinforcement-learning",
        f"- {config.get('algorithm', 'rl')}",
        "---",
        "",
        f"# {config.get('run_name') or _folder_name(config.get('output_dir'))}",
        "",
        f"A {kind} trained with policygrad {version} (reinforcement learning from verifiable rewards).",
        "",
        "| | |",
        "|:--|:--|",
        f"| base model | `{base_model or model.get('name')}` |",
    ]
    if model.get("adapter"):
        lines.append(f"| started from adapter | `{model['adapter']}` |")
    if lora.get("rank"):
        targets = lora.get("target_modules")
        lines.append(f"| LoRA | rank {lora.get('rank')}, alpha {lora.get('alpha')}, targets {targets} |")
    kl_text = str(kl.get("placement"))
    if kl.get("placement") != "none":
        kl_text += f", beta {kl.get('beta')}"
    data_text = f"`{data.get('dataset')}`"
    if data.get("dataset_config"):
        data_text += f" ({data['dataset_config']})"
    if data.get("eval_dataset"):
        data_text += f", evaluated on `{data['eval_dataset']}`"
    lines += [
        f"| algorithm | `{config.get('algorithm')}` |",
        f"| samples | {rollout.get('prompts_per_step')} prompts x {rollout.get('group_size')} samples per "
        f"step, temperature {rollout.get('temperature')}, at most {rollout.get('max_new_tokens')} new "
        "tokens |",
        f"| optimizer | lr {optim.get('lr')}, {optim.get('ppo_epochs')} epoch(s) x "
        f"{optim.get('num_minibatches')} minibatch(es) per step |",
        f"| KL to the reference | {kl_text} |",
        f"| rewards | {', '.join(f'`{r}`' for r in reward.get('functions', []))} |",
        f"| data | {data_text} |",
        f"| steps | {steps} |",
        f"| seed | {config.get('seed')} |",
        "",
    ]
    if metrics:
        lines += ["## Final metrics", "", "| metric | value |", "|:--|--:|"]
        lines += [f"| `{k}` | {v:.4g} |" for k, v in metrics.items()]
        lines.append("")
    lines += [
        "## Use",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer"
        if kind != "LoRA adapter"
        else "from peft import AutoPeftModelForCausalLM",
        "model = AutoModelForCausalLM.from_pretrained(PATH)"
        if kind != "LoRA adapter"
        else "model = AutoPeftModelForCausalLM.from_pretrained(PATH)",
        "```",
        "",
        "or `policygrad eval --model PATH`. The full configuration of the run is below.",
        "",
        "```yaml",
        yaml.safe_dump(config, sort_keys=False).rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def write_model_card(folder: str, card: str) -> None:
    """Write ``card`` as ``folder/README.md`` (replacing the template peft writes)."""
    with open(os.path.join(folder, "README.md"), "w", encoding="utf-8") as f:
        f.write(card)


def untie_trained_copies(folder: str, model, state: dict[str, torch.Tensor]) -> bool:
    """Mark the saved ``folder/config.json`` untied when ``state`` holds a tied pair with
    different values (:func:`~policygrad.models.adapters.tied_pairs_that_differ`): loaders that
    tie them (vLLM ignores a tied model's ``lm_head.weight``) would drop the trained weights.

    Returns:
        True when the config was changed.
    """
    if not tied_pairs_that_differ(model, state):
        return False
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    for section in (config, config.get("text_config") or {}):
        if section.get("tie_word_embeddings"):
            section["tie_word_embeddings"] = False
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return True


def remove_dead_exports(folder: str) -> list[str]:
    """Delete ``FOLDER.tmp-PID`` folders that an export killed part-way left (its process ``PID``
    no longer runs; a live one's is left alone). Returns the paths deleted."""
    parent, name = os.path.split(os.path.abspath(folder))
    removed = []
    for entry in os.listdir(parent) if os.path.isdir(parent) else ():
        pid = entry[len(name) + 5 :] if entry.startswith(f"{name}.tmp-") else ""
        if not pid.isdigit() or int(pid) == os.getpid() or _alive(int(pid)):
            continue
        shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
        removed.append(os.path.join(parent, entry))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def export_merged(policy, tokenizer, folder: str, *, card: str | None = None) -> str:
    """Write ``policy`` with every LoRA adapter merged in (``W + (alpha / r) B A``; the policy
    itself is not modified) as a plain Hugging Face model folder, with the tokenizer and ``card``.

    The folder is written next to its final place and renamed into it when complete; an older
    export there is replaced. Returns ``folder``.

    Raises:
        ValueError: an adapter uses DoRA. OSError: the folder cannot be written.
    """
    base = policy.get_base_model() if is_peft_model(policy) else policy
    folder = os.path.abspath(folder)
    remove_dead_exports(folder)
    tmp = folder + f".tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    state = {name: tensor.contiguous() for name, tensor in merged_weights(policy)}
    base.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    untie_trained_copies(tmp, policy, state)
    tokenizer.save_pretrained(tmp)
    if card is not None:
        write_model_card(tmp, card)
    if os.path.exists(folder):
        shutil.rmtree(folder)
    os.rename(tmp, folder)
    log.info("merged model written to %s", folder)
    return folder
