"""KL coefficient controllers: a fixed beta, and the adaptive controller of Ziegler et al. 2019.

The trainer holds one and feeds it the measured KL of each step (``update``); both save and
restore their state for a resume (``state_dict`` / ``load_state_dict``).
"""

from __future__ import annotations

import numbers
from typing import Any

from .checks import check_real

__all__ = ["AdaptiveKLController", "FixedKLController"]


class FixedKLController:
    """Constant KL coefficient beta (InstructGPT, Ouyang et al. 2022, beta = 0.02).

    Same interface as :class:`AdaptiveKLController` so the trainer can hold either.

    Args:
        beta: KL coefficient, finite and >= 0.

    Raises:
        TypeError: ``beta`` not a number. ValueError: ``beta`` < 0 or not finite.
    """

    def __init__(self, beta: float) -> None:
        beta = check_real(beta, "beta")
        if beta < 0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        self.value = beta

    def update(self, current_kl: float, n_steps: int) -> float:
        """Ignore the measurement (the coefficient is fixed); validate it and return ``.value``.

        Raises:
            TypeError/ValueError: ``current_kl`` not a finite number, ``n_steps`` not an int >= 0.
        """
        check_real(current_kl, "current_kl")
        _check_n_steps(n_steps)
        return self.value

    def state_dict(self) -> dict[str, Any]:
        """``{"value": beta}``."""
        return {"value": self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``.value`` from :meth:`state_dict`'s output.

        Raises:
            ValueError: the ``value`` key is missing or invalid.
        """
        value = _state_value(state_dict, "value")
        if value < 0:
            raise ValueError(f"state_dict['value'] must be >= 0, got {value}")
        self.value = value

    def __repr__(self) -> str:
        return f"FixedKLController(beta={self.value})"


def _check_n_steps(n_steps: object) -> int:
    if isinstance(n_steps, bool) or not isinstance(n_steps, numbers.Integral):
        raise TypeError(f"n_steps must be an int (samples or steps since the last update), got {n_steps!r}")
    if n_steps < 0:
        raise ValueError(f"n_steps must be >= 0, got {n_steps}")
    return int(n_steps)


def _state_value(state_dict: object, key: str) -> float:
    if not isinstance(state_dict, dict):
        raise TypeError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    if key not in state_dict:
        raise ValueError(f"state_dict is missing the key {key!r} (keys present: {sorted(state_dict)})")
    return check_real(state_dict[key], f"state_dict[{key!r}]")


class AdaptiveKLController:
    """Proportional controller of the KL coefficient (Ziegler et al. 2019, section 2.2).

    After a batch with measured KL ``current_kl`` covering ``n_steps`` steps (samples):

        e = clip(current_kl / target - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n_steps / horizon)

    so beta grows when the KL is above target and shrinks below it, by at most 20% per
    ``horizon`` steps (Ziegler et al. 2019, section 2.2, eq. 2; ``n_steps / horizon`` plays the
    role of K_beta).

    Args:
        init_beta: initial coefficient, finite and >= 0.
        target: target KL (nats, in the units of ``current_kl``), > 0.
        horizon: steps over which the full +-20% correction applies, > 0.

    Raises:
        TypeError: an argument is not a number. ValueError: ``init_beta`` < 0, ``target`` <= 0,
        ``horizon`` <= 0, or a non-finite value.
    """

    def __init__(self, init_beta: float, target: float, horizon: float) -> None:
        init_beta = check_real(init_beta, "init_beta")
        target = check_real(target, "target")
        horizon = check_real(horizon, "horizon")
        if init_beta < 0:
            raise ValueError(f"init_beta must be >= 0, got {init_beta}")
        if target <= 0:
            raise ValueError(f"target must be > 0 (the target KL), got {target}")
        if horizon <= 0:
            raise ValueError(f"horizon must be > 0, got {horizon}")
        self.value = init_beta
        self.target = target
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> float:
        """Apply one controller step and return the new ``.value``.

        Args:
            current_kl: measured KL of the last batch (float or 1-element tensor), finite.
            n_steps: steps (samples) the measurement covers, int >= 0.

        Raises:
            TypeError/ValueError: ``current_kl`` not a finite number; ``n_steps`` not an int >= 0.
        """
        current_kl = check_real(current_kl, "current_kl")
        n_steps = _check_n_steps(n_steps)
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, Any]:
        """``{"value", "target", "horizon"}``: everything needed to resume."""
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``.value``, ``.target`` and ``.horizon`` from :meth:`state_dict`'s output.

        Raises:
            ValueError: a key is missing or holds an invalid value.
        """
        value = _state_value(state_dict, "value")
        target = _state_value(state_dict, "target")
        horizon = _state_value(state_dict, "horizon")
        if value < 0 or target <= 0 or horizon <= 0:
            raise ValueError(
                "invalid state_dict: need value >= 0, target > 0, horizon > 0; "
                f"got {value}, {target}, {horizon}"
            )
        self.value, self.target, self.horizon = value, target, horizon

    def __repr__(self) -> str:
        return f"AdaptiveKLController(value={self.value}, target={self.target}, horizon={self.horizon})"
