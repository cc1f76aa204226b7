"""The producer: built from its own parts, it cannot reach the policy's parameters, the optimizer
or the trainer; it samples each prompt from its own seed through one ``sampler.sample`` call
whatever the sampler, and a sampler without per-prompt seeds draws from a scope of the step's seed."""

from __future__ import annotations

import functools
import types

import pytest
import torch

from policygrad.produce.producer import DynamicSampling, Producer
from policygrad.produce.stages import ProducerParts
from policygrad.rewards.registry import RewardOutput
from policygrad.rollout.base import Rollout, SamplingParams
from policygrad.rollout.samplers import Samples
from policygrad.run import Run
from policygrad.seeds import Seeds

_LEAVES = (str, bytes, int, float, bool, complex, type(None), types.ModuleType, type)
_LEAVES += (torch.dtype, torch.device)


def _reachable(root, limit: int = 2_000_000):
    """``(object, path)`` for every object reachable from ``root`` through attributes, dict
    entries, sequence items, bound methods' ``__self__``, closures and partials (each once;
    tensors and leaves are reached but not entered)."""
    seen, stack, count = set(), [(root, "producer")], 0
    while stack:
        obj, path = stack.pop()
        if id(obj) in seen or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        count += 1
        assert count < limit, "the walk did not end"
        yield obj, path
        if isinstance(obj, torch.Tensor):
            continue
        children = []
        if isinstance(obj, dict):
            children = [(v, f"{path}[{k!r}]") for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            children = [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        elif isinstance(obj, types.MethodType):
            children = [(obj.__self__, f"{path}.__self__")]
        elif isinstance(obj, functools.partial):
            children = [(obj.func, f"{path}.func"), (obj.args, f"{path}.args"), (obj.keywords, f"{path}.kw")]
        elif isinstance(obj, types.FunctionType):
            children = [(c.cell_contents, f"{path}.<closure>") for c in obj.__closure__ or ()]
        if hasattr(obj, "__dict__") and not isinstance(obj, types.FunctionType):
            children += [(v, f"{path}.{k}") for k, v in vars(obj).items()]
        for slot in getattr(type(obj), "__slots__", ()):
            if isinstance(slot, str) and hasattr(obj, slot):
                children.append((getattr(obj, slot), f"{path}.{slot}"))
        stack.extend(children)


def _policy_paths(run):
    t = run.trainer
    params = {id(p) for p in t.policy.parameters()}
    found = {"params": [], "optimizer": [], "trainer": [], "policy_step": []}
    for obj, path in _reachable(t.producer):
        if id(obj) in params:
            found["params"].append(path)
        if obj is t.optimizer:
            found["optimizer"].append(path)
        if obj is t:
            found["trainer"].append(path)
        if obj is t.policy_step:
            found["policy_step"].append(path)
    return found


@pytest.mark.integration
def test_the_producer_cannot_reach_the_policy_parameters_the_optimizer_or_the_trainer(make_config):
    # Sampled ahead (k = 1): the hf engine samples from a copy of the weights, synced after each
    # update: nothing the producer holds leads to a trained parameter, the optimizer or the trainer.
    ahead = Run(make_config("ahead", rollout={"max_staleness": 1}))
    try:
        assert not hasattr(ahead.trainer.producer, "trainer")
        found = _policy_paths(ahead)
        assert found == {"params": [], "optimizer": [], "trainer": [], "policy_step": []}, found
    finally:
        ahead.close()
    # Synchronous with the hf engine on the live policy: the weights are reachable only as the
    # engine's model (sampling reads them); still no optimizer, update step or trainer.
    sync = Run(make_config("sync"))
    try:
        found = _policy_paths(sync)
        assert found["params"] and all(".engine.model" in p for p in found["params"])
        assert found["optimizer"] == found["trainer"] == found["policy_step"] == []
    finally:
        sync.close()


class _Stream:
    def __init__(self, rows):
        self.rows, self.position = rows, 0

    def take(self, n):
        out = [self.rows[(self.position + i) % len(self.rows)] for i in range(n)]
        self.position += n
        return out


class _Sampler:
    """G samples of each row: row i's k-th sample scores ``row["scores"][k]``; records each call.
    Draws one number from torch's stream per call (what an engine without per-prompt seeds does)."""

    def __init__(self):
        self.calls = []

    def sample(self, rows, *, group_size, params, seeds, generator_seed=None):  # noqa: ARG002
        draw = torch.rand(()).item()
        prompts = [r["prompt"] for r in rows]
        self.calls.append({"rows": prompts, "seeds": list(seeds), "params": params, "draw": draw})
        B = len(rows) * group_size
        rollout = Rollout(
            prompt_ids=torch.ones(B, 1, dtype=torch.long),
            prompt_mask=torch.ones(B, 1, dtype=torch.long),
            response_ids=torch.ones(B, 2, dtype=torch.long),
            response_mask=torch.ones(B, 2),
            truncated=torch.zeros(B, dtype=torch.bool),
            sampler_logprobs=torch.zeros(B, 2),
            group_index=torch.arange(len(rows)).repeat_interleave(group_size),
            group_size=group_size,
            sampling=params,
        )
        completions = [str(s) for r in rows for s in r["scores"][:group_size]]
        return Samples([[1]] * len(rows), rollout, completions)


def _score(rows, completions, *, repeat, fields):  # noqa: ARG001 - the raw scorer's signature
    values = torch.tensor([float(c) for c in completions])
    return RewardOutput(values, {"outcome": values}, torch.ones(len(values), dtype=torch.bool))


def _producer(rows, *, per_prompt_seeds=True, dynamic=None, share=None):
    sampler = _Sampler()
    parts = ProducerParts(
        engine=None,
        tokenizer=None,
        score=_score,
        seeds=Seeds(7),
        params=SamplingParams(temperature=0.7),
        max_new_tokens=2,
        ignore_eos=False,
        per_prompt_seeds=per_prompt_seeds,
        options={},
    )
    producer = Producer(
        sampler,
        parts,
        stream=_Stream(rows),
        group_size=2,
        prompts_per_step=2,
        share=share or (lambda n: slice(0, n)),
        inputs={},
        dynamic=dynamic,
    )
    return producer, sampler


@pytest.mark.unit
def test_each_prompt_samples_from_its_own_seed_and_dynamic_rounds_refill():
    # Rows a, b have no signal (both samples score the same), c, d have: round 0 (a, b) keeps
    # nothing, round 1 (c, d) keeps both; each round's prompt i samples from its own seed,
    # Seeds.prompts(step, round)[i].
    scores = {"a": [1, 1], "b": [0, 0], "c": [0, 1], "d": [1, 0]}
    rows = [{"prompt": p, "scores": s} for p, s in scores.items()]
    producer, sampler = _producer(rows, dynamic=DynamicSampling("outcome", max_extra_rounds=2))
    prod = producer.produce(3, 2)
    assert (prod.step, prod.version, prod.kept) == (3, 2, [[], [0, 1]])
    assert [c["rows"] for c in sampler.calls] == [["a", "b"], ["c", "d"]]
    assert [c["seeds"] for c in sampler.calls] == [Seeds(7).prompts(3, 0, 2), Seeds(7).prompts(3, 1, 2)]
    assert sampler.calls[0]["params"] == SamplingParams(temperature=0.7)
    assert producer.stream.position == 4
    # A rank's share: the second of two ranks samples the second prompt, with that prompt's seed.
    second, sampler = _producer(rows, share=lambda n: slice(n // 2, n))
    second.produce(3, 3)
    assert sampler.calls[0]["rows"] == ["b"] and sampler.calls[0]["seeds"] == Seeds(7).prompts(3, 0, 2)[1:]


@pytest.mark.unit
def test_without_per_prompt_seeds_the_draws_come_from_the_step_seed_in_a_scope_of_their_own():
    rows = [{"prompt": "a", "scores": [0, 1]}, {"prompt": "b", "scores": [1, 0]}]
    producer, sampler = _producer(rows, per_prompt_seeds=False)
    torch.manual_seed(123)
    outside = torch.get_rng_state()
    producer.produce(5, 5)
    producer.produce(5, 5)
    assert torch.equal(torch.get_rng_state(), outside)  # the caller's stream is untouched
    torch.manual_seed(Seeds(7).step(5))
    expected = torch.rand(()).item()  # what the step's seed, set at the top of the step, drew first
    assert [c["draw"] for c in sampler.calls] == [expected, expected]
    # With per-prompt seeds the producer leaves torch's stream alone: the sampler draws from it.
    producer, sampler = _producer(rows)
    torch.manual_seed(123)
    producer.produce(5, 5)
    assert sampler.calls[0]["draw"] == torch.rand((), generator=torch.Generator().manual_seed(123)).item()
