"""Rollouts sampled ahead with a fixed staleness bound (``rollout.max_staleness``): equal to the
synchronous run at k = 0, a function of config and seed at k = 1 (thread == inline, straight ==
resumed), the importance weights applied to stale batches, errors and the checkpointed queue."""

from __future__ import annotations

import collections
import json
import logging
import math
import os
import threading
import time

import pytest
import torch

from policygrad.config.train import ConfigError
from policygrad.core.importance import truncated_importance_weights
from policygrad.produce import production
from policygrad.produce.producer import Producer
from policygrad.produce.rollouts import Rollouts
from policygrad.run import Run
from policygrad.trainer import loop
from tests.training import checkpoint_weights, write_jsonl

pytestmark = pytest.mark.integration

VOLATILE = ("time/", "perf/", "memory/", "async/overlap", "async/queue")


def _rows(run_dir) -> list[dict]:
    out = []
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            out.append(
                {
                    k: ("nan" if isinstance(v, float) and math.isnan(v) else v)
                    for k, v in row.items()
                    if not k.startswith(VOLATILE)
                }
            )
    return out


def _same_weights(a_dir, b_dir, step: int) -> bool:
    a, b = checkpoint_weights(a_dir, step), checkpoint_weights(b_dir, step)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _sections(tmp_path, **extra) -> dict:
    # Prompts of very different lengths: batches of unequal widths go through the queue.
    data = write_jsonl(
        tmp_path / "train.jsonl",
        [{"prompt": "What is " + "1+" * a + "1?", "answer": str(a + 1)} for a in (1, 9, 3, 14, 2, 6)],
    )
    sections = {
        "steps": 4,
        "save_every": 2,
        "data": {"dataset": data, "shuffle": True},
        "optim": {"lr": 5e-2},
    }
    for key, value in extra.items():
        sections[key] = {**sections.get(key, {}), **value} if isinstance(value, dict) else value
    return sections


def _trained_prompts(monkeypatch) -> list[list[str]]:
    """Records the prompts of every batch a step trains on."""
    seen: list[list[str]] = []
    finish = loop.finish

    def recording(trainer, prod):
        out = finish(trainer, prod)
        seen.append([row["prompt"] for row in out[0].rows])
        return out

    monkeypatch.setattr(loop, "finish", recording)
    return seen


def test_staleness_zero_is_the_inline_case_and_its_checkpoints_resume(make_config, tmp_path, monkeypatch):
    # k = 0: every step's batch is produced when the step takes it, in the trainer's thread, by the
    # weights of the step (version == step); nothing async in the metrics or the checkpoint, and a
    # checkpoint without a "pipeline" key (every synchronous run's, before and after) resumes.
    calls = []
    produce = Producer.produce

    def recording(self, step, version):
        calls.append((step, version, threading.current_thread().name))
        return produce(self, step, version)

    monkeypatch.setattr(Producer, "produce", recording)
    sync = Run(make_config("sync", **_sections(tmp_path)))
    sync.train()
    assert calls == [(m, m, "MainThread") for m in range(4)]
    assert sync.trainer.rollouts.max_staleness == 0 and sync.trainer.rollouts.jobs == {}
    rows = _rows(sync.run_dir)
    assert not [k for r in rows for k in r if k.startswith("async/")]
    state = torch.load(
        os.path.join(sync.run_dir, "checkpoints", "step_2", "trainer_state.pt"), weights_only=True
    )
    assert "pipeline" not in state and state["data_position"] == 2 * 2  # 2 prompts a step
    cfg = make_config("resumed", **{**_sections(tmp_path), "steps": 2})
    Run(cfg).train()
    resumed = Run(make_config("resumed", **_sections(tmp_path)), resume_from=cfg.output_dir)
    resumed.train()
    assert _rows(cfg.output_dir) == rows
    assert _same_weights(sync.run_dir, cfg.output_dir, 4)


def test_staleness_one_thread_equals_inline_and_resume_equals_straight(make_config, tmp_path, monkeypatch):
    seen = _trained_prompts(monkeypatch)
    runs = {}
    for executor in ("thread", "inline"):
        cfg = make_config(
            executor, **_sections(tmp_path, rollout={"max_staleness": 1, "async_executor": executor})
        )
        runs[executor] = Run(cfg)
        runs[executor].train()
    straight_prompts = seen[:4]
    thread, inline = _rows(runs["thread"].run_dir), _rows(runs["inline"].run_dir)
    assert thread == inline
    assert _same_weights(runs["thread"].run_dir, runs["inline"].run_dir, 4)
    # The batch trained at step m was sampled by the weights after update max(0, m - 1).
    assert [r["async/staleness"] for r in thread] == [0.0, 1.0, 1.0, 1.0]
    # The proximal policy differs from the behaviour one once the batch is stale: weights applied.
    assert thread[0]["mismatch/is_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # same weights
    assert all(r["mismatch/is_weight_mean"] != pytest.approx(1.0, abs=1e-4) for r in thread[1:])

    # 2 steps, stop (the checkpoint holds the batch sampled ahead), resume for 2 more.
    seen.clear()
    sections = _sections(tmp_path, rollout={"max_staleness": 1})
    cfg = make_config("resumed", **{**sections, "steps": 2})
    Run(cfg).train()
    state = torch.load(
        os.path.join(cfg.output_dir, "checkpoints", "step_2", "trainer_state.pt"), weights_only=True
    )
    assert [p["step"] for p in state["pipeline"]["finished"]] + [state["pipeline"]["next_step"]] in (
        [2],
        [2, 3],
    )
    resumed = Run(make_config("resumed", **sections), resume_from=cfg.output_dir)
    resumed.train()
    assert _rows(cfg.output_dir) == thread
    assert _same_weights(cfg.output_dir, runs["thread"].run_dir, 4)
    assert collections.Counter(map(tuple, seen)) == collections.Counter(map(tuple, straight_prompts))
    assert len(seen) == 4  # no batch dropped or repeated, whatever its width


def test_uncorrected_staleness_warns_and_auto_corrects(make_config, caplog):
    cfg = make_config(rollout={"max_staleness": 1})
    assert cfg.rollout.resolved_is_correction() == "token"
    assert make_config().rollout.resolved_is_correction() == "none"
    with caplog.at_level(logging.WARNING, logger="policygrad"):
        run = Run(make_config("none", rollout={"max_staleness": 1, "is_correction": "none"}))
    run.close()
    assert "leaves the lag uncorrected" in caplog.text


@pytest.mark.parametrize("executor", ["thread", "inline"])
def test_a_producer_that_raises_fails_the_step_that_waits_for_it(
    executor, make_config, tmp_path, monkeypatch
):
    produce = Producer.produce

    def breaks_at_step_2(self, step, version):
        if step == 2:
            raise RuntimeError("the sampler broke")
        return produce(self, step, version)

    monkeypatch.setattr(Producer, "produce", breaks_at_step_2)
    run = Run(
        make_config(executor, **_sections(tmp_path, rollout={"max_staleness": 1, "async_executor": executor}))
    )
    with pytest.raises(RuntimeError, match="the sampler broke"):
        run.train()
    assert run.trainer.step_idx == 1  # step 1 (the second) drained the job of step 2 and failed


def test_resume_with_another_staleness_is_refused(make_config, tmp_path):
    cfg = make_config("run", **{**_sections(tmp_path, rollout={"max_staleness": 1}), "steps": 2})
    Run(cfg).train()
    with pytest.raises(ConfigError, match="rollout.max_staleness"):
        Run(make_config("run", **_sections(tmp_path)), resume_from=cfg.output_dir)


def test_staleness_needs_per_prompt_seeds_and_a_sane_floor(make_config):
    with pytest.raises(ConfigError, match="needs per-prompt seeds"):
        make_config(rollout={"max_staleness": 1, "per_prompt_seeds": False})
    with pytest.raises(ConfigError, match="rollout.max_staleness must be >= 0"):
        make_config(rollout={"max_staleness": -1})
    with pytest.raises(ConfigError, match=r"rollout.is_floor must be in \(0, rollout.is_cap=2.0\)"):
        make_config(rollout={"is_floor": 2.5})
    with pytest.raises(ConfigError, match="rollout.max_staleness=4 is not below steps=4"):
        make_config(steps=4, rollout={"max_staleness": 4})
    with pytest.raises(ConfigError, match="rollout.async_executor"):
        make_config(rollout={"async_executor": "process"})


# ----------------------------------------------------------------------------- the rollouts alone


class _Stream:
    def __init__(self):
        self.position = 0


def _fake(stream, log, seconds=0.0):
    """A producer that takes 2 prompts and records the engine's version at its start and end."""
    engine = {"version": 0}

    def produce(step, version):
        start = engine["version"]
        stream.position += 2
        time.sleep(seconds)
        log.append((step, version, start, engine["version"], threading.current_thread().name))
        rollout_free = production.Production(step, version, [], None, {}, seconds)
        return rollout_free

    def sync():
        engine["version"] += 1

    return produce, sync, engine


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("executor", ["thread", "inline"])
def test_fixed_lag_one_job_at_a_time_and_no_sync_while_a_job_runs(k, executor):
    stream, log = _Stream(), []
    produce, sync, engine = _fake(stream, log, seconds=0.01)
    pipe = Rollouts(produce, sync, stream, max_staleness=k, steps=6, executor=executor)
    for m in range(6):
        prod = pipe.take(m).production
        assert (prod.step, prod.version) == (m, max(0, m - k))
        pipe.after_update(m + 1, synced=True)
    pipe.close()
    # In step order, each once; and the k batches after the last step that older weights
    # sampled (a resume with more steps trains them).
    assert [step for step, *_ in log] == list(range(6 + k))
    # Each job saw one engine version from start to end, and it was the one it was due on.
    assert all(start == end == version for _, version, start, end, _ in log)
    # k = 0 is the inline case whatever the executor: no thread.
    ahead_thread = executor == "thread" and k > 0
    assert {name for *_, name in log} == {"policygrad-rollout" if ahead_thread else "MainThread"}
    assert stream.position == 2 * (6 + k)


def test_state_between_steps_restarts_the_unfinished_job_where_it_began():
    stream, log = _Stream(), []
    produce, sync, _ = _fake(stream, log)
    pipe = Rollouts(produce, sync, stream, max_staleness=2, steps=10, executor="inline")
    for m in range(3):
        pipe.take(m)
        pipe.after_update(m + 1, synced=True)
    state = pipe.state_dict()  # inline: the jobs of steps 3, 4, 5 are finished
    assert [p["step"] for p in state["finished"]] == [3, 4, 5] and state["next_step"] == 6
    assert state["position"] == 12 and state["version"] == 3
    # Saved, loaded with weights_only, restored into a fresh pipeline: it starts at step 6's job.
    path_state = torch.load(_save(state), weights_only=True)
    stream2, log2 = _Stream(), []
    produce2, sync2, engine2 = _fake(stream2, log2)
    again = Rollouts(produce2, sync2, stream2, max_staleness=2, steps=10, executor="inline")
    again.load_state_dict(path_state)
    prod = again.take(3).production
    assert prod.step == 3 and prod.version == 1
    assert engine2["version"] == 1  # the checkpoint's weights were pushed before any job
    assert log2 == [] and stream2.position == 12  # nothing sampled until version 3 moves on
    again.after_update(4, synced=True)
    assert [step for step, *_ in log2] == [6]


def _save(state) -> str:
    import tempfile

    path = os.path.join(tempfile.mkdtemp(), "state.pt")
    torch.save(state, path)
    return path


def test_floor_drops_tokens_below_it_in_either_mode():
    # ratios exp(lp - sampler): [2.0, 0.25, 1.0] (the last masked); cap 1.5, floor 0.5:
    # truncate -> [1.5, 0 (0.25 < 0.5), 0]; mask -> [0 (2.0 > 1.5), 0, 0].
    sampler = torch.zeros(1, 3)
    lp = torch.tensor([[math.log(2.0), math.log(0.25), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = truncated_importance_weights(sampler, lp, mask, cap=1.5, floor=0.5)
    assert w.tolist() == [[1.5, 0.0, 0.0]]
    w = truncated_importance_weights(sampler, lp, mask, cap=1.5, floor=0.5, mode="mask")
    assert w.tolist() == [[0.0, 0.0, 0.0]]
    # floor 0.2 keeps the 0.25 token at its weight.
    w = truncated_importance_weights(sampler, lp, mask, cap=1.5, floor=0.2)
    assert w.tolist() == [[1.5, 0.25, 0.0]]
    with pytest.raises(ValueError, match="floor must be in"):
        truncated_importance_weights(sampler, lp, mask, cap=1.5, floor=1.5)


def test_evaluations_between_steps_wait_for_the_job_in_flight(make_config, tmp_path):
    # The engine samples one thing at a time: an evaluation drains the pipeline first, and
    # evaluates the weights the engine now holds (the current ones), whichever executor runs.
    rows = {}
    for executor in ("thread", "inline"):
        sections = _sections(
            tmp_path, rollout={"max_staleness": 1, "async_executor": executor}, eval_every=1, steps=3
        )
        sections["data"] = {**sections["data"], "eval_dataset": sections["data"]["dataset"], "eval_size": 3}
        run = Run(make_config(executor, **sections))
        run.train()
        rows[executor] = _rows(run.run_dir)
    assert rows["thread"] == rows["inline"]
    assert sum("eval/accuracy" in r for r in rows["thread"]) == 2  # after steps 1 and 2


def test_close_without_waiting_abandons_the_job_in_flight():
    """A second Ctrl-C stops at once: closing does not wait for a job that may run for minutes
    (a slow reward call); the default close waits for it."""
    stream, started, release = _Stream(), threading.Event(), threading.Event()

    def produce(step, version):
        started.set()
        release.wait(30)
        return production.Production(step, version, [], None, {}, 0.0)

    pipe = Rollouts(produce, lambda: None, stream, max_staleness=1, steps=4, executor="thread")
    pipe._start()  # the jobs of steps 0 and 1 on the initial weights; step 0's blocks
    assert started.wait(10)
    start = time.perf_counter()
    assert not pipe.close(timeout=0.1)  # the job in flight goes on alone
    assert time.perf_counter() - start < 5
    release.set()
    assert pipe.close()  # then it ends; idempotent
