"""LoRA adapters in and out: start a run (or an evaluation) from a trained PEFT adapter, keep the
starting adapter as the frozen reference, and merge adapters into plain weights for export and
for engines that hold their own copy of the model.

A model is named by ``model.name`` and, optionally, ``model.adapter``:

- ``model.name`` a full model (``bundled:NAME``, a folder with ``config.json``, a Hub id) and no
  adapter: the plain model;
- ``model.name`` a PEFT adapter folder (``adapter_config.json`` without ``config.json``, e.g. a
  policygrad LoRA checkpoint's ``model/`` folder): the base model is the adapter's
  ``base_model_name_or_path`` (for a policygrad checkpoint the folder the run loaded, such as the
  bundled model's converted folder), the adapter is the folder;
- ``model.adapter`` an adapter folder: the adapter on top of ``model.name`` (which then overrides
  the adapter's ``base_model_name_or_path``).

The tokenizer is read from the adapter folder when it holds one (policygrad checkpoints do),
else from the base model.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from policygrad.models.loading import disable_dropout, load_causal_lm, resolve_model_path

__all__ = [
    "ADAPTER_CONFIG",
    "FrozenStart",
    "ModelSource",
    "describe_model",
    "is_adapter_folder",
    "is_peft_model",
    "load_model",
    "merged_model",
    "merged_weights",
    "tied_pairs_that_differ",
    "resolve_model_source",
]

ADAPTER_CONFIG = "adapter_config.json"
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class ModelSource:
    """Where a model's parts are read from.

    Attributes:
        base: the full model: a local folder (or a Hub id when hub access is on).
        adapter: a PEFT adapter folder on top of ``base``, or None.
        tokenizer: the folder (or Hub id) the tokenizer is read from.
    """

    base: str
    adapter: str | None
    tokenizer: str


def is_adapter_folder(path: str | os.PathLike) -> bool:
    """True when ``path`` is a folder holding ``adapter_config.json`` and no ``config.json``."""
    path = os.path.expanduser(os.fspath(path))
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG)) and not os.path.isfile(
        os.path.join(path, "config.json")
    )


def is_peft_model(model) -> bool:
    """True for a peft ``PeftModel`` (a model with adapters that ``get_base_model`` unwraps)."""
    return callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config")


def describe_model(model) -> str:
    """How a config records a loaded model (or peft model): its base model's folder
    (``name_or_path``), or ``<model CLASS (in memory)>`` when it has none."""
    base = model.get_base_model() if is_peft_model(model) else model
    folder = getattr(base, "name_or_path", "") or ""
    return folder or f"<model {type(base).__name__} (in memory)>"


def _adapter_base(adapter: str, field: str) -> str:
    with open(os.path.join(adapter, ADAPTER_CONFIG), encoding="utf-8") as f:
        try:
            base = json.load(f).get("base_model_name_or_path")
        except json.JSONDecodeError as e:
            raise ValueError(f"{field}: {adapter}/{ADAPTER_CONFIG} is not valid JSON ({e}); fix it") from None
    if not base:
        raise ValueError(
            f"{field}: {adapter}/{ADAPTER_CONFIG} names no base_model_name_or_path; set model.name to the "
            f"base model and model.adapter={adapter}"
        )
    return base


def resolve_model_source(name: str, adapter: str | None = None) -> ModelSource:
    """Resolve ``model.name`` / ``model.adapter`` (see the module docstring) to a :class:`ModelSource`.

    Raises:
        ValueError: ``adapter`` is not an adapter folder; ``name`` is an adapter folder and
            ``adapter`` is set too; an adapter's base model cannot be found (the message names
            the field and says to set ``model.name``); any error of
            :func:`~policygrad.models.loading.resolve_model_path`.
    """
    local = os.path.expanduser(os.fspath(name)).strip() if isinstance(name, (str, os.PathLike)) else name
    if isinstance(local, str) and os.path.isdir(local) and is_adapter_folder(local):
        if adapter:
            raise ValueError(
                f"model.name={name!r} is an adapter folder and model.adapter={adapter!r} is another; "
                "set model.name to the base model, or unset model.adapter"
            )
        base = _adapter_base(local, "model.name")
        try:
            base_path = resolve_model_path(base)
        except ValueError as e:
            raise ValueError(
                f"model.name={name!r} is an adapter whose base model {base!r} cannot be loaded ({e}); "
                f"set model.name to the base model folder and model.adapter={name}"
            ) from None
        return ModelSource(base_path, local, local if _has_tokenizer(local) else base_path)
    if adapter:  # checked before the base model is resolved: a bundled one is converted first
        adapter = os.path.expanduser(os.fspath(adapter))
        if not os.path.isfile(os.path.join(adapter, ADAPTER_CONFIG)):
            raise ValueError(
                f"model.adapter={adapter!r} has no {ADAPTER_CONFIG}; give a folder written by a PEFT "
                "model's save_pretrained (e.g. a LoRA run's checkpoints/step_N/model)"
            )
    base_path = resolve_model_path(name)
    if not adapter:
        return ModelSource(base_path, None, base_path)
    return ModelSource(base_path, adapter, adapter if _has_tokenizer(adapter) else base_path)


def _has_tokenizer(folder: str) -> bool:
    return any(os.path.isfile(os.path.join(folder, f)) for f in _TOKENIZER_FILES)


def load_model(
    source: ModelSource,
    *,
    dtype: str | torch.dtype = "float32",
    trainable: bool = True,
    trust_remote_code: bool = False,
):
    """The model of ``source``, dropout off (:func:`~policygrad.models.loading.load_causal_lm`);
    with an adapter, a ``peft.PeftModel`` whose adapter trains when ``trainable`` (its rank, alpha
    and targets are the adapter's own).

    Raises:
        ValueError / OSError: from transformers or peft when a folder holds no loadable model or
            adapter, or the adapter does not fit the base model.
    """
    model = load_causal_lm(source.base, dtype=dtype, trainable=trainable, trust_remote_code=trust_remote_code)
    if source.adapter is None:
        return model
    # peft loads only for a LoRA run
    from peft import PeftModel

    try:
        model = PeftModel.from_pretrained(model, source.adapter, is_trainable=trainable)
    except (RuntimeError, KeyError) as e:  # a shape or name mismatch between adapter and base
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"model.adapter {source.adapter!r} does not fit the base model {source.base!r} ({first}); "
            "give the base model the adapter was trained on as model.name"
        ) from None
    disable_dropout(model)  # the adapter's own lora_dropout
    model.train(trainable)
    return model


def _saved_module_prefixes(
    model: torch.nn.Module, modules_to_save_wrapper, trainable_tokens_wrapper
) -> dict[str, str]:
    """Whole modules an adapter trains (modules_to_save, e.g. lm_head): the copy the forward uses
    is exported under the module's own name, the frozen original and other adapters' copies not.

    Returns:
        state-dict prefix -> the prefix it is exported under ("" = skipped).
    """
    renamed: dict[str, str] = {}
    for module_name, module in model.named_modules():
        if trainable_tokens_wrapper and isinstance(module, trainable_tokens_wrapper):
            raise ValueError(
                f"{module_name} trains single token rows (trainable_token_indices), which cannot be "
                "merged into plain weights here; train the whole module with modules_to_save instead"
            )
        if modules_to_save_wrapper and isinstance(module, modules_to_save_wrapper):
            active = [a for a in module.active_adapters if a in module.modules_to_save]
            used = "original_module"
            if active and not module.disable_adapters:
                used = f"modules_to_save.{active[0]}"
            renamed[f"{module_name}.{used}."] = f"{module_name}."
            for other in ("original_module", *(f"modules_to_save.{a}" for a in module.modules_to_save)):
                renamed.setdefault(f"{module_name}.{other}.", "")  # skipped
    return renamed


def _lora_deltas(model: torch.nn.Module, lora_layer) -> dict[str, list]:
    """base-layer weight name -> ``[module, active adapters]`` of every unmerged, enabled LoRA layer."""
    deltas: dict[str, list] = {}
    for module_name, module in model.named_modules():
        if (
            lora_layer
            and isinstance(module, lora_layer)
            and not module.merged
            and not module.disable_adapters
        ):
            known = set(module.lora_A) | set(module.lora_embedding_A)
            adapters = [a for a in module.active_adapters if a in known]
            if any(getattr(module, "use_dora", {}).get(a, False) for a in adapters):
                raise ValueError(
                    f"{module_name} uses DoRA, whose merge is not W + delta; "
                    "use a LoRA model without use_dora, or merge the adapters first"
                )
            if adapters:
                deltas[f"{module_name}.base_layer.weight"] = [module, adapters]
    return deltas


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of ``model``'s weights in Hugging Face checkpoint naming.

    A peft LoRA model yields its base weights with every active adapter's delta added
    (``W + get_delta_weight(adapter)`` = ``W + (alpha / r) B A``, Hu et al. 2021, "LoRA", eq. 3;
    computed here, the model is not modified), under the base model's names
    (``base_model.model.`` and ``.base_layer`` removed); ``lora_*`` tensors are skipped. A module
    the adapter trains whole (peft's ``modules_to_save``, e.g. ``lm_head``) yields the copy its
    forward uses, under the module's own name. A plain model yields its ``state_dict``. Tensors
    are detached, in the model's dtype.

    Raises:
        ValueError: an adapter uses DoRA (its merge is not ``W + delta``) or trains single token
            rows (``trainable_token_indices``).
    """
    try:
        # peft loads only for a LoRA run
        from peft.tuners.lora import LoraLayer
        from peft.utils.other import ModulesToSaveWrapper, TrainableTokensWrapper
    except ImportError:  # peft absent: no LoRA layers or trained copies can exist
        LoraLayer = ModulesToSaveWrapper = TrainableTokensWrapper = ()  # noqa: N806
    renamed = _saved_module_prefixes(model, ModulesToSaveWrapper, TrainableTokensWrapper)
    deltas = _lora_deltas(model, LoraLayer)
    state = model.state_dict()
    for name, tensor in state.items():
        parts = name.split(".")
        if any(p.startswith("lora_") for p in parts):
            continue
        prefix = next((p for p in renamed if name.startswith(p)), None)
        if prefix is not None:
            if not renamed[prefix]:
                continue
            name = renamed[prefix] + name[len(prefix) :]
        tensor = tensor.detach()
        if name in deltas:
            module, adapters = deltas[name]
            for adapter in adapters:
                tensor = tensor + module.get_delta_weight(adapter).to(tensor.dtype)
        clean = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        yield clean, tensor


def tied_pairs_that_differ(model, state: dict[str, torch.Tensor]) -> list[tuple[str, str]]:
    """The weight pairs ``model``'s class ties (``_tied_weights_keys``, e.g. ``lm_head.weight`` ->
    ``model.embed_tokens.weight``) whose values in ``state`` (from :func:`merged_weights`)
    differ: an adapter trained one of them on its own (``modules_to_save``). A loader that ties
    them would drop the trained one.

    Args:
        model: a transformers model or a peft model around one.
    """
    base = model.get_base_model() if is_peft_model(model) else model
    config = getattr(base, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = getattr(base, "_tied_weights_keys", None)
    if not getattr(text, "tie_word_embeddings", False) or not isinstance(tied, dict):
        return []
    return [
        (a, b) for a, b in tied.items() if a in state and b in state and not torch.equal(state[a], state[b])
    ]


def merged_model(model):
    """A plain transformers model computing what ``model`` computes: ``model`` itself when it has
    no adapters, else its adapters merged in place (``merge_and_unload``; for a model that is only
    evaluated or exported)."""
    if not is_peft_model(model):
        return model
    return model.merge_and_unload()


class FrozenStart:
    """The starting values of a model's trainable parameters (a trained adapter the run starts
    from), kept frozen: :meth:`active` puts them in for the duration of a block, so the policy
    itself computes the reference, base plus the starting adapter, without a second copy of the
    base model. Memory: one copy of the trainable parameters.

    Args:
        model: the policy, before any update.
    """

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    @contextlib.contextmanager
    def active(self):
        """A block in which the model's trainable parameters hold their starting values (restored
        after, exactly)."""
        params = dict(self.model.named_parameters())
        current = {}
        with torch.no_grad():
            for name, start in self.start.items():
                current[name] = params[name].detach().clone()
                params[name].copy_(start)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for name, value in current.items():
                    params[name].copy_(value)
