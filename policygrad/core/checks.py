"""The input checks of ``policygrad.core``, in one place.

Every public function of ``core`` validates its arguments with these helpers, so the same
mistake gets the same message wherever it is made. Each message names the argument and says
what was expected; the tests assert these texts, so change them with care.

Conventions: a ``check_*`` function returns the (possibly converted) value or ``None`` and
raises ``TypeError`` for a value of the wrong type and ``ValueError`` for a value of the right
type that is out of range or of the wrong shape.
"""

from __future__ import annotations

import math
import numbers

import torch

__all__ = [
    "as_bool_mask",
    "check_2d",
    "check_chunk_size",
    "check_floating",
    "check_fraction",
    "check_group_index_dtype",
    "check_number",
    "check_real",
    "check_same_shape",
    "check_shape_of",
    "check_temperature",
    "check_tensor",
    "check_unit_interval",
]


def check_tensor(value: object, name: str) -> torch.Tensor:
    """Return ``value`` if it is a tensor.

    Raises:
        TypeError: ``value`` is not a ``torch.Tensor`` (names ``name``).
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_floating(value: torch.Tensor, name: str) -> None:
    """Raises ``TypeError`` unless ``value`` (a tensor) has a floating dtype."""
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {value.dtype}")


def check_2d(value: torch.Tensor, name: str) -> None:
    """Raises ``ValueError`` unless ``value`` (a tensor) is 2-D, the [B, T] layout."""
    if value.dim() != 2:
        raise ValueError(f"{name} must be 2-D [B, T], got shape {tuple(value.shape)}")


def check_same_shape(ref: torch.Tensor, ref_name: str, **others: torch.Tensor | None) -> None:
    """Check that every keyword tensor has ``ref``'s shape; a ``None`` (an optional argument
    left out) is skipped.

    Raises:
        TypeError: an argument is neither a tensor nor None (names it).
        ValueError: a shape differs from ``ref``'s (names the argument and both shapes).
    """
    for name, value in others.items():
        if value is None:
            continue
        check_tensor(value, name)
        if value.shape != ref.shape:
            raise ValueError(
                f"{name} must have the same shape as {ref_name} {tuple(ref.shape)}, got {tuple(value.shape)}"
            )


def check_shape_of(value: torch.Tensor, name: str, ref: torch.Tensor, ref_name: str) -> None:
    """Raises ``ValueError`` unless ``value`` (a tensor) has the shape of ``ref``."""
    if value.shape != ref.shape:
        raise ValueError(
            f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, got {tuple(value.shape)}"
        )


def as_bool_mask(x: torch.Tensor, mask: object, x_name: str = "x", mask_name: str = "mask") -> torch.Tensor:
    """Validate ``mask`` against ``x`` and return it as a bool tensor on ``x``'s device.

    Args:
        x: the tensor the mask applies to, any shape.
        mask: same shape as ``x``; bool, integer or floating, nonzero = valid.
        x_name, mask_name: the argument names used in error messages.

    Returns:
        bool tensor of ``x``'s shape on ``x``'s device (``mask`` itself when it already is one).

    Raises:
        TypeError: ``mask`` is not a tensor.
        ValueError: ``mask`` does not have ``x``'s shape.
    """
    mask = check_tensor(mask, mask_name)
    if mask.shape != x.shape:
        raise ValueError(
            f"{mask_name} must have the same shape as {x_name}: got {mask_name} {tuple(mask.shape)} "
            f"and {x_name} {tuple(x.shape)}"
        )
    if mask.dtype == torch.bool:
        return mask.to(x.device)
    return (mask != 0).to(x.device)


def check_group_index_dtype(group_index: torch.Tensor) -> None:
    """Raises ``TypeError`` unless ``group_index`` (a tensor of prompt ids) has an integer dtype."""
    if group_index.is_floating_point() or group_index.is_complex() or group_index.dtype == torch.bool:
        raise TypeError(f"group_index must be an integer tensor (torch.long), got dtype {group_index.dtype}")


def check_number(value: object, name: str, *, or_none: bool = False) -> float:
    """A real Python number (bool excluded) as a float; no range check.

    Args:
        value: the value to check (not None: callers handle an optional None themselves).
        name: the argument's name.
        or_none: the argument may also be None; only the message says so.

    Raises:
        TypeError: not a real number.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        alternative = " or None" if or_none else ""
        raise TypeError(f"{name} must be a number{alternative}, got {type(value).__name__}")
    return float(value)


def check_real(value: object, name: str) -> float:
    """A finite real number (a Python number or a 1-element tensor) as a float.

    Raises:
        TypeError: not a number (bool is not a number here).
        ValueError: a tensor with more than one element; not finite.
    """
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a scalar, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    value = check_number(value, name)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_fraction(value: object, name: str, *, allow_none: bool, upper: float | None = None) -> float | None:
    """A finite number >= 0 (and <= ``upper`` when given) as a float; None passes if allowed.

    Used for clip ranges: ``1 - clip_low`` and ``1 + clip_high`` bound the importance ratio.

    Raises:
        TypeError: not a number; None when ``allow_none`` is False.
        ValueError: negative, not finite, or above ``upper``.
    """
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must be a number, got None")
    value = check_number(value, name)
    if not math.isfinite(value) or value < 0 or (upper is not None and value > upper):
        bound = f"[0, {upper}]" if upper is not None else ">= 0"
        raise ValueError(f"{name} must be a finite number in {bound}, got {value}")
    return value


def check_unit_interval(value: object, name: str, owner: str) -> float:
    """A number in [0, 1] (a discount or a lambda) as a float.

    Args:
        value: the value to check.
        name: the option's name.
        owner: what the option belongs to (an estimator's name), the message's prefix.

    Raises:
        ValueError: not a number (bool included) or outside [0, 1].
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"{owner}: {name} must be a number in [0, 1], got {value!r}")
    return float(value)


def check_temperature(temperature: object) -> float:
    """A sampling temperature: a finite number > 0, as a float.

    Raises:
        TypeError: not a number.
        ValueError: not finite or <= 0.
    """
    temperature = check_number(temperature, "temperature")
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(
            f"temperature must be a finite number > 0 (the sampling temperature), got {temperature}"
        )
    return temperature


def check_chunk_size(chunk_size: object, default: int) -> int:
    """Rows per block of a blockwise kernel: ``default`` when None, else a positive int.

    Raises:
        ValueError: not a positive int (bool excluded).
    """
    if chunk_size is None:
        return int(default)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (rows per block), got {chunk_size!r}")
    return int(chunk_size)
