"""How a run spreads over processes: ``make_strategy`` picks Single for one process, DDP or FSDP
for several (refusing FSDP with LoRA naming the field), and Single's methods are identities."""

from __future__ import annotations

import pytest
import torch

from policygrad.config.train import ConfigError, load_config
from policygrad.parallel import strategy as strategy_module
from policygrad.parallel.distributed import Dist
from policygrad.parallel.precision import Precision
from policygrad.parallel.strategy import DDP, FSDP, Single, make_strategy

pytestmark = pytest.mark.unit


def _config(tmp_path, **sections):
    tree = {"model": {"name": "org/model"}, "reward": {"functions": ["r.py:f"]}, "output_dir": str(tmp_path)}
    tree.update(sections)
    return load_config(None, tree)


class FakeDist:
    """A data-parallel Dist stand-in that records what a strategy asks of it."""

    active, is_main = True, True

    def __init__(self, passes=0, agree=True):
        self.passes, self.agree, self.calls = passes, agree, []

    def sync_gradients(self, _params, finite):
        self.calls.append(("sync_gradients", finite))
        return self.agree

    def agree_finite(self, finite):
        self.calls.append(("agree_finite", finite))
        return self.agree

    def equal_passes(self, count):
        self.calls.append(("equal_passes", count))
        return self.passes


def test_one_process_gets_single_whatever_the_configured_strategy(tmp_path):
    for name in ("auto", "ddp", "fsdp"):
        # fsdp + LoRA is refused only with several processes: one process shards nothing.
        cfg = _config(tmp_path, distributed={"strategy": name}, model={"name": "m", "lora": {"rank": 4}})
        got = make_strategy(cfg, Dist())
        assert type(got) is Single and got.model_name == "m" and got.reduce is None


def test_several_processes_get_ddp_or_fsdp(tmp_path):
    # Dist(world_size=2) without a process group: make_strategy only reads the config and device.
    two = Dist(rank=0, world_size=2)
    assert type(make_strategy(_config(tmp_path), two)) is DDP  # auto on the CPU is ddp
    assert type(make_strategy(_config(tmp_path, distributed={"strategy": "ddp"}), two)) is DDP
    fsdp = make_strategy(_config(tmp_path, distributed={"strategy": "fsdp"}), two)
    assert type(fsdp) is FSDP and fsdp.collective and fsdp.shards_state and not fsdp.saves_alone
    cuda = Dist(rank=1, world_size=2, device=torch.device("cuda", 1))
    assert type(make_strategy(_config(tmp_path), cuda)) is FSDP  # auto on CUDA is fsdp


@pytest.mark.parametrize(
    "model",
    [{"name": "m", "lora": {"rank": 8}}, {"name": "m", "adapter": "some/adapter"}],
    ids=["lora", "adapter"],
)
def test_fsdp_with_lora_is_refused_naming_the_fields(tmp_path, model):
    cfg = _config(tmp_path, distributed={"strategy": "fsdp"}, model=model)
    with pytest.raises(
        ConfigError, match=r"distributed\.strategy=fsdp.*model\.lora\.rank or model\.adapter.*ddp"
    ):
        make_strategy(cfg, Dist(rank=0, world_size=2))
    # ddp with the same model is fine: every rank holds the adapter.
    cfg = _config(tmp_path, distributed={"strategy": "ddp"}, model=model)
    assert type(make_strategy(cfg, Dist(rank=0, world_size=2))) is DDP


def test_single_methods_are_identities():
    single = Single(Dist(), model_name="m")
    assert (single.name, single.collective, single.shards_state, single.saves_alone) == (
        "single",
        False,
        False,
        True,
    )
    assert single.reduce is None and single.full_policy is None
    models, policy = object(), torch.nn.Linear(2, 2)
    assert single.prepare_models(models, engine_name="hf", precision=None) is models
    assert single.prepare_critic(policy) is None
    assert single.engine_policy(policy) is policy
    assert single.sync_gradients([], True) is True and single.sync_gradients([], False) is False
    assert single.idle_passes(0) == 0 and single.idle_passes(5) == 0
    shards = single.write_shards("/x/step_1", {"policy": (policy, None)}, tmp="/x/.step_1.tmp-1")
    assert shards == (None, None)
    synced = []

    class Engine:
        def sync_weights(self, model):
            synced.append(model)

    single.sync_engine(Engine(), policy)
    assert synced == [policy]


def test_reduce_is_the_dists_with_several_processes():
    dist = Dist(rank=0, world_size=2)
    assert Single(dist).reduce == dist.reduce


def test_ddp_sums_gradients_through_the_dist_and_passes_its_decision():
    dist = FakeDist(agree=False)
    ddp = DDP(dist)
    assert ddp.sync_gradients([], True) is False  # another rank's loss was non-finite
    assert dist.calls == [("sync_gradients", True)]
    assert not ddp.collective and ddp.idle_passes(3) == 0


def test_fsdp_agrees_on_finiteness_and_pads_micro_batches_to_the_busiest_rank():
    dist = FakeDist(passes=5, agree=True)
    fsdp = FSDP(dist)
    assert fsdp.sync_gradients([], True) is True
    # 5 passes on the busiest rank, 3 here: 2 zero-weight passes; the busiest itself adds none.
    assert fsdp.idle_passes(3) == 2 and fsdp.idle_passes(5) == 0
    assert dist.calls == [("agree_finite", True), ("equal_passes", 3), ("equal_passes", 5)]


def test_fsdp_refuses_a_loaded_lora_policy(monkeypatch):
    monkeypatch.setattr(strategy_module, "is_peft_model", lambda _model: True)

    class Models:
        policy = torch.nn.Linear(2, 2)
        reference = None

    fsdp = FSDP(FakeDist(), model_name="org/adapter")
    with pytest.raises(ConfigError, match=r"model\.name='org/adapter' is a LoRA adapter.*strategy=ddp"):
        fsdp.prepare_models(Models(), engine_name="hf", precision=None)
    assert fsdp.full_policy is None  # nothing was copied or sharded


@pytest.mark.parametrize(
    ("precision", "field"),
    [
        (
            Precision("fp16-mixed", torch.float32, torch.float16, "cpu", loss_scaling=True),
            "model.precision=fp16-mixed",
        ),
        (
            Precision("bf16-mixed", torch.float32, torch.bfloat16, "cpu", torch.float32),
            "model.lm_head_dtype=float32",
        ),
    ],
)
def test_fsdp_refuses_fp16_loss_scaling_and_the_fp32_head(precision, field):
    # FSDP2's mixed-precision policy casts every gathered weight (the head's too) to the compute
    # dtype, and its sharded gradients would need a sharded scaler: refused, naming the field.
    class Models:
        policy = torch.nn.Linear(2, 2)
        reference = None

    fsdp = FSDP(FakeDist(), model_name="org/model")
    with pytest.raises(ConfigError, match=f"^{field} is not supported with distributed.strategy=fsdp; use"):
        fsdp.prepare_models(Models(), engine_name="hf", precision=precision)
    assert fsdp.full_policy is None
