"""The samplers return what the engine and the episode runner made, in one record."""

from __future__ import annotations

import pytest

from policygrad.rollout.base import SamplingParams
from policygrad.rollout.samplers import EpisodeSampler, Samples, SingleTurnSampler, engine_sampling

pytestmark = pytest.mark.unit


class _Engine:
    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, **kwargs):
        self.calls.append((prompt_ids, kwargs))
        return "rollout"


def test_single_turn_passes_per_prompt_seeds_or_the_generator_seed(monkeypatch):
    import policygrad.rollout.samplers as samplers

    monkeypatch.setattr(samplers, "encode_prompts", lambda _tok, rows, _data: [[1, 2]] * len(rows))
    monkeypatch.setattr(samplers, "decode_completions", lambda _tok, _rollout: ["a", "b"])
    engine = _Engine()
    params = SamplingParams(temperature=0.7, top_k=5)
    out = SingleTurnSampler(engine, None, None, max_new_tokens=6).sample(
        [{"prompt": "x"}], group_size=2, params=params, seeds=[11], generator_seed=3
    )
    assert out == Samples([[1, 2]], "rollout", ["a", "b"]) and out.fields == {}
    kwargs = engine.calls[0][1]
    assert kwargs["prompt_seeds"] == [11] and kwargs["generator_seed"] is None
    assert (kwargs["temperature"], kwargs["top_k"], kwargs["top_p"], kwargs["group_size"]) == (
        0.7,
        5,
        None,
        2,
    )
    SingleTurnSampler(engine, None, None, max_new_tokens=6, per_prompt_seeds=False).sample(
        [{"prompt": "x"}], group_size=2, params=params, seeds=[11], generator_seed=3
    )
    assert engine.calls[1][1]["prompt_seeds"] is None and engine.calls[1][1]["generator_seed"] == 3


def test_episode_sampler_hands_the_runner_its_sampling():
    class Runner:
        def run(self, _rows, **kwargs):
            self.kwargs = kwargs
            return [[1]], "rollout", None, ["final"]

    runner = Runner()
    out = EpisodeSampler(runner, per_prompt_seeds=False).sample(
        [{"prompt": "x"}], group_size=1, params=SamplingParams(greedy=True), seeds=[5]
    )
    assert out.completions == ["final"] and out.rollout == "rollout"
    assert runner.kwargs == {
        "group_size": 1,
        "seeds": [5],
        "per_prompt_seeds": False,
        "sampling": {"greedy": True, "temperature": 1.0},
    }
    assert engine_sampling(SamplingParams(temperature=2.0, top_p=0.5)) == {
        "temperature": 2.0,
        "top_p": 0.5,
        "top_k": None,
    }
