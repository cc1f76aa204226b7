"""Generation engines that sample responses and return a :class:`Rollout` batch."""

from policygrad.rollout.base import Rollout, RolloutEngine
from policygrad.rollout.hf import HFRolloutEngine

__all__ = ["HFRolloutEngine", "Rollout", "RolloutEngine"]
