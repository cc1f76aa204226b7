"""A trainer's state in and out of a checkpoint (:mod:`policygrad.trainer.state`): what a
synchronous run writes (no ``pipeline`` key, as every checkpoint before the rollouts had), what a
fresh trainer reads back, and a checkpoint of rollouts sampled ahead refused by a synchronous run."""

from __future__ import annotations

import pytest
import torch

from policygrad.errors import CheckpointError
from policygrad.run import Run
from policygrad.trainer.state import load_trainer_state, networks, trainer_state

pytestmark = pytest.mark.integration


def test_a_trainer_state_goes_into_a_fresh_trainer(make_config):
    kl = {"placement": "reward", "beta": 0.05, "controller": "adaptive", "target": 0.1}
    trained, fresh = Run(make_config("trained", kl=kl)), Run(make_config("fresh", kl=kl))
    try:
        t = trained.trainer
        t.step()
        state = trainer_state(t)
        assert state["step"] == 1 and state["data_position"] == 2  # 2 prompts a step
        assert "pipeline" not in state  # max_staleness 0: nothing sampled ahead
        assert list(networks(t)) == ["policy"] and networks(t)["policy"] == (t.policy, t.optimizer)
        load_trainer_state(fresh.trainer, state, checkpoint="ck")
        f = fresh.trainer
        assert (f.step_idx, f.stream.position) == (1, 2)
        assert f.kl_ctl.state_dict() == t.kl_ctl.state_dict() and f.kl_ctl.value != 0.05  # it moved
        assert f.scheduler.state_dict() == t.scheduler.state_dict()
        a, b = f.optimizer.state_dict()["state"], t.optimizer.state_dict()["state"]
        assert a.keys() == b.keys() and all(torch.equal(a[k]["exp_avg"], b[k]["exp_avg"]) for k in a)
        assert torch.equal(torch.get_rng_state(), state["rng"]["torch"])
        ahead = {**state, "pipeline": {"max_staleness": 1}}
        refused = r"checkpoint ck was written with rollout.max_staleness=1; resume it with that value"
        with pytest.raises(CheckpointError, match=refused + r" \(this run has 0\)"):
            load_trainer_state(fresh.trainer, ahead, checkpoint="ck")
    finally:
        trained.close()
        fresh.close()

