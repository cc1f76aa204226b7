"""Tests of policygrad.specs.kl: the KL kinds and the placements' declarations, without torch."""

from __future__ import annotations

import pytest

from policygrad.specs.kl import KL_KINDS, KL_PLACEMENTS, KLPlacementSpec, check_kl_kind, kl_placement_spec

pytestmark = pytest.mark.unit


def test_the_kinds_and_placements():
    assert KL_KINDS == ("k1", "k2", "k3")
    assert KL_PLACEMENTS == ("none", "reward", "loss")
    # k1 in the reward (Ziegler et al. 2019), k3 in the loss (Shao et al. 2024, eq. 4)
    assert kl_placement_spec("none") == KLPlacementSpec("none", False, False, "k1")
    assert kl_placement_spec("reward") == KLPlacementSpec("reward", True, True, "k1")
    assert kl_placement_spec("loss") == KLPlacementSpec("loss", True, False, "k3")


def test_unknown_names_get_the_registry_messages():
    with pytest.raises(ValueError) as info:
        kl_placement_spec("both")
    assert str(info.value) == "unknown KL placement 'both'; valid placements: none, reward, loss"
    with pytest.raises(ValueError, match="unknown KL placement None"):
        kl_placement_spec(None)
    check_kl_kind("k2")
    with pytest.raises(ValueError) as info:
        check_kl_kind("k4")
    assert str(info.value) == "unknown KL kind 'k4'; valid kinds: k1, k2, k3"
