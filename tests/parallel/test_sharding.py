"""What of :mod:`policygrad.parallel.sharding` runs without a process group: finding the decoder
layers, ``is_sharded`` of a plain module and the bytes a rank holds, counted by hand.

Sharding itself (``shard_model``, ``full_state_dict``, ``copy_full_weights``, ``is_sharded`` of
a sharded model, ``local_bytes`` of ``DTensor`` shards) needs a process group and is covered by
tests/parallel/test_distributed.py."""

from __future__ import annotations

import pytest
import torch

from policygrad.parallel.sharding import decoder_layers, is_sharded, local_bytes


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)


class Stack(torch.nn.Module):
    """Two ModuleLists: the longer one holds the layers."""

    def __init__(self, no_split=None):
        super().__init__()
        self.heads = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])
        self.layers = torch.nn.ModuleList([Block() for _ in range(3)])
        if no_split is not None:
            self._no_split_modules = no_split


@pytest.mark.unit
def test_the_layers_are_the_classes_a_model_names_in_no_split_modules():
    model = Stack(no_split=["Block"])
    assert decoder_layers(model) == list(model.layers)


@pytest.mark.unit
def test_no_split_modules_of_a_submodule_count_too():
    outer = torch.nn.Sequential(Stack(no_split=["Linear"]))  # names the heads' class
    layers = decoder_layers(outer)
    # Every Linear of the model: 2 heads, then each block's linear, in module order.
    assert layers == [*outer[0].heads, *(b.linear for b in outer[0].layers)]


@pytest.mark.unit
def test_without_no_split_modules_the_longest_module_list():
    model = Stack()
    assert decoder_layers(model) == list(model.layers)  # 3 blocks beat 2 heads


@pytest.mark.integration
def test_a_transformers_model_yields_its_decoder_layers():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=3, num_attention_heads=2
    )
    model = LlamaForCausalLM(config)
    assert decoder_layers(model) == list(model.model.layers)


@pytest.mark.unit
def test_a_model_without_layers_is_an_error_naming_its_class():
    with pytest.raises(ValueError, match="^Linear has no decoder layers to shard$"):
        decoder_layers(torch.nn.Linear(2, 2))


@pytest.mark.unit
def test_a_plain_module_is_not_sharded():
    assert is_sharded(torch.nn.Linear(2, 2)) is False
    assert is_sharded(None) is False


@pytest.mark.unit
def test_local_bytes_count_trainable_parameters_gradients_and_optimizer_state():
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2, bias=False))
    model[0].bias.requires_grad_(False)  # frozen: not counted
    # Trainable float32: 3*4 + 4*2 = 20 elements = 80 bytes; one gradient per parameter: 80 more.
    assert local_bytes(model) == {"parameters": 80, "gradients": 80, "optimizer": 0}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    # AdamW keeps exp_avg and exp_avg_sq per parameter (2 x 80 bytes); its 0-d ``step`` is not counted.
    assert local_bytes(model, optimizer) == {"parameters": 80, "gradients": 80, "optimizer": 160}


@pytest.mark.unit
def test_local_bytes_use_each_parameters_dtype_and_count_a_tied_one_once():
    embed = torch.nn.Embedding(10, 4).to(torch.bfloat16)
    head = torch.nn.Linear(4, 10, bias=False).to(torch.bfloat16)
    head.weight = embed.weight  # tied: one tensor
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    # 10*4 bf16 elements x 2 bytes = 80 bytes, once.
    assert local_bytes(model) == {"parameters": 80, "gradients": 80, "optimizer": 0}
