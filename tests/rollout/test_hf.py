"""Tests of the Rollout batch and the Hugging Face generate engine on a tiny random Llama."""

from __future__ import annotations

import pytest
import torch

from policygrad.models.loading import apply_lora
from policygrad.rollout import HFRolloutEngine, Rollout
from tests.tiny import EOS_ID, PAD_ID, make_tiny_llama

pytestmark = pytest.mark.integration

# Every 7th id from <|im_end|> (2, 9, ..., 93: 14 of the 100 ids) ends a response in the masking
# tests, so short runs of the random model give both early EOS and truncation.
MANY_EOS = list(range(2, 100, 7))


@pytest.fixture(scope="module")
def tiny():
    # initializer_range 0.5 makes next-token distributions peaked, so top-k/top-p cut real mass.
    model, tok = make_tiny_llama(seed=0, initializer_range=0.5)
    return model, tok


def _prompts(tok, texts):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _full_forward_logits(model, rollout):
    """fp32 logits [B, T, V] predicting each response token, from one full forward."""
    was_training = model.training
    model.eval()
    with torch.no_grad():
        out = model(
            input_ids=rollout.input_ids(),
            attention_mask=rollout.attention_mask(),
            position_ids=rollout.position_ids(),
        ).logits
    model.train(was_training)
    P = rollout.prompt_ids.shape[1]
    return out[:, P - 1 : -1].float()


def _gather(logprobs, tokens):
    return logprobs.gather(-1, tokens[..., None]).squeeze(-1)


# ----------------------------------------------------------------------------- shapes and layout


def test_shapes_groups_and_left_padding(tiny):
    model, tok = tiny
    prompts = _prompts(tok, ["hi", "What is 12+7?", "abc"])
    r = HFRolloutEngine(model, tok).generate(
        prompts, group_size=4, temperature=1.0, max_new_tokens=5, generator_seed=0
    )
    B, P = 12, len(prompts[1])
    assert r.prompt_ids.shape == (B, P) and r.prompt_mask.shape == (B, P)
    T = r.response_ids.shape[1]
    assert 1 <= T <= 5 and T == int(r.response_lengths.max())  # trimmed to the longest response
    assert r.response_mask.shape == r.sampler_logprobs.shape == (B, T)
    assert r.response_mask.dtype == torch.float32 and r.sampler_logprobs.dtype == torch.float32
    assert r.truncated.dtype == torch.bool and r.group_index.dtype == torch.long
    assert r.group_index.tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert (r.batch_size, r.num_prompts, r.group_size) == (12, 3, 4)
    for i, ids in enumerate(prompts):
        for g in range(4):
            row = i * 4 + g
            n_pad = P - len(ids)
            assert r.prompt_ids[row, n_pad:].tolist() == ids
            assert r.prompt_ids[row, :n_pad].tolist() == [PAD_ID] * n_pad
            assert r.prompt_mask[row].tolist() == [0] * n_pad + [1] * len(ids)


def test_masks_eos_in_the_middle_and_truncation(tiny):
    model, tok = tiny
    engine = HFRolloutEngine(model, tok, MANY_EOS)
    prompts = _prompts(tok, ["hi", "What is 12+7?", "abc", "x"])
    r = engine.generate(prompts, group_size=4, temperature=1.0, max_new_tokens=6, generator_seed=3)
    lengths = r.response_lengths.tolist()
    T = r.response_ids.shape[1]
    eos = set(MANY_EOS)
    assert any(r.truncated) and not all(r.truncated)
    assert any(0 < n < T for n in lengths)  # some response ends early, inside the batch's T
    for row in range(r.batch_size):
        n = lengths[row]
        tokens = r.response_ids[row].tolist()
        assert r.response_mask[row].tolist() == [1.0] * n + [0.0] * (T - n)
        assert tokens[n:] == [PAD_ID] * (T - n)  # pad after the first EOS
        assert not eos & set(tokens[: n - 1])  # no EOS before the last masked token
        if r.truncated[row]:
            assert n == 6 and tokens[n - 1] not in eos
        else:
            assert tokens[n - 1] in eos  # the EOS itself is inside the mask
        assert (r.sampler_logprobs[row, :n] < 0).all() and (r.sampler_logprobs[row, n:] == 0).all()


def test_stops_at_every_eos_id(tiny):
    model, tok = tiny
    prompts = _prompts(tok, ["hi", "What is 12+7?", "abc", "x"])
    kwargs = dict(group_size=4, temperature=1.0, max_new_tokens=12, generator_seed=11)
    one = HFRolloutEngine(model, tok, [EOS_ID]).generate(prompts, **kwargs)
    many = HFRolloutEngine(model, tok, MANY_EOS).generate(prompts, **kwargs)
    # Same seed, same draws: each multi-EOS response is the single-EOS response cut right after
    # its first token from MANY_EOS, whichever id that is.
    enders = set()
    for row in range(one.batch_size):
        full = one.response_ids[row, : int(one.response_lengths[row])].tolist()
        cut = next((k + 1 for k, t in enumerate(full) if t in MANY_EOS), len(full))
        n = int(many.response_lengths[row])
        assert many.response_ids[row, :n].tolist() == full[:cut]
        if not many.truncated[row]:
            enders.add(full[cut - 1])
        torch.testing.assert_close(
            many.sampler_logprobs[row, :n], one.sampler_logprobs[row, :n], rtol=0, atol=1e-6
        )
    assert len(enders) >= 3  # several different ids ended responses


def test_ignore_eos_runs_every_response_to_max_new_tokens(tiny):
    model, tok = tiny
    prompts = _prompts(tok, ["hi", "What is 12+7?", "abc", "x"])
    kwargs = dict(group_size=4, temperature=1.0, max_new_tokens=6, generator_seed=3)
    stopped = HFRolloutEngine(model, tok, MANY_EOS).generate(prompts, **kwargs)
    full = HFRolloutEngine(model, tok, MANY_EOS).generate(prompts, **kwargs, ignore_eos=True)
    assert (stopped.response_lengths < 6).any()  # the same draws end early without the flag
    assert full.response_lengths.tolist() == [6] * full.batch_size
    assert not full.truncated.any() and bool(full.response_mask.all())
    # EOS ids are sampled as plain tokens (MANY_EOS covers 1 in 7 ids: some appear mid-response),
    # and the reported log-probs are of the unmasked distribution, as a training forward sees it.
    assert any(t in MANY_EOS for t in full.response_ids[:, :-1].flatten().tolist())
    expected = _gather(_full_forward_logits(model, full).log_softmax(-1), full.response_ids)
    assert (expected - full.sampler_logprobs).abs().max() < 1e-4
    # Up to each row's first EOS the samples are those of the run that stops there.
    for row in range(full.batch_size):
        n = int(stopped.response_lengths[row])
        assert full.response_ids[row, :n].tolist() == stopped.response_ids[row, :n].tolist()


# ----------------------------------------------------------------------------- log-probs


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(0.7, None, None), (1.0, None, None), (0.7, 5, None), (0.7, None, 0.8), (1.3, 10, 0.9)],
)
def test_sampler_logprobs_match_a_full_forward(tiny, temperature, top_k, top_p):
    model, tok = tiny
    prompts = _prompts(tok, ["hi", "What is 12+7?", "abc"])
    r = HFRolloutEngine(model, tok).generate(
        prompts,
        group_size=4,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=8,
        generator_seed=1,
    )
    z = _full_forward_logits(model, r) / temperature
    if top_k is not None:  # keep the k largest, renormalise
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p is not None:  # smallest set of largest tokens whose mass reaches top_p
        sorted_z, order = z.sort(dim=-1, descending=True)
        before = sorted_z.softmax(-1).cumsum(-1) - sorted_z.softmax(-1)  # mass strictly above each token
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z = z.masked_fill(drop, float("-inf"))
    expected = _gather(z.log_softmax(-1), r.response_ids)
    mask = r.response_mask.bool()
    assert torch.isfinite(expected[mask]).all()  # every sampled token is inside the kept set
    assert (expected[mask] - r.sampler_logprobs[mask]).abs().max() < 1e-4
    if top_k is not None or top_p is not None:
        # Truncation changed the numbers: the untruncated log-probs are lower (less than 1 in mass).
        plain = _gather((_full_forward_logits(model, r) / temperature).log_softmax(-1), r.response_ids)
        assert (plain[mask] < r.sampler_logprobs[mask] - 1e-3).any()


def test_greedy_picks_the_argmax_and_reports_tempered_logprobs(tiny):
    model, tok = tiny
    prompts = _prompts(tok, ["hi", "What is 12+7?"])
    r = HFRolloutEngine(model, tok).generate(
        prompts, group_size=2, greedy=True, temperature=0.5, max_new_tokens=6
    )
    logits = _full_forward_logits(model, r)
    mask = r.response_mask.bool()
    assert torch.equal(logits.argmax(-1)[mask], r.response_ids[mask])
    expected = _gather((logits / 0.5).log_softmax(-1), r.response_ids)
    assert (expected[mask] - r.sampler_logprobs[mask]).abs().max() < 1e-4
    assert torch.equal(r.response_ids[0], r.response_ids[1])  # greedy: the group's samples agree
    assert r.sampling.greedy and r.sampling.temperature == 0.5


def test_left_padding_does_not_change_the_continuation(tiny):
    model, tok = tiny
    short, long = _prompts(tok, ["hi", "What is 12+7? Answer briefly."])
    engine = HFRolloutEngine(model, tok)
    alone = engine.generate([short], greedy=True, max_new_tokens=8)
    padded = engine.generate([long, short], greedy=True, max_new_tokens=8)
    assert padded.prompt_mask[1].sum() == len(short) < padded.prompt_ids.shape[1]  # really left-padded
    n = int(alone.response_lengths[0])
    assert padded.response_ids[1, :n].tolist() == alone.response_ids[0, :n].tolist()
    torch.testing.assert_close(
        padded.sampler_logprobs[1, :n], alone.sampler_logprobs[0, :n], rtol=0, atol=1e-5
    )
    # First-token logits of the left-padded row equal those of the unpadded prompt.
    with torch.no_grad():
        unpadded = model.eval()(torch.tensor([short])).logits[0, -1]
        model.train()
        first = _full_forward_logits(model, padded)[1, 0]
    torch.testing.assert_close(first, unpadded, rtol=0, atol=1e-5)


def test_position_ids_follow_the_attention_mask():
    # Row 0: 2 pad columns, prompt of 2, response of 2 then 1 pad; row 1: no padding.
    r = Rollout(
        prompt_ids=torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]]),
        prompt_mask=torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]),
        response_ids=torch.tensor([[11, 2, 0], [12, 13, 2]]),
        response_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
        truncated=torch.tensor([False, False]),
        sampler_logprobs=torch.tensor([[-0.5, -0.1, 0.0], [-0.2, -0.3, -0.4]]),
        group_index=torch.tensor([0, 1]),
    )
    assert r.input_ids().tolist() == [[0, 0, 5, 6, 11, 2, 0], [7, 8, 9, 10, 12, 13, 2]]
    assert r.attention_mask().tolist() == [[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]]
    # cumsum - 1 over the mask, 0 on padding.
    assert r.position_ids().tolist() == [[0, 0, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 5, 6]]
    assert r.response_lengths.tolist() == [2, 3]
    sub = r.select([1])
    assert sub.batch_size == 1 and sub.response_ids.tolist() == [[12, 13, 2]]
    assert sub.group_index.tolist() == [1]
    assert r.select(torch.tensor([True, False])).prompt_ids.tolist() == [[0, 0, 5, 6]]
    trimmed = r.select([0]).trim()  # two all-pad prompt columns and one all-masked response column go
    assert trimmed.input_ids().tolist() == [[5, 6, 11, 2]]
    assert trimmed.position_ids().tolist() == [[0, 1, 2, 3]]
    assert r.to("cpu").response_ids.tolist() == r.response_ids.tolist()
    with pytest.raises(ValueError, match="response_mask shape"):
        Rollout(
            r.prompt_ids,
            r.prompt_mask,
            r.response_ids,
            r.response_mask[:, :2],
            r.truncated,
            r.sampler_logprobs,
            r.group_index,
        )


def test_training_forward_with_rollout_positions_reproduces_sampler_logprobs(tiny):
    # The trainer's route: a forward over a trimmed sub-batch gives the sampler's numbers.
    model, tok = tiny
    prompts = _prompts(tok, ["hi", "What is 12+7?", "abc"])
    r = HFRolloutEngine(model, tok).generate(
        prompts, group_size=2, temperature=0.7, max_new_tokens=8, generator_seed=5
    )
    sub = r.select([0, 1]).trim()
    expected = _gather((_full_forward_logits(model, sub) / 0.7).log_softmax(-1), sub.response_ids)
    mask = sub.response_mask.bool()
    assert (expected[mask] - sub.sampler_logprobs[mask]).abs().max() < 1e-4


# ----------------------------------------------------------------------------- RNG, state, isolation


def test_generator_seed_is_reproducible_and_leaves_the_global_rng_alone(tiny):
    model, tok = tiny
    engine = HFRolloutEngine(model, tok)
    prompts = _prompts(tok, ["hi", "abc"])
    kwargs = dict(group_size=4, max_new_tokens=8)
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    a = engine.generate(prompts, generator_seed=7, **kwargs)
    assert torch.equal(torch.rand(3), expected_draw)  # the caller's stream did not move
    b = engine.generate(prompts, generator_seed=7, **kwargs)
    c = engine.generate(prompts, generator_seed=8, **kwargs)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.sampler_logprobs, b.sampler_logprobs)
    assert not torch.equal(a.response_ids, c.response_ids) or a.response_ids.shape != c.response_ids.shape


def test_global_seed_is_reproducible_without_generator_seed(tiny):
    model, tok = tiny
    engine = HFRolloutEngine(model, tok)
    prompts = _prompts(tok, ["hi", "abc"])
    torch.manual_seed(42)
    a = engine.generate(prompts, group_size=3, max_new_tokens=8)
    torch.manual_seed(42)
    b = engine.generate(prompts, group_size=3, max_new_tokens=8)
    assert torch.equal(a.response_ids, b.response_ids)


def test_train_eval_state_and_generation_config_are_restored(tiny):
    model, tok = tiny
    engine = HFRolloutEngine(model, tok)
    saved = model.generation_config
    model.train()
    engine.generate(_prompts(tok, ["hi"]), max_new_tokens=3)
    assert model.training and all(m.training for m in model.modules())
    assert model.generation_config is saved
    model.eval()
    engine.generate(_prompts(tok, ["hi"]), max_new_tokens=3)
    assert not model.training
    model.train()


def test_model_generation_config_does_not_leak_into_sampling(tiny):
    # A checkpoint's generation_config.json may carry a repetition penalty or a top-k; the
    # engine samples only with its own arguments, so log-probs still match the plain softmax.
    model, tok = tiny
    saved = model.generation_config
    model.generation_config = saved.__class__(**saved.to_dict())
    model.generation_config.repetition_penalty = 5.0
    model.generation_config.top_k = 3
    model.generation_config.min_p = 0.3
    model.generation_config.suppress_tokens = list(range(20, 60))
    model.generation_config.do_sample = True
    try:
        r = HFRolloutEngine(model, tok).generate(
            _prompts(tok, ["hi", "abc"]), group_size=4, max_new_tokens=8, generator_seed=2
        )
    finally:
        model.generation_config = saved
    expected = _gather(_full_forward_logits(model, r).log_softmax(-1), r.response_ids)
    mask = r.response_mask.bool()
    assert (expected[mask] - r.sampler_logprobs[mask]).abs().max() < 1e-4


def test_lora_model_generates_and_sync_weights_switches_model(tiny_model_dir):
    from policygrad.models.loading import load_causal_lm, load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    base = load_causal_lm(tiny_model_dir)
    engine = HFRolloutEngine(base, tok)
    peft_model = apply_lora(base, rank=2, alpha=4)
    engine.sync_weights(peft_model)
    assert engine.model is peft_model
    r = engine.generate(
        _prompts(tok, ["hi"]), group_size=2, temperature=0.7, max_new_tokens=5, generator_seed=0
    )
    expected = _gather((_full_forward_logits(peft_model, r) / 0.7).log_softmax(-1), r.response_ids)
    mask = r.response_mask.bool()
    assert (expected[mask] - r.sampler_logprobs[mask]).abs().max() < 1e-4
    assert peft_model.training


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"group_size": 0}, ValueError, "group_size must be >= 1"),
        ({"group_size": 2.0}, TypeError, "group_size must be an int"),
        ({"temperature": 0.0}, ValueError, "temperature must be a finite number > 0"),
        ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, ValueError, "top_k must be >= 0"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1"),
        ({"max_new_tokens": 600}, ValueError, "exceeds the model's context of 512 positions"),
    ],
)
def test_bad_arguments(tiny, kwargs, error, match):
    model, tok = tiny
    args = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=match):
        HFRolloutEngine(model, tok).generate(_prompts(tok, ["hi"]), **args)


def test_bad_prompts(tiny):
    model, tok = tiny
    engine = HFRolloutEngine(model, tok)
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        engine.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] is empty"):
        engine.generate([[5, 6], []], max_new_tokens=4)
    with pytest.raises(TypeError, match=r"prompt_token_ids\[0\] must be a list of ints"):
        engine.generate([["a"]], max_new_tokens=4)
    with pytest.raises(TypeError, match="list of token-id lists"):
        engine.generate("hello", max_new_tokens=4)
    with pytest.raises(ValueError, match="eos_token_ids is empty"):
        HFRolloutEngine(model, tok, [])


# ----------------------------------------------------------------------------- Gumbel-max draws


def test_per_prompt_seed_draws_follow_the_softmax_and_are_independent_across_steps():
    # rollout.per_prompt_seeds (the default) samples as argmax(scores + gumbel_noise(key, step)):
    # a draw from softmax(scores) only if the noise is standard Gumbel, independent per key, per
    # vocabulary entry and per step. The noise is a pure function of its inputs, so these numbers
    # are the same on every machine; the bounds are the 0.1 % tails of each statistic's law under
    # that hypothesis (40,000 draws).
    from policygrad.rollout.hf import gumbel_noise, sample_keys

    keys = sample_keys(list(range(5000)), 8, "cpu")  # 5000 prompts x G = 8: 40,000 rows
    scores = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=torch.float64)
    probs = torch.softmax(scores, 0)
    n = len(keys)
    draws = {}
    for step in (0, 1, 7, 31):
        noise = gumbel_noise(keys, step, 6)
        # Gumbel(0, 1): mean = Euler-Mascheroni 0.5772, variance pi^2 / 6 = 1.6449; the mean of
        # 240,000 draws has a standard error sqrt(1.6449 / 240000) = 0.0026 (0.1 %: 3.3 of them)
        assert abs(float(noise.mean()) - 0.5772157) < 3.3 * 0.0026
        draws[step] = (scores + noise).argmax(1)
        counts = torch.bincount(draws[step], minlength=6).double()
        chi2 = float(((counts - n * probs) ** 2 / (n * probs)).sum())
        assert chi2 < 20.52  # chi-square, 5 degrees of freedom: P(> 20.52) = 0.001
    # two steps' draws of one key agree as often as two independent draws: sum_i p_i^2 = 0.3794
    # (standard error sqrt(0.3794 * 0.6206 / 40000) = 0.0024)
    agree = float((draws[1] == draws[7]).double().mean())
    assert abs(agree - float((probs**2).sum())) < 3.3 * 0.0024
