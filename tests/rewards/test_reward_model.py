"""A learned reward model as a reward function: read at the last real token (never at padding),
batched, frozen, dropout off, in its own chat template, and named in configs as
``reward_model:PATH``."""

from __future__ import annotations

import math

import pytest
import torch

from policygrad.rewards.registry import CompositeReward
from policygrad.rewards.reward_model import REWARD_MODEL_PREFIX, RewardModel, resolve_reward_functions
from tests.models.test_value import PAD_SPIKE, make_tiny_reward_model
from tests.tiny import EOS_ID, PAD_ID, make_tiny_llama

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

PROMPTS = ["What is 2+3?", "Say hi.", "What is 10-4? Answer with just the number."]
COMPLETIONS = ["5", "hi there, friend", "6\n"]


@pytest.fixture(scope="module")
def spiky_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("spiky_rm")
    make_tiny_reward_model(path, seed=2, pad_spike=PAD_SPIKE)
    return str(path)


def _alone(rm: RewardModel, prompts, completions) -> list[float]:
    """Each pair scored in a batch of its own: no padding anywhere."""
    return [rm([p], [c])[0] for p, c in zip(prompts, completions)]


def test_a_huge_value_at_padding_never_leaks(spiky_dir):
    rm = RewardModel.from_pretrained(spiky_dir, batch_size=3, use_chat_template=False)
    # The model really is spiky at padding: the score head on a <pad> position is ~5.7e6.
    with torch.no_grad():
        pad_hidden = rm.base(input_ids=torch.tensor([[PAD_ID]])).last_hidden_state[:, -1]
        assert float(rm.head(pad_hidden)) > PAD_SPIKE
    batched = rm(PROMPTS, COMPLETIONS)  # three lengths in one batch: two rows are right-padded
    alone = _alone(rm, PROMPTS, COMPLETIONS)
    assert all(abs(s) < 100 for s in batched), batched
    assert batched == pytest.approx(alone, abs=1e-5)
    # and the rows differ (the score depends on the text, so the comparison above means something)
    assert len({round(s, 4) for s in batched}) == 3


def test_score_is_read_at_the_last_real_token_even_when_pad_equals_eos():
    model, tokenizer = make_tiny_reward_model(None, seed=4)
    tokenizer.pad_token = tokenizer.eos_token  # as SmolLM2: pad id == eos id
    model.config.pad_token_id = EOS_ID
    rm = RewardModel(model, tokenizer, use_chat_template=False)
    ids = torch.tensor([[20, 21, 22, EOS_ID], [30, 31, EOS_ID, EOS_ID]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # row 1: its own EOS, then one pad (== EOS)
    ours = rm.score_ids(ids, mask)
    with torch.no_grad():
        expected = torch.stack(
            [
                model.score(model.model(input_ids=ids[:1]).last_hidden_state[:, 3])[0, 0],
                model.score(model.model(input_ids=ids[1:, :3]).last_hidden_state[:, 2])[0, 0],
            ]
        )
        # Hugging Face's pooling looks for the last token that is not the pad id, so with
        # pad == eos it reads the token BEFORE the EOS: a different number.
        hf = model(input_ids=ids[:1]).logits[0, 0]
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-6)
    assert abs(float(hf) - float(ours[0])) > 1e-4


def test_batch_size_does_not_change_the_scores(spiky_dir):
    one = RewardModel.from_pretrained(spiky_dir, batch_size=1)
    three = RewardModel.from_pretrained(spiky_dir, batch_size=3)
    assert one(PROMPTS, COMPLETIONS) == pytest.approx(three(PROMPTS, COMPLETIONS), abs=1e-5)
    assert three([], []) == []


def test_texts_use_the_reward_models_chat_template(spiky_dir):
    rm = RewardModel.from_pretrained(spiky_dir)
    # ChatML of the tiny tokenizer: user turn, then the completion as the assistant turn.
    assert rm.texts(["What is 2+3?"], ["5"]) == [
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
    ]
    plain = RewardModel.from_pretrained(spiky_dir, use_chat_template=False)
    assert plain.texts(["What is 2+3?"], [" 5"]) == ["What is 2+3? 5"]
    # The templated text is tokenized without extra special tokens and scored like its ids.
    ids = torch.tensor([rm.tokenizer(rm.texts(["Q"], ["A"])[0], add_special_tokens=False)["input_ids"]])
    assert rm(["Q"], ["A"])[0] == pytest.approx(float(rm.score_ids(ids, torch.ones_like(ids))[0]), abs=1e-6)


def test_long_texts_keep_their_end(spiky_dir):
    rm = RewardModel.from_pretrained(spiky_dir, max_length=6, use_chat_template=False)
    text = "What is 12 + 30? 42"
    # Left truncation keeps the last 6 characters (one token each), where the score is read.
    ids = torch.tensor([rm.tokenizer(text[-6:], add_special_tokens=False)["input_ids"]])
    assert rm.score_texts([text])[0] == pytest.approx(
        float(rm.score_ids(ids, torch.ones_like(ids))[0]), abs=1e-6
    )


def test_frozen_eval_mode_and_no_dropout(tmp_path):
    path = tmp_path / "dropout_rm"
    model, tokenizer = make_tiny_reward_model(None)
    model.config.attention_dropout = 0.3
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    rm = RewardModel.from_pretrained(str(path))
    assert rm.model.config.attention_dropout == 0.0
    assert not rm.model.training
    assert not any(p.requires_grad for p in rm.model.parameters())
    assert rm(PROMPTS, COMPLETIONS) == rm(PROMPTS, COMPLETIONS)


def test_config_entries_and_composite_reward(spiky_dir):
    specs = [REWARD_MODEL_PREFIX + spiky_dir, "answer_format"]
    functions = resolve_reward_functions(specs, use_chat_template=False, batch_size=2)
    assert isinstance(functions[0], RewardModel) and functions[1] == "answer_format"
    reward = CompositeReward(list(zip(functions, [2.0, 1.0])))
    out = reward(PROMPTS, COMPLETIONS)
    assert reward.names == ["reward_model", "answer_format"]
    expected = [2 * s for s in _alone(functions[0], PROMPTS, COMPLETIONS)]
    fmt = out.components["answer_format"].tolist()
    assert out.rewards.tolist() == pytest.approx([e + f for e, f in zip(expected, fmt)], abs=1e-4)
    assert all(math.isfinite(v) for v in out.rewards.tolist())


def test_bad_reward_model_entries(tmp_path, spiky_dir):
    with pytest.raises(ValueError, match="names no folder; write reward_model:/path/to/folder"):
        resolve_reward_functions(["reward_model:  "])
    with pytest.raises(ValueError, match="is not a model folder"):
        resolve_reward_functions([f"reward_model:{tmp_path}/missing"])
    causal = tmp_path / "causal"
    make_tiny_llama(causal, seed=0)
    with pytest.raises(ValueError, match="is not a sequence classifier"):
        resolve_reward_functions([f"reward_model:{causal}"])
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        RewardModel.from_pretrained(spiky_dir, batch_size=0)
    rm = RewardModel.from_pretrained(spiky_dir)
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        rm(["a", "b"], ["c"])
    with pytest.raises(ValueError, match="has no real token"):
        rm.score_ids(torch.tensor([[5, 6]]), torch.tensor([[0, 0]]))


def test_reward_model_folder_reads_only_reward_model_entries():
    from policygrad.rewards.reward_model import reward_model_folder

    assert reward_model_folder("  reward_model: /m/rm ") == "/m/rm"
    assert reward_model_folder("reward_model:") == ""  # names none: the loader refuses it
    for other in ("answer_correctness", "rewards.py:score", len, None):
        assert reward_model_folder(other) is None
