"""The value model: alignment of V(s_t) with the token it is used for, initialisation from the
policy and from a reward model, LoRA, save/load and bad inputs.

Also home of :func:`make_tiny_reward_model`, the tiny one-label sequence classifier the reward-model
and PPO tests build (nothing is downloaded)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModel, LlamaConfig, LlamaForSequenceClassification

from policygrad.models.value import ValueModel, is_sequence_classifier, load_value_model
from policygrad.rollout.base import Rollout
from tests.tiny import BOS_ID, EOS_ID, PAD_ID, make_tiny_llama, make_tiny_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

PAD_SPIKE = 1e6


def make_tiny_reward_model(path=None, *, seed: int = 1, pad_spike: float | None = None):
    """A tiny ``LlamaForSequenceClassification`` (num_labels=1) with the tiny tokenizer.

    With ``pad_spike``, the model returns a huge score at every padding position: the attention
    and MLP output projections are zero (each layer passes its input through unchanged, so the
    hidden state at a position is the embedding of that position's token), the ``<pad>``
    embedding is the unit vector e_0, every other embedding has 0 in dimension 0, and the score
    weight on dimension 0 is ``pad_spike``. After the final RMSNorm the pad position's score is
    ``pad_spike * sqrt(hidden_size) * norm_weight[0]`` (about 5.7e6 for 1e6), while every real
    token scores ``w[1:] . norm(embedding)[1:]`` (order 1). Saved to ``path`` when given.
    """
    tokenizer = make_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        num_labels=1,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(config)
        if pad_spike is not None:
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.o_proj.weight.zero_()
                    layer.mlp.down_proj.weight.zero_()
                embed = model.model.embed_tokens.weight
                embed[:, 0] = 0.0
                embed[PAD_ID] = 0.0
                embed[PAD_ID, 0] = 1.0
                model.score.weight[0, 0] = pad_spike
    model.eval()
    if path is not None:
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return model, tokenizer


def make_rollout(prompts: list[list[int]], responses: list[list[int]], lengths: list[int] | None = None):
    """A Rollout from token lists: prompts left-padded, responses right-padded to the longest;
    ``lengths[i]`` valid response tokens (default: all of them)."""
    B = len(prompts)
    P = max(len(p) for p in prompts)
    T = max(len(r) for r in responses)
    prompt_ids = torch.full((B, P), PAD_ID, dtype=torch.long)
    prompt_mask = torch.zeros((B, P), dtype=torch.long)
    response_ids = torch.full((B, T), PAD_ID, dtype=torch.long)
    response_mask = torch.zeros((B, T))
    for i, (p, r) in enumerate(zip(prompts, responses)):
        prompt_ids[i, P - len(p) :] = torch.tensor(p)
        prompt_mask[i, P - len(p) :] = 1
        n = len(r) if lengths is None else lengths[i]
        response_ids[i, : len(r)] = torch.tensor(r)
        response_mask[i, :n] = 1.0
    return Rollout(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        truncated=torch.zeros(B, dtype=torch.bool),
        sampler_logprobs=torch.zeros((B, T)),
        group_index=torch.arange(B),
    )


@pytest.fixture(scope="module")
def critic_with_head(tiny_model_dir):
    critic = load_value_model("policy", policy_path=tiny_model_dir)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        critic.head.weight.normal_()
        critic.head.bias.fill_(0.25)
    return critic


PROMPTS = [[BOS_ID, 40, 41, 42], [BOS_ID, 50, 51, 52, 53, 54]]  # different lengths: left padding
RESPONSES = [[60, 61, 62, 63, 64], [70, 71, 72, 73, 74]]


# ----------------------------------------------------------------------------- alignment


@pytest.mark.parametrize("t", range(5))
def test_value_for_token_t_does_not_see_token_t_or_later(critic_with_head, t):
    base = make_rollout(PROMPTS, RESPONSES)
    changed_responses = [r[:t] + [(x + 7) % 90 + 5 for x in r[t:]] for r in RESPONSES]
    changed = make_rollout(PROMPTS, changed_responses)
    with torch.no_grad():
        v_base = critic_with_head.response_values(base)
        v_changed = critic_with_head.response_values(changed)
    # V used for tokens 0..t (states s_0..s_t) reads only the prompt and tokens < t: unchanged.
    torch.testing.assert_close(v_changed[:, : t + 1], v_base[:, : t + 1], rtol=0, atol=1e-6)
    # The values of later states see the changed token(s): the check above could fail.
    if t < 4:
        assert (v_changed[:, t + 1 :] - v_base[:, t + 1 :]).abs().max() > 1e-4


def test_value_of_state_t_is_the_last_position_of_the_prefix(critic_with_head):
    # Definition: V(s_t) is the head on the hidden state of the last token of prompt + response[:t].
    rollout = make_rollout(PROMPTS, RESPONSES)
    P = rollout.prompt_ids.shape[1]
    ids, mask, pos = rollout.input_ids(), rollout.attention_mask(), rollout.position_ids()
    with torch.no_grad():
        values = critic_with_head.response_values(rollout)
        for t in range(rollout.response_ids.shape[1]):
            prefix = critic_with_head(ids[:, : P + t], mask[:, : P + t], pos[:, : P + t])[:, -1]
            # a shorter input runs other kernels: equal up to float32 rounding
            torch.testing.assert_close(values[:, t], prefix, rtol=1e-6, atol=1e-6)
    assert values.dtype == torch.float32 and values.shape == (2, 5)


def test_values_are_differentiable(critic_with_head):
    values = critic_with_head.response_values(make_rollout(PROMPTS, RESPONSES))
    values.sum().backward()
    assert critic_with_head.head.weight.grad is not None
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in critic_with_head.backbone.parameters())
    critic_with_head.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------- initialisation


def test_policy_init_copies_the_transformer_and_starts_at_zero(tiny_model_dir):
    critic = load_value_model("policy", policy_path=tiny_model_dir)
    reference = AutoModel.from_pretrained(tiny_model_dir)
    ours = critic.backbone.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(ours[key], value), key
    with torch.no_grad():
        values = critic.response_values(make_rollout(PROMPTS, RESPONSES))
    assert torch.equal(values, torch.zeros(2, 5))  # zero head: V = 0 exactly
    assert critic.training and all(p.requires_grad for p in critic.parameters())


def test_reward_model_init_copies_its_head_and_reads_like_it(tmp_path):
    rm_dir = tmp_path / "rm"
    rm, _ = make_tiny_reward_model(rm_dir, seed=5)
    assert is_sequence_classifier(str(rm_dir))
    # the policy only has to share the vocabulary; any tiny Llama of the tiny tokenizer does
    policy_dir = tmp_path / "policy"
    make_tiny_llama(policy_dir, seed=0)
    critic = load_value_model(str(rm_dir), policy_path=str(policy_dir))
    torch.testing.assert_close(critic.head.weight, rm.score.weight, rtol=0, atol=0)
    assert float(critic.head.bias.detach()) == 0.0  # Llama's score head has no bias
    # The critic's value at the last column of an unpadded sequence is the reward model's score.
    ids = torch.tensor([[BOS_ID, 30, 31, 32, 33, EOS_ID]])
    with torch.no_grad():
        v_last = critic(ids, torch.ones_like(ids))[:, -1]
        rm_score = rm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, 0]
    torch.testing.assert_close(v_last, rm_score, rtol=1e-5, atol=1e-6)


def test_lora_critic_trains_only_adapters_and_head(tiny_model_dir):
    full = load_value_model("policy", policy_path=tiny_model_dir)
    lora = load_value_model("policy", policy_path=tiny_model_dir, lora_rank=4, lora_alpha=8)
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("head.") for n in trainable)
    assert {"head.weight", "head.bias"} <= trainable
    with torch.no_grad():
        for critic in (full, lora):
            critic.head.weight.fill_(0.1)
        rollout = make_rollout(PROMPTS, RESPONSES)
        # LoRA's B matrices start at 0: the adapted critic computes what the plain one does.
        torch.testing.assert_close(
            lora.response_values(rollout), full.response_values(rollout), rtol=0, atol=1e-6
        )


def test_dropout_is_off_in_the_critic(tmp_path):
    policy_dir = tmp_path / "dropout_policy"
    make_tiny_llama(policy_dir, seed=0, attention_dropout=0.5)
    critic = load_value_model("policy", policy_path=str(policy_dir))
    assert critic.backbone.config.attention_dropout == 0.0
    with torch.no_grad():
        critic.head.weight.fill_(0.3)
        rollout = make_rollout(PROMPTS, RESPONSES)
        assert critic.training
        assert torch.equal(critic.response_values(rollout), critic.response_values(rollout))


def test_save_and_load_round_trip(critic_with_head, tiny_model_dir, tmp_path):
    critic_with_head.save(str(tmp_path / "critic"))
    fresh = load_value_model("policy", policy_path=tiny_model_dir)
    fresh.load(str(tmp_path / "critic"))
    rollout = make_rollout(PROMPTS, RESPONSES)
    with torch.no_grad():
        assert torch.equal(fresh.response_values(rollout), critic_with_head.response_values(rollout))
    lora = load_value_model("policy", policy_path=tiny_model_dir, lora_rank=2)
    with pytest.raises(ValueError, match="does not match the critic"):
        lora.load(str(tmp_path / "critic"))
    with pytest.raises(FileNotFoundError, match="no value model weights"):
        fresh.load(str(tmp_path / "nowhere"))


# ----------------------------------------------------------------------------- bad inputs


def test_vocabulary_mismatch_is_refused(tmp_path, tiny_model_dir):
    other = tmp_path / "bigger_vocab"
    make_tiny_llama(other, seed=0, vocab_size=128)
    with pytest.raises(ValueError, match="vocabulary of 128 tokens but the policy's has 100"):
        load_value_model(str(other), policy_path=tiny_model_dir)


def test_multi_label_classifier_is_refused(tmp_path, tiny_model_dir):
    model, tokenizer = make_tiny_reward_model(None)
    model.config.num_labels = 3
    model.config.architectures = ["LlamaForSequenceClassification"]
    model.config.save_pretrained(tmp_path / "three")
    with pytest.raises(ValueError, match="classifier with 3 labels"):
        load_value_model(str(tmp_path / "three"), policy_path=tiny_model_dir)


def test_bad_init_from_and_head(tiny_model_dir):
    with pytest.raises(ValueError, match="critic.init_from must be 'policy' or a model folder"):
        load_value_model("  ", policy_path=tiny_model_dir)
    with pytest.raises(ValueError, match="does not exist"):
        load_value_model("/no/such/critic", policy_path=tiny_model_dir)
    with pytest.raises(TypeError, match=r"head must be torch.nn.Linear\(hidden_size, 1\)"):
        ValueModel(torch.nn.Identity(), torch.nn.Linear(4, 2))
