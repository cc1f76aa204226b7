"""One evaluation for single-turn answers and episodes: greedy accuracy, pass@k and maj@k by hand
on a fake engine whose completions are fixed; multi-turn episodes' success, turns, stop reasons
and pass@k counted again from their records (a scripted environment on the tiny model); the
seeds each sampler call is given, whatever the batching."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from policygrad.config.train import DataConfig, RolloutConfig, TrainConfig
from policygrad.envs import Environment, StepResult
from policygrad.envs.base import STOP_REASONS
from policygrad.envs.episodes import EpisodeLimits, EpisodeRunner
from policygrad.evaluate.evaluation import eval_sampler, evaluate
from policygrad.evaluate.scoring import pass_at_k
from policygrad.rollout.base import Rollout, prompt_seed
from policygrad.rollout.hf import HFRolloutEngine
from policygrad.rollout.samplers import EpisodeSampler, Samples, SingleTurnSampler
from tests.tiny import PAD_ID, make_tiny_tokenizer
from tests.training import MANY_EOS


class FixedEngine:
    """Returns, for each prompt, the next G completions of a fixed list (greedy: the first)."""

    shares_policy_weights = True

    def __init__(self, tokenizer, greedy: list[str], sampled: list[list[str]]):
        self.tokenizer, self.greedy, self.sampled = tokenizer, greedy, sampled
        self.calls = []

    def generate(self, prompt_ids, *, group_size, greedy=False, **_):
        self.calls.append((len(prompt_ids), group_size, greedy))
        texts = self.greedy if greedy else [t for row in self.sampled for t in row]
        ids = [self.tokenizer.encode(t) + [2] for t in texts]
        width = max(map(len, ids))
        response = torch.tensor([i + [0] * (width - len(i)) for i in ids])
        mask = (torch.arange(width)[None] < torch.tensor([len(i) for i in ids])[:, None]).float()
        n = len(texts)
        return Rollout(
            prompt_ids=torch.ones(n, 1, dtype=torch.long),
            prompt_mask=torch.ones(n, 1, dtype=torch.long),
            response_ids=response,
            response_mask=mask,
            sampler_logprobs=torch.zeros(n, width),
            truncated=torch.zeros(n, dtype=torch.bool),
            group_index=torch.arange(n) // group_size,
        )


@pytest.mark.unit
def test_evaluate_reports_greedy_accuracy_pass_at_k_and_maj_at_k_in_one_call_each():
    tok = make_tiny_tokenizer()
    rows = [{"prompt": "1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": "4"}]
    sampled = [["#### 2", "#### 3", "#### 3", "#### 2"], ["#### 4", "#### 1", "#### 9", "#### 8"]]
    engine = FixedEngine(tok, ["#### 2", "#### 5"], sampled)
    sampler = SingleTurnSampler(engine, tok, DataConfig(use_chat_template=False), max_new_tokens=8)
    metrics, records = evaluate(sampler, rows, samples=4, ks=[1, 2, 4])
    assert engine.calls == [(2, 1, True), (2, 4, False)]  # every problem in one generate call
    assert metrics["accuracy"] == 0.5
    assert metrics["pass@1"] == pytest.approx((2 / 4 + 1 / 4) / 2)
    assert metrics["pass@2"] == pytest.approx((pass_at_k(4, 2, 2) + pass_at_k(4, 1, 2)) / 2)
    assert metrics["pass@4"] == 1.0
    # maj@4: row 0 ties 2 vs 3 -> "2" seen first, right; row 1: all differ -> "4" first, right.
    assert metrics["maj@4"] == 1.0
    # maj@2: row 0 blocks ["2","3"] -> 2 right, ["3","2"] -> 3 wrong; row 1 ["4","1"] right, ["9","8"] wrong.
    assert metrics["maj@2"] == 0.5
    assert [s["answer"] for s in records[0]["samples"]] == ["2", "3", "3", "2"]
    with pytest.raises(ValueError, match="each k must be in 1 .. --samples 4"):
        evaluate(sampler, rows, samples=4, ks=[5])


class FindChar(Environment):
    """Answers every turn with "Again."; done (final reward 1) on the first turn holding ``char``.
    ``policygrad eval --env tests.evaluate.test_evaluation:FindChar`` loads it by name."""

    def __init__(self, char: str = "v"):
        if not isinstance(char, str) or len(char) != 1:
            raise ValueError(f"char must be one character, got {char!r}")
        self.char = char
        self.found = False

    def reset(self, row, *, seed):  # noqa: ARG002 - the protocol's argument
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):
        self.found = self.char in action
        again = [{"role": "user", "content": "Again."}]
        return StepResult(again, done=self.found, info={"hit": float(self.found)})

    def final_reward(self, stop_reason):  # noqa: ARG002 - the protocol's argument
        return 1.0 if self.found else 0.0


class FailsOnBad(FindChar):
    """FindChar whose ``step()`` raises on rows whose prompt holds "bad" (``policygrad eval --env
    tests.evaluate.test_evaluation:FailsOnBad``: an environment that fails on some or every row)."""

    def reset(self, row, *, seed):
        self.bad = "bad" in row["prompt"]
        return super().reset(row, seed=seed)

    def step(self, action):
        if self.bad:
            raise RuntimeError("this row breaks the environment")
        return super().step(action)


class ChdirOnStep(FindChar):
    """FindChar whose ``step()`` changes the working directory to ``to`` (code that moves the
    process during an evaluation)."""

    def __init__(self, to: str = "/"):
        super().__init__()
        self.to = to

    def step(self, action):
        import os

        os.chdir(self.to)
        return super().step(action)


@pytest.mark.integration
def test_evaluate_episodes_counts_agree_with_the_records(eos_model_dir):
    tok = AutoTokenizer.from_pretrained(eos_model_dir)
    model = AutoModelForCausalLM.from_pretrained(eos_model_dir)
    engine = HFRolloutEngine(model, tok, MANY_EOS)
    limits = EpisodeLimits(max_turns=3, max_new_tokens=6, workers=1)
    runner = EpisodeRunner(lambda: FindChar(char="v"), engine, tok, limits, end_ids=MANY_EOS, pad_id=PAD_ID)
    rows = [{"prompt": f"Say something about {i}.", "answer": str(i)} for i in range(6)]
    n, ks = 4, [1, 2, 4]

    sampler = EpisodeSampler(runner)
    metrics, records = evaluate(sampler, rows, samples=n, ks=ks, temperature=1.0, seed=3)
    assert metrics["n"] == len(records) == 6
    assert [r["prompt"] for r in records] == [row["prompt"] for row in rows]
    # Every episode's numbers, counted again from its transcript.
    for rec in [*records, *(s for r in records for s in r["samples"])]:
        actions = [m["content"] for m in rec["transcript"] if m["role"] == "assistant"]
        assert rec["turns"] == len(actions) and rec["final_answer"] == actions[-1]
        assert rec["success"] == ("v" in actions[-1]) == (rec["final_reward"] == 1.0)
        assert not any("v" in a for a in actions[:-1])  # the first hit ends the episode
        assert rec["stop_reason"] in STOP_REASONS and not rec["failed"] and rec["error"] is None
        if rec["success"]:  # done, or a turn cut at max_new_tokens that holds the character
            assert rec["stop_reason"] in ("done", "length")
        elif rec["stop_reason"] == "max_turns":
            assert rec["turns"] == 3
        assert rec["info"]["hit"] == pytest.approx(float(rec["success"]) / rec["turns"])
        assert len(rec["samples"]) == n if rec in records else "samples" not in rec
    # The summary of the greedy episodes, counted by hand.
    stops = {s: sum(r["stop_reason"] == s for r in records) / 6 for s in STOP_REASONS}
    assert sum(metrics[f"stop_{s}"] for s in STOP_REASONS) == pytest.approx(1.0)
    assert all(metrics[f"stop_{s}"] == pytest.approx(stops[s]) for s in STOP_REASONS)
    assert metrics["success"] == pytest.approx(sum(r["success"] for r in records) / 6)
    assert metrics["final_reward_mean"] == pytest.approx(metrics["success"])
    assert metrics["turns_mean"] == pytest.approx(sum(r["turns"] for r in records) / 6)
    won = [r["turns"] for r in records if r["success"]]
    assert won, "the scripted episodes include a success"
    assert metrics["turns_to_success"] == pytest.approx(sum(won) / len(won))
    assert metrics["failed_frac"] == 0.0
    assert metrics["env/hit"] == pytest.approx(sum(r["info"]["hit"] for r in records) / 6)
    for k in ks:
        counted = [sum(s["success"] for s in r["samples"]) for r in records]
        assert metrics[f"pass@{k}"] == pytest.approx(sum(pass_at_k(n, c, k) for c in counted) / 6)
    sampled = [s["success"] for r in records for s in r["samples"]]
    assert 0 < sum(sampled) < len(sampled), "the scripted task should be neither always nor never solved"
    # Greedy episodes are deterministic; sampled ones depend on the seed only.
    again, _ = evaluate(sampler, rows, samples=n, ks=ks, temperature=1.0, seed=3)
    assert again == metrics
    with pytest.raises(ValueError, match="each k must be in 1 .. --samples 4"):
        evaluate(sampler, rows, samples=n, ks=[5])


class _Recorder:
    """A sampler that records each call's rows, seeds and sampling, and returns one completion per sample."""

    def __init__(self):
        self.calls = []

    def sample(self, rows, *, group_size, params, seeds, generator_seed=None):
        self.calls.append(([r["prompt"] for r in rows], list(seeds), generator_seed, params.greedy))
        texts = [f"#### {r['answer']}" for r in rows for _ in range(group_size)]
        return Samples([[0]] * len(rows), None, texts)


@pytest.mark.unit
def test_each_call_is_seeded_by_where_its_rows_are_not_by_the_batching():
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(5)]
    sampler = _Recorder()
    metrics, records = evaluate(sampler, rows, seed=7, samples=2, ks=[2], batch_size=2)
    seeds = [prompt_seed(7, i) for i in range(5)]  # row i's seed, whichever call it is in
    assert sampler.calls == [
        (["p0", "p1"], seeds[0:2], None, True),  # greedy: no sampling seed
        (["p2", "p3"], seeds[2:4], None, True),
        (["p4"], seeds[4:5], None, True),
        # sampled: 7 * 1_000_003 + the call's first row
        (["p0", "p1"], seeds[0:2], 7_000_021, False),
        (["p2", "p3"], seeds[2:4], 7_000_023, False),
        (["p4"], seeds[4:5], 7_000_025, False),
    ]
    assert metrics == {"accuracy": 1.0, "pass@2": 1.0, "maj@2": 1.0}
    assert [len(r["samples"]) for r in records] == [2] * 5
    one_call = _Recorder()
    assert evaluate(one_call, rows, seed=7, samples=2, ks=[2])[1] == records  # batching changes nothing
    assert [c[2] for c in one_call.calls] == [None, 7_000_021]


@pytest.mark.unit
def test_the_evaluation_sampler_of_a_run_config():
    data = DataConfig(use_chat_template=False)
    cfg = TrainConfig(data=data, rollout=RolloutConfig(max_new_tokens=9))
    single = eval_sampler(cfg, "engine", "tokenizer")
    # Sampled calls draw from the call's generator seed (a seed per call, as policygrad eval always has).
    assert isinstance(single, SingleTurnSampler) and not single.per_prompt_seeds
    assert (single.engine, single.tokenizer, single.data) == ("engine", "tokenizer", data)
    assert single.max_new_tokens == 9
    episodes = eval_sampler(cfg, "engine", "tokenizer", runner="runner")
    assert isinstance(episodes, EpisodeSampler) and episodes.runner == "runner" and episodes.per_prompt_seeds
