"""Network state in and out of a saved folder: policy weights (full or tied heads, refused when
they do not match or are corrupt) and a whole-network optimizer state."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from policygrad.errors import CheckpointError
from policygrad.parallel.state import load_full_optimizer, load_policy_weights

pytestmark = pytest.mark.unit


class Tied(torch.nn.Module):
    """A model whose output head shares the embedding (saved once, as in tied-embedding LMs)."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(5, 3)
        self.lm_head = torch.nn.Linear(3, 5, bias=False)
        self.lm_head.weight = self.embed.weight


def test_policy_weights_load_and_tied_heads_may_be_absent(tmp_path):
    saved = Tied(0)
    save_file({"embed.weight": saved.embed.weight.detach().clone()}, str(tmp_path / "model.safetensors"))
    model = Tied(1)
    load_policy_weights(model, str(tmp_path))
    assert torch.equal(model.embed.weight, saved.embed.weight) and model.lm_head.weight is model.embed.weight


def test_policy_weights_that_do_not_match_or_are_corrupt_are_refused(tmp_path):
    save_file(
        {"embed.weight": torch.zeros(5, 3), "extra.bias": torch.zeros(1)}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(
        CheckpointError, match=r"does not match the model: missing \[\], unexpected \['extra.bias'\]"
    ):
        load_policy_weights(Tied(0), str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors cannot be read .*the file is corrupt"):
        load_policy_weights(Tied(0), str(tmp_path))


def test_a_whole_optimizer_state_loads_into_an_unsharded_model():
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    net(torch.ones(1, 3)).sum().backward()
    opt.step()
    saved = opt.state_dict()
    fresh = torch.optim.AdamW(net.parameters(), lr=0.5)
    load_full_optimizer(net, fresh, saved)
    got = fresh.state_dict()
    assert got["param_groups"][0]["lr"] == 0.1
    for k in saved["state"]:
        for name, value in saved["state"][k].items():
            assert torch.equal(got["state"][k][name], value)
