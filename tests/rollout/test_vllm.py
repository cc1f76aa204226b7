"""Tests of the vLLM rollout engine against the Hugging Face engine and a transformers fp32 forward.

One fp32 engine serves the module (vLLM starts in a few seconds, but only once if possible); tests
that change its weights put the original weights back before they end.
"""

from __future__ import annotations

import copy
import gc
import json
import random
import threading

import numpy as np
import pytest
import torch

from policygrad.envs import Environment, StepResult
from policygrad.envs.episodes import EpisodeLimits, EpisodeRunner
from policygrad.models.forward import policy_logprobs
from policygrad.rollout import HFRolloutEngine, SamplingParams, VLLMRolloutEngine, vllm_available
from tests.tiny import CHAT_TEMPLATE, PAD_ID, make_tiny_llama

pytestmark = pytest.mark.integration

# Skip without importing vLLM: importing it here would set up its logging before the engine sets
# VLLM_LOGGING_LEVEL, and slow down collecting the whole suite.
if not vllm_available():
    pytest.skip("vLLM is not installed", allow_module_level=True)

# Every 7th id from <|im_end|> (2, 9, ..., 93: 14 of the 100 ids) ends a response, so short runs of
# the random model give both early EOS and truncation. The folder's generation_config.json names
# the ids 5, 12, ..., 96 as its eos instead: they must NOT end a response (only eos_token_ids do).
MANY_EOS = list(range(2, 100, 7))
CONFIG_EOS = list(range(5, 100, 7))
TEXTS = ["hi", "What is 12+7?", "abc"]
# Longer than one KV block (128 tokens on CPU): only full blocks enter vLLM's prefix cache.
LONG_TEXT = "The quick brown fox jumps over the lazy dog. " * 4 + "Now: what is 12 + 7?"


def _tiny(path=None):
    # head_dim 64 / 2 = 32, a size vLLM's CPU attention supports; initializer_range 0.5 makes the
    # next-token distributions peaked, so top-k/top-p cut real mass and EOS ids are often chosen.
    return make_tiny_llama(
        path, seed=0, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=64, initializer_range=0.5
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_vllm")
    model, tok = _tiny(path)
    gen_config = json.loads((path / "generation_config.json").read_text())
    gen_config["eos_token_id"] = CONFIG_EOS
    (path / "generation_config.json").write_text(json.dumps(gen_config))
    model.eval()
    # The constructor must leave the process's RNGs, threads, dtype and grad mode as they were.
    saved_rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    threads = torch.get_num_threads()
    engine = VLLMRolloutEngine(
        str(path),
        tok,
        MANY_EOS,
        max_model_len=512,
        kv_cache_gb=0.05,
        cache_dir=str(tmp_path_factory.mktemp("vllm_cache")),
    )
    after = {
        "torch": torch.rand(3),
        "python": random.random(),
        "numpy": np.random.rand(),
        "threads": torch.get_num_threads(),
        "threads_before": threads,
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
    }
    torch.set_rng_state(saved_rng[0])
    random.setstate(saved_rng[1])
    np.random.set_state(saved_rng[2])
    yield {
        "path": str(path),
        "model": model,
        "tok": tok,
        "engine": engine,
        "hf": HFRolloutEngine(model, tok, MANY_EOS),
        "after_init": after,
    }
    engine.close()


def _prompts(tok, texts):
    return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]


def _logits(model, rollout):
    """fp32 logits [B, T, V] predicting each response token, from one full transformers forward."""
    with torch.no_grad():
        out = model(
            input_ids=rollout.input_ids(),
            attention_mask=rollout.attention_mask(),
            position_ids=rollout.position_ids(),
        ).logits
    P = rollout.prompt_ids.shape[1]
    return out[:, P - 1 : -1].float()


def _forward_logprobs(model, rollout, temperature, top_k=None, top_p=None):
    """Log-probs [B, T] of the response tokens under softmax(logits / T), then top-k, then top-p."""
    z = _logits(model, rollout) / temperature
    if top_k is not None:  # keep the k largest, renormalise
        kth = z.topk(top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p is not None:  # smallest set of largest tokens whose mass reaches top_p
        sorted_z, order = z.sort(dim=-1, descending=True)
        before = sorted_z.softmax(-1).cumsum(-1) - sorted_z.softmax(-1)  # mass strictly above each token
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= top_p)
        z = z.masked_fill(drop, float("-inf"))
    return z.log_softmax(-1).gather(-1, rollout.response_ids[..., None]).squeeze(-1)


def _abs_diff(model, rollout, temperature=0.7, **kw):
    """|forward log-prob - sampler log-prob| on the masked tokens (1-D)."""
    mask = rollout.response_mask.bool()
    return (_forward_logprobs(model, rollout, temperature, **kw)[mask] - rollout.sampler_logprobs[mask]).abs()


def _check_layout(r, prompts, G, max_new_tokens):
    B, P = len(prompts) * G, max(len(p) for p in prompts)
    T = r.response_ids.shape[1]
    assert r.prompt_ids.shape == r.prompt_mask.shape == (B, P)
    assert 1 <= T <= max_new_tokens and T == int(r.response_lengths.max())  # trimmed to the longest
    assert r.response_mask.shape == r.sampler_logprobs.shape == (B, T)
    assert r.response_mask.dtype == r.sampler_logprobs.dtype == torch.float32
    assert r.truncated.dtype == torch.bool and r.group_index.dtype == torch.long
    assert r.group_index.tolist() == [i for i in range(len(prompts)) for _ in range(G)]
    eos = set(MANY_EOS)
    for row in range(B):
        ids = prompts[row // G]
        n_pad = P - len(ids)
        assert r.prompt_ids[row].tolist() == [PAD_ID] * n_pad + ids  # left-padded
        assert r.prompt_mask[row].tolist() == [0] * n_pad + [1] * len(ids)
        n = int(r.response_lengths[row])
        tokens = r.response_ids[row].tolist()
        assert r.response_mask[row].tolist() == [1.0] * n + [0.0] * (T - n)
        assert tokens[n:] == [PAD_ID] * (T - n)  # pad after the first EOS
        assert not eos & set(tokens[: n - 1])  # no EOS before the last masked token
        if r.truncated[row]:
            assert n == max_new_tokens and tokens[n - 1] not in eos
        else:
            assert tokens[n - 1] in eos  # the EOS itself is in the response, inside the mask
        assert (r.sampler_logprobs[row, :n] < 0).all() and (r.sampler_logprobs[row, n:] == 0).all()


# ----------------------------------------------------------------------------- both engines


def test_both_engines_same_layout_and_logprobs_match_a_fp32_forward(setup):
    model, tok = setup["model"], setup["tok"]
    prompts = _prompts(tok, TEXTS + ["x"])
    kwargs = dict(group_size=4, temperature=0.7, max_new_tokens=6, generator_seed=3)
    rollouts = {
        "hf": setup["hf"].generate(prompts, **kwargs),
        "vllm": setup["engine"].generate(prompts, **kwargs),
    }
    for name, r in rollouts.items():
        _check_layout(r, prompts, 4, 6)
        assert any(r.truncated) and not all(r.truncated), name  # both stop cases occur
        assert r.group_size == 4 and r.sampling == SamplingParams(0.7, None, None, greedy=False)
        # Acceptance bound: < 1e-3 per token at T = 0.7; fp32 engines agree to ~1e-5.
        assert _abs_diff(model, r).max() < 1e-4, name
    hf, vl = rollouts["hf"], rollouts["vllm"]
    assert torch.equal(hf.prompt_ids, vl.prompt_ids) and torch.equal(hf.prompt_mask, vl.prompt_mask)
    assert torch.equal(hf.group_index, vl.group_index)


def test_only_eos_token_ids_end_a_response(setup):
    # The folder's generation_config.json names CONFIG_EOS as eos; vLLM would stop at them too,
    # the engine removes them: they may appear inside a response, and every response ends at one
    # of MANY_EOS or at max_new_tokens (_check_layout).
    tok = setup["tok"]
    prompts = _prompts(tok, TEXTS + ["x", "12+7=", "Hello"])
    r = setup["engine"].generate(prompts, group_size=4, temperature=1.0, max_new_tokens=16, generator_seed=0)
    _check_layout(r, prompts, 4, 16)
    inside = [
        t
        for row in range(r.batch_size)
        for t in r.response_ids[row, : int(r.response_lengths[row]) - 1].tolist()
    ]
    assert set(inside) & set(CONFIG_EOS)  # a generation_config eos id did not stop its response
    enders = {
        int(r.response_ids[row, int(r.response_lengths[row]) - 1])
        for row in range(r.batch_size)
        if not r.truncated[row]
    }
    assert len(enders) >= 3 and enders <= set(MANY_EOS)  # several different ids ended responses


def test_ignore_eos_runs_every_response_to_max_new_tokens(setup):
    tok = setup["tok"]
    prompts = _prompts(tok, TEXTS + ["x", "12+7=", "Hello"])
    r = setup["engine"].generate(
        prompts, group_size=4, temperature=1.0, max_new_tokens=16, generator_seed=0, ignore_eos=True
    )
    assert r.response_lengths.tolist() == [16] * r.batch_size
    assert not r.truncated.any() and bool(r.response_mask.all())
    assert set(r.response_ids[:, :-1].flatten().tolist()) & set(MANY_EOS)  # sampled as plain tokens
    assert _abs_diff(setup["model"], r, temperature=1.0).max() < 1e-3  # of the unmasked softmax


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(0.7, 5, None), (0.7, None, 0.8), (1.3, 10, 0.9)]
)
def test_truncated_sampling_logprobs_match(setup, temperature, top_k, top_p):
    model, tok = setup["model"], setup["tok"]
    r = setup["engine"].generate(
        _prompts(tok, TEXTS),
        group_size=4,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        max_new_tokens=8,
        generator_seed=1,
    )
    assert (r.sampling.top_k, r.sampling.top_p) == (top_k, top_p)
    assert _abs_diff(model, r, temperature, top_k=top_k, top_p=top_p).max() < 1e-4
    # Truncation changed the numbers: the untruncated log-probs are lower (less than 1 in mass).
    mask = r.response_mask.bool()
    plain = _forward_logprobs(model, r, temperature)
    assert (plain[mask] < r.sampler_logprobs[mask] - 1e-3).any()


def test_greedy_matches_hf_greedy_and_reports_raw_logprobs(setup):
    model, tok = setup["model"], setup["tok"]
    prompts = _prompts(tok, TEXTS)
    vl = setup["engine"].generate(prompts, group_size=2, greedy=True, temperature=0.5, max_new_tokens=6)
    hf = setup["hf"].generate(prompts, group_size=2, greedy=True, temperature=0.5, max_new_tokens=6)
    assert torch.equal(vl.response_ids, hf.response_ids) and torch.equal(vl.truncated, hf.truncated)
    logits, mask = _logits(model, vl), vl.response_mask.bool()
    assert torch.equal(logits.argmax(-1)[mask], vl.response_ids[mask])
    assert torch.equal(vl.response_ids[0], vl.response_ids[1])  # the G rows are copies
    # vLLM at temperature 0 reports log-softmax of the raw logits (T = 1), not of logits / 0.5.
    raw = logits.log_softmax(-1).gather(-1, vl.response_ids[..., None]).squeeze(-1)
    assert (raw[mask] - vl.sampler_logprobs[mask]).abs().max() < 1e-4
    assert vl.sampling.greedy and vl.sampling.temperature == 0.5


# ----------------------------------------------------------------------------- weight sync


def _noisy_copy(model, scale, seed):
    new = copy.deepcopy(model)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        for p in new.parameters():
            p.add_(scale * torch.randn_like(p))
    return new


def test_sync_weights_follows_new_weights_and_drops_stale_prefix_kv(setup, monkeypatch):
    model, tok, engine = setup["model"], setup["tok"], setup["engine"]
    prompts = _prompts(tok, [LONG_TEXT, "hi"])
    assert len(prompts[0]) > 128  # one full KV block, so the prompt enters the prefix cache
    kwargs = dict(group_size=2, temperature=0.7, max_new_tokens=8, generator_seed=4)
    engine.generate(prompts, **kwargs)  # fills the prefix cache under the old weights
    cached = engine.llm.generate([{"prompt_token_ids": prompts[0]}], use_tqdm=False)[0].num_cached_tokens
    assert cached >= 128  # the prefix cache is in use

    new = _noisy_copy(model, 0.3, seed=9)
    try:
        # Without clearing the prefix cache the prompt's KV would be the old weights': the
        # log-probs then follow neither model. This is what the test below guards against.
        with monkeypatch.context() as m:
            m.setattr(engine.llm, "reset_prefix_cache", lambda *_, **__: True)
            engine.sync_weights(new)
            stale = engine.generate(prompts, **kwargs)
        assert _abs_diff(new, stale).max() > 1.0  # measured ~26 on the long prompt's rows
        engine.llm.reset_prefix_cache()

        engine.sync_weights(new)
        r = engine.generate(prompts, **kwargs)
        assert _abs_diff(new, r).max() < 1e-3  # follows the new weights (larger logits: ~5e-5 here)
        assert _abs_diff(model, r).mean() > 0.1  # and not the old ones (the noise moved them far)
        out = engine.llm.generate([{"prompt_token_ids": prompts[0]}], use_tqdm=False)[0]
        assert out.num_cached_tokens >= 128  # caching works again, with KV of the new weights
    finally:
        engine.sync_weights(model)
    back = engine.generate(prompts, **kwargs)
    assert _abs_diff(model, back).max() < 1e-4


def test_sync_weights_pushes_merged_lora_without_changing_the_model(setup):
    from policygrad.models.loading import apply_lora

    model, tok, engine = setup["model"], setup["tok"], setup["engine"]
    peft_model = apply_lora(copy.deepcopy(model), rank=2, alpha=4)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(5)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)  # B = 0 at the start would make the merge a no-op
    before = {k: v.clone() for k, v in peft_model.state_dict().items()}
    prompts = _prompts(tok, TEXTS)
    kwargs = dict(group_size=2, temperature=0.7, max_new_tokens=8, generator_seed=6)
    try:
        peft_model.eval()
        engine.sync_weights(peft_model)
        r = engine.generate(prompts, **kwargs)
        assert _abs_diff(peft_model, r).max() < 1e-3  # the peft forward: W + (alpha / r) B A
        assert _abs_diff(model, r).mean() > 0.05  # the adapters changed the distribution
        after = peft_model.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    finally:
        engine.sync_weights(model)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"num_layers": 3}, ValueError, r"'model\.layers\.2\..*' is not a parameter of the engine's model"),
        ({"intermediate_size": 32}, ValueError, r"has shape \(32, 64\), the engine's model has \(64, 64\)"),
        ({"num_layers": 1}, ValueError, r"the model lacks 9 of the engine's weights"),
    ],
)
def test_sync_weights_rejects_another_architecture_before_copying(setup, change, error, match):
    tok, engine = setup["tok"], setup["engine"]
    kwargs = dict(
        seed=0, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=64, initializer_range=0.5
    )
    other, _ = make_tiny_llama(**{**kwargs, **change})
    with pytest.raises(error, match=match):
        engine.sync_weights(other)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        engine.sync_weights({"model.norm.weight": torch.ones(64)})
    from peft import LoraConfig, get_peft_model

    dora_config = LoraConfig(r=2, target_modules=["q_proj"], use_dora=True)
    dora = get_peft_model(copy.deepcopy(setup["model"]), dora_config)
    with pytest.raises(ValueError, match="uses DoRA"):
        engine.sync_weights(dora)
    # Nothing was copied: the engine still samples from the original weights.
    r = engine.generate(
        _prompts(tok, TEXTS), group_size=2, temperature=0.7, max_new_tokens=6, generator_seed=0
    )
    assert _abs_diff(setup["model"], r).max() < 1e-4


# ----------------------------------------------------------------------------- bf16 engine, lifetime


def test_bf16_engine_is_visibly_off_policy_and_closing_or_dropping_keeps_the_other_engine(setup, tmp_path):
    model, tok, engine = setup["model"], setup["tok"], setup["engine"]
    prompts = _prompts(tok, TEXTS + ["x"])
    kwargs = dict(group_size=4, temperature=0.7, max_new_tokens=12, generator_seed=2)
    bf16 = VLLMRolloutEngine(
        setup["path"],
        tok,
        MANY_EOS,
        dtype="bfloat16",
        max_model_len=512,
        kv_cache_gb=0.05,
        cache_dir=str(tmp_path),
    )
    try:
        r16 = bf16.generate(prompts, **kwargs)
        r32 = engine.generate(prompts, **kwargs)
        d16, d32 = _abs_diff(model, r16), _abs_diff(model, r32)
        # bf16 keeps 8 mantissa bits (relative error ~4e-3 per op), fp32 24: the sampler's
        # log-probs drift from the trainer's fp32 ones by orders of magnitude more.
        assert d16.mean() > 10 * d32.mean() and d16.mean() > 1e-3
        assert d16.mean() < 0.2  # still the same model (measured: bf16 ~0.05, fp32 ~1e-6)
        # A sync casts to the engine's dtype: same weights, same bf16 numbers as the folder's load.
        bf16.sync_weights(model)
        again = bf16.generate(prompts, **kwargs)
        assert torch.equal(again.response_ids, r16.response_ids)
        torch.testing.assert_close(again.sampler_logprobs, r16.sampler_logprobs, rtol=0, atol=1e-6)
    finally:
        bf16.close()
    bf16.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        bf16.generate(prompts, max_new_tokens=2)
    # vLLM's process-wide state is shared: closing one engine must not break another, nor must
    # dropping one without close.
    dropped = VLLMRolloutEngine(
        setup["path"], tok, MANY_EOS, max_model_len=64, kv_cache_gb=0.01, cache_dir=str(tmp_path)
    )
    dropped.generate(prompts, max_new_tokens=2)
    del dropped
    gc.collect()
    r = engine.generate(prompts, **kwargs)
    assert _abs_diff(model, r).max() < 1e-4


def test_constructor_restores_process_state(setup):
    after = setup["after_init"]
    torch.manual_seed(123)
    random.seed(123)
    np.random.seed(123)
    # vLLM seeds every global RNG and disables torch.set_num_threads; the engine undoes both.
    assert torch.equal(after["torch"], torch.rand(3))
    assert after["python"] == random.random() and after["numpy"] == np.random.rand()
    assert {"torch RNG", "python RNG", "numpy RNG", "torch.set_num_threads"} <= set(setup["engine"].restored)
    assert after["threads"] == after["threads_before"]
    assert after["dtype"] == torch.float32 and after["grad"]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert torch.get_num_threads() == threads + 1  # the real function again
    finally:
        torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- seeds


def test_generator_seed_decides_the_result_and_leaves_the_global_rng_alone(setup):
    tok, engine = setup["tok"], setup["engine"]
    prompts = _prompts(tok, TEXTS)
    kwargs = dict(group_size=4, temperature=1.0, max_new_tokens=8)
    torch.manual_seed(0)
    expected_draw = torch.rand(3)
    torch.manual_seed(0)
    a = engine.generate(prompts, generator_seed=7, **kwargs)
    assert torch.equal(torch.rand(3), expected_draw)  # the caller's stream did not move
    b = engine.generate(prompts, generator_seed=7, **kwargs)
    c = engine.generate(prompts, generator_seed=8, **kwargs)
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.sampler_logprobs, b.sampler_logprobs)
    assert a.response_ids.shape != c.response_ids.shape or not torch.equal(a.response_ids, c.response_ids)
    # Per-request seeds: prompt 0's samples do not depend on the other prompts in the batch.
    alone = engine.generate(prompts[:1], generator_seed=7, **kwargs)
    n = alone.response_ids.shape[1]
    assert torch.equal(alone.response_ids, a.response_ids[:4, :n]) and (a.response_mask[:4, n:] == 0).all()
    torch.testing.assert_close(alone.sampler_logprobs, a.sampler_logprobs[:4, :n], rtol=0, atol=1e-5)


def test_seeded_batch_larger_than_one_scheduler_step(setup):
    # 12 prompts of 400 tokens x 2 samples = 9,600 prefill tokens, over one step's budget (4,096 on
    # CPU): vLLM used to split a prompt's prefill over two steps and then rewind that request's
    # seeded generator, which a CPU generator cannot do ("CPU Generator does not use offset"). The
    # first prompt's samples must still be those it gets alone.
    engine = setup["engine"]
    prompts = [[(7 * i + j) % 90 + 5 for j in range(400)] for i in range(12)]
    kwargs = dict(group_size=2, temperature=1.0, max_new_tokens=4, generator_seed=3)
    batch = engine.generate(prompts, **kwargs)
    assert batch.response_ids.shape[0] == 24
    alone = engine.generate(prompts[:1], **kwargs)
    n = alone.response_ids.shape[1]
    assert torch.equal(alone.response_ids, batch.response_ids[:2, :n])


def test_global_seed_makes_rollouts_reproducible_without_generator_seed(setup):
    tok, engine = setup["tok"], setup["engine"]
    prompts = _prompts(tok, TEXTS)
    torch.manual_seed(42)
    a = engine.generate(prompts, group_size=3, max_new_tokens=8)
    after_a = torch.rand(2)
    torch.manual_seed(42)
    b = engine.generate(prompts, group_size=3, max_new_tokens=8)
    torch.manual_seed(43)
    c = engine.generate(prompts, group_size=3, max_new_tokens=8)
    assert torch.equal(a.response_ids, b.response_ids)
    assert a.response_ids.shape != c.response_ids.shape or not torch.equal(a.response_ids, c.response_ids)
    # The only use of the global stream is one draw of n = 3 request seeds.
    torch.manual_seed(42)
    torch.randint(0, 2**62, (3,), dtype=torch.long)
    assert torch.equal(torch.rand(2), after_a)


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"group_size": 0}, ValueError, "group_size must be >= 1"),
        ({"group_size": 2.0}, TypeError, "group_size must be an int"),
        ({"temperature": 0.0}, ValueError, "temperature must be a finite number > 0"),
        ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, ValueError, "top_k must be >= 0"),
        ({"top_k": 2.5}, TypeError, "top_k must be an int or None"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1"),
        ({"max_new_tokens": 600}, ValueError, r"\(600\) exceeds the engine's max_model_len of 512"),
        ({"generator_seed": 1.5}, TypeError, "generator_seed must be an int or None"),
    ],
)
def test_bad_generate_arguments(setup, kwargs, error, match):
    args = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=match):
        setup["engine"].generate(_prompts(setup["tok"], ["hi"]), **args)


def test_bad_prompts(setup):
    engine = setup["engine"]
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        engine.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] is empty"):
        engine.generate([[5, 6], []], max_new_tokens=4)
    with pytest.raises(TypeError, match=r"prompt_token_ids\[0\] must be a list of ints"):
        engine.generate([["a"]], max_new_tokens=4)
    with pytest.raises(TypeError, match="list of token-id lists"):
        engine.generate("hello", max_new_tokens=4)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"dtype": "fp8"}, ValueError, r"dtype must be one of \['bfloat16', 'float16', 'float32'\]"),
        ({"eos_token_ids": []}, ValueError, "eos_token_ids is empty"),
        ({"max_model_len": 1024}, ValueError, r"max_model_len must be in 1 \.\. 512"),
        ({"max_model_len": 0}, ValueError, r"max_model_len must be in 1 \.\. 512"),
        ({"max_model_len": 64.0}, TypeError, "max_model_len must be an int"),
        ({"kv_cache_gb": 0}, ValueError, "kv_cache_gb must be > 0"),
        ({"gpu_memory_utilization": 1.5}, ValueError, r"gpu_memory_utilization must be in \(0, 1\]"),
        ({"model_path": "/nonexistent/folder"}, ValueError, "is not a model folder with a config.json"),
    ],
)
def test_bad_constructor_arguments(setup, kwargs, error, match):
    # All checked before vLLM starts.
    args = {
        "model_path": setup["path"],
        "tokenizer": setup["tok"],
        "eos_token_ids": MANY_EOS,
        "max_model_len": 64,
        **kwargs,
    }
    with pytest.raises(error, match=match):
        VLLMRolloutEngine(**args)


def test_missing_vllm_names_the_install_route(setup, monkeypatch):
    import policygrad.rollout.vllm as module

    monkeypatch.setattr(module, "vllm_available", lambda: False)
    with pytest.raises(ImportError, match="install the vllm extra: see docs/engines.md"):
        VLLMRolloutEngine(setup["path"], setup["tok"], MANY_EOS, max_model_len=64)


@pytest.mark.parametrize("trained", [["lm_head"], ["embed_tokens"], ["lm_head", "embed_tokens"]])
def test_sync_weights_refuses_a_trained_copy_of_a_tied_weight_before_copying(setup, trained):
    """vLLM built this tied model with one weight for the embedding and the head: pushed an
    adapter's separately trained copy, it went on sampling with the other (logits off by up to
    29.7 with lm_head trained), so the sync is refused before anything is copied."""
    from peft import LoraConfig, get_peft_model

    model, tok, engine = setup["model"], setup["tok"], setup["engine"]
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], modules_to_save=trained)
    peft_model = get_peft_model(copy.deepcopy(model), lora)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(5)
        for name, p in peft_model.named_parameters():
            if "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.5)
    with pytest.raises(ValueError, match=r"which this model ties and vLLM loaded as one weight"):
        engine.sync_weights(peft_model)
    prompts = _prompts(tok, TEXTS)
    r = engine.generate(prompts, group_size=2, temperature=0.7, max_new_tokens=8, generator_seed=6)
    assert _abs_diff(model, r).max() < 1e-3  # still the engine's own weights


class _Counter(Environment):
    """Says "ok N" after turn N; done after the third turn."""

    def reset(self, row, *, seed):  # noqa: ARG002 - the protocol's argument
        self.turn = 0
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, action):  # noqa: ARG002 - the protocol's argument
        self.turn += 1
        return StepResult([{"role": "user", "content": f"ok {self.turn}"}], done=self.turn >= 3)


@pytest.mark.parametrize("name", ["hf", "engine"])
def test_episodes_on_either_engine_train_on_what_was_sampled(setup, name):
    # Three-turn episodes, observations between the turns: the training forward of the assembled
    # sequence (observations seen, not scored) gives the sampler's log-probs at every action token,
    # which holds only if the ids, their positions and the masks are exactly what was sampled.
    model, tok = setup["model"], setup["tok"]
    tok.chat_template = CHAT_TEMPLATE
    runner = EpisodeRunner(
        _Counter,
        setup[name],
        tok,
        EpisodeLimits(max_turns=3, max_new_tokens=5, max_context=512),
        end_ids=MANY_EOS,
        pad_id=tok.pad_token_id,
    )
    rows = [{"prompt": t} for t in TEXTS]
    prompts, rollout, episodes, _ = runner.run(
        rows, group_size=2, seeds=[1, 2, 3], per_prompt_seeds=True, sampling={"temperature": 0.7}
    )
    assert rollout.observation_mask is not None and rollout.observation_mask.sum() > 0
    assert set(episodes.stop_reasons) <= {"done", "length"} and "done" in episodes.stop_reasons
    with torch.no_grad():
        trained, _ = policy_logprobs(model, rollout)
    action = rollout.response_mask > 0
    assert (trained - rollout.sampler_logprobs)[action].abs().max() < 1e-4
    assert rollout.sampler_logprobs[rollout.observation_mask > 0].abs().sum() == 0
    for row in range(rollout.batch_size):  # every sequence starts with its row's own prompt
        assert rollout.prompt_ids[row, -len(prompts[row // 2]) :].tolist() == prompts[row // 2]


def test_a_generate_call_from_a_background_thread_samples_what_the_main_thread_does(setup):
    # rollout.max_staleness runs the engine in the pipeline's thread: with per-prompt seeds a
    # call samples the same tokens and log-probs whichever thread makes it.
    engine, tok = setup["engine"], setup["tok"]
    prompts = _prompts(tok, TEXTS)
    kwargs = {"group_size": 2, "max_new_tokens": 6, "temperature": 0.7, "prompt_seeds": [11, 12, 13]}
    here = engine.generate(prompts, **kwargs)
    out = {}
    threads = torch.get_num_threads()

    def generate():
        # torch's thread count is per thread; the rollouts' worker thread takes the trainer's
        # before each job (vLLM's CPU attention refuses a count that differs from its plan's)
        torch.set_num_threads(threads)
        out.update(r=engine.generate(prompts, **kwargs))

    thread = threading.Thread(target=generate)
    thread.start()
    thread.join()
    there = out["r"]
    assert torch.equal(here.response_ids, there.response_ids)
    assert torch.equal(here.sampler_logprobs, there.sampler_logprobs)


def test_a_model_vllm_cannot_run_is_one_error_line_naming_the_engine_option(tmp_path, capsys):
    """head_dim 32 / 4 = 8, a size vLLM's CPU attention kernels lack: vLLM loaded the model and
    failed at the first step's sampling with its own traceback ("Unsupported CPU attention
    configuration"). Now the engine fails at start and train / eval say which option to change."""
    if torch.cuda.is_available():
        pytest.skip("the refused head size is a limit of vLLM's CPU backend")
    from policygrad.cli import main
    from policygrad.config.train import ConfigError, load_config
    from policygrad.rollout.vllm import VLLMStartError
    from policygrad.run import Run
    from tests.training import tiny_overrides

    path = tmp_path / "head_dim_8"
    _, tok = make_tiny_llama(path, seed=0)
    refused = r"^vLLM could not start on this model: RuntimeError: Unsupported CPU attention"
    with pytest.raises(VLLMStartError, match=refused):
        VLLMRolloutEngine(str(path), tok, [2], max_model_len=64, kv_cache_gb=0.05, cache_dir=str(tmp_path))

    assert main(["eval", "--model", str(path), "--limit", "1", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err  # vLLM's progress bars and notes too
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(
        "error: --engine auto chose the vllm engine (vllm is installed), which cannot run this model: "
        "vLLM could not start on this model: RuntimeError: Unsupported CPU attention configuration"
    )
    assert lines[0].endswith("; use --engine hf")

    tree = tiny_overrides(str(path), "answer_correctness", tmp_path / "run", rollout={"engine": "vllm"})
    with pytest.raises(ConfigError) as info:
        run = Run(load_config(None, tree))
        try:
            run.train()
        finally:
            run.close()
    message = str(info.value)
    assert message.startswith("rollout.engine=vllm chose the vllm engine, which cannot run this model: ")
    assert message.endswith("; use rollout.engine=hf") and "\n" not in message
