"""KL kinds and placements as the config sees them, without torch.

A placement says where the KL to the reference policy enters the objective: nowhere, in the
reward (PPO-RLHF: Ziegler et al. 2019; Ouyang et al. 2022) or in the loss (GRPO: Shao et al.
2024, eq. 3-4). Each is declared here with what the config and the trainer read without running
it; :mod:`policygrad.core.kl` implements each name (its rewards and loss term).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KL_KINDS", "KL_PLACEMENTS", "KLPlacementSpec", "check_kl_kind", "kl_placement_spec"]

KL_KINDS: tuple[str, ...] = ("k1", "k2", "k3")
"""Valid ``kind`` values of the KL estimators (Schulman 2020, "Approximating KL divergence")."""


def check_kl_kind(kind: object) -> None:
    """Raise ``ValueError`` unless ``kind`` is one of :data:`KL_KINDS`."""
    if kind not in KL_KINDS:
        raise ValueError(f"unknown KL kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")


@dataclass(frozen=True)
class KLPlacementSpec:
    """What a KL placement declares.

    Fields:
        name: the registry key (``kl.placement`` in the config).
        needs_reference: the placement reads ``ref_logprobs`` (a reference model is needed).
        shapes_rewards: the per-token rewards read the behaviour log-probs (a KL penalty in the
            reward), so those must be the trainer's own log-probs of the sampled tokens.
        default_kind: the estimator used when the config leaves ``kl.kind`` unset (k1 in the
            reward, Ziegler et al. 2019; k3 in the loss, Shao et al. 2024, eq. 4).
    """

    name: str
    needs_reference: bool
    shapes_rewards: bool
    default_kind: str


_PLACEMENTS: dict[str, KLPlacementSpec] = {
    spec.name: spec
    for spec in (
        KLPlacementSpec("none", needs_reference=False, shapes_rewards=False, default_kind="k1"),
        KLPlacementSpec("reward", needs_reference=True, shapes_rewards=True, default_kind="k1"),
        KLPlacementSpec("loss", needs_reference=True, shapes_rewards=False, default_kind="k3"),
    )
}

KL_PLACEMENTS: tuple[str, ...] = tuple(_PLACEMENTS)
"""Names of the registered KL placements (valid ``kl.placement`` values)."""


def kl_placement_spec(name: str) -> KLPlacementSpec:
    """The declaration of the KL placement called ``name``.

    Raises:
        ValueError: unknown name (the message lists :data:`KL_PLACEMENTS`).
    """
    try:
        return _PLACEMENTS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown KL placement {name!r}; valid placements: {', '.join(KL_PLACEMENTS)}"
        ) from None
