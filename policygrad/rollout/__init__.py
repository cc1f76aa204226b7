"""Generation engines that sample responses and return a :class:`Rollout` batch."""

from policygrad.rollout.base import Rollout, SamplingParams
from policygrad.rollout.engine import RolloutEngine
from policygrad.rollout.hf import HFRolloutEngine
from policygrad.rollout.vllm import VLLMRolloutEngine, vllm_available

__all__ = [
    "HFRolloutEngine",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "VLLMRolloutEngine",
    "vllm_available",
]
