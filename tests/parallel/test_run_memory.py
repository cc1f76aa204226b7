"""The run's memory plan (:func:`plan_run`): every line worked by hand on a small shape, what each
option adds or removes, and the refusal of a plan that does not fit (:func:`check_run_fits`)."""

from __future__ import annotations

import dataclasses

import pytest

from policygrad.config.train import ConfigError, load_config
from policygrad.parallel.footprint import ModelShape
from policygrad.parallel.run_memory import (
    PROCESS_BYTES,
    VLLM_RUNTIME_BYTES,
    VLLM_WORKING_BYTES_PER_TOKEN,
    check_run_fits,
    plan_run,
    train_tokens,
)

pytestmark = pytest.mark.unit

# P 1000 parameters; H 8, I 16, 2 heads, 2 layers, one KV head of width 4, V 32
SHAPE = ModelShape(
    params=1000,
    vocab_size=32,
    num_layers=2,
    num_kv_heads=1,
    head_dim=4,
    hidden_size=8,
    intermediate_size=16,
    num_heads=2,
    linear_shapes=[("layers.0.q_proj", 8, 8), ("layers.1.q_proj", 8, 8)],
)


def _cfg(**sections):
    tree = {
        "model": {"name": "no/such-model-is-ever-read"},
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 6, "vllm_kv_cache_gb": 0.5},
        "optim": {"micro_batch_size": 8},
    }
    for key, value in sections.items():
        tree[key] = {**tree.get(key, {}), **value} if isinstance(value, dict) else value
    return load_config(None, tree)


def _plan(cfg=None, *, engine="vllm", precision="fp32", prompt_tokens=10, shape=SHAPE):
    return plan_run(cfg or _cfg(), shape, prompt_tokens=prompt_tokens, precision=precision, engine=engine)


def test_train_tokens_count_each_prompt_once_per_group():
    # 8 sequences of 4 per prompt: 2 prompts x 10 + 8 responses x 6 = 68
    assert train_tokens(8, 4, 10, 6) == 68
    # 3 sequences of a group of 8: one prompt, 10 + 3 x 6 = 28
    assert train_tokens(3, 8, 10, 6) == 28
    # group size 1: every sequence its own prompt, 4 x (10 + 6) = 64
    assert train_tokens(4, 1, 10, 6) == 64


def test_every_line_of_the_default_plan_worked_by_hand():
    plan = _plan()
    lines = {it.component: it.bytes for it in plan.items}
    # fp32: 16 B/param (weight, grad, two AdamW moments), vLLM's copy 4 B/param, 1 B/param push
    assert lines["policy"] == 16_000
    assert lines["vLLM weights"] == 4_000
    assert lines["weight push buffers"] == 1_000
    assert lines["vLLM KV cache"] == 2**29  # 0.5 GiB
    assert lines["process"] == PROCESS_BYTES and lines["vLLM runtime"] == VLLM_RUNTIME_BYTES
    # sampling: vLLM's prefill of B 8 x 10 prompt tokens at the measured bytes per token
    assert lines["sampling"] == 8 * 10 * VLLM_WORKING_BYTES_PER_TOKEN
    # training: 68 packed tokens; a packed row's mask 10 + min(4 x 6, 512) = 34 positions;
    # per layer and token (fp32: r = c = 4, q = 1): 3*8*4 + 2*4 + 8*4 + 3*8*4 + 8*4 + 2*4 + 34*4
    # + 2*16*4 = 96 + 8 + 32 + 96 + 32 + 8 + 136 + 128 = 536; 2 layers + final norm 8*4 + 4 = 1108
    assert lines["training micro-batch"] == 68 * 1108
    resident = 16_000 + 4_000 + 1_000 + 2**29 + PROCESS_BYTES + VLLM_RUNTIME_BYTES
    assert plan.peak_bytes == resident + 8 * 10 * VLLM_WORKING_BYTES_PER_TOKEN
    assert "reference" not in lines and "critic" not in lines
    assert (plan.sequences, plan.seq_len, plan.micro_tokens) == (8, 16, 68)


def test_what_each_option_adds():
    base = {it.component: it.bytes for it in _plan().items}
    # a KL in the loss keeps a float32 reference: 4 B/param
    kl = {it.component: it.bytes for it in _plan(_cfg(kl={"beta": 0.04, "placement": "loss"})).items}
    assert kl["reference"] == 4_000
    # PPO trains a critic of the policy's size: 16 B/param more
    ppo = {it.component: it.bytes for it in _plan(_cfg(algorithm="ppo")).items}
    assert ppo["critic"] == 16_000
    # and the critic's forward is padded: 8 x T 16 = 128 tokens, each masking a row of 16:
    # per layer 96 + 8 + 32 + 96 + 32 + 8 + 16*4 + 128 = 464; 2 layers + 36 = 964 B/token
    assert ppo["critic micro-batch"] == 128 * 964 and "critic micro-batch" not in base
    # LoRA r 2 on two 8 -> 8 layers: 2 x 2 x (8 + 8) = 64 adapter parameters at 16 B, the base 4 B
    lora = {it.component: it.bytes for it in _plan(_cfg(model={"lora": {"rank": 2}})).items}
    assert lora["policy (LoRA adapters)"] == 64 * 16 and lora["policy (base)"] == 4_000
    assert "policy" not in lora
    # and each push to vLLM merges the adapters into a copy of the weights: 4 B/param
    assert lora["merged weights"] == 4_000 and "merged weights" not in base
    # LoRA with a KL: the base with the adapters off is the reference, no copy
    lora_kl = _plan(_cfg(model={"lora": {"rank": 2}}, kl={"beta": 0.04, "placement": "loss"}))
    assert "reference" not in {it.component for it in lora_kl.items}
    # bf16-mixed: the training line gains the bf16 copies of the weights, 2 B/param
    mixed = {it.component: it.bytes for it in _plan(precision="bf16-mixed").items}
    assert mixed["training micro-batch"] > 2_000 and mixed["policy"] == 16_000
    # the hf engine has no copy, no reserved cache; its working memory is generate's KV cache:
    # B 8 x T 16 x 2 (K, V) x 2 layers x width 4 x 4 B (fp32)
    hf = {it.component: it.bytes for it in _plan(engine="hf").items}
    assert "vLLM weights" not in hf and "vLLM KV cache" not in hf
    assert hf["sampling"] == 8 * 16 * 2 * 2 * 4 * 4
    # a twice larger KV cache adds its GiB
    kv = {it.component: it.bytes for it in _plan(_cfg(rollout={"vllm_kv_cache_gb": 1.0})).items}
    assert kv["vLLM KV cache"] - base["vLLM KV cache"] == 2**29


def test_checkpointing_lowers_the_floor_and_true_lowers_the_peak():
    def plan(setting):
        return _plan(
            _cfg(rollout={"max_new_tokens": 4000}, model={"gradient_checkpointing": setting}), engine="hf"
        )

    auto, on, off = plan("auto"), plan(True), plan(False)
    train = [{it.component: it.bytes for it in p.items}["training micro-batch"] for p in (auto, on, off)]
    # checkpointing keeps each layer's input (L x H x r = 64 B/token) and one layer's activations
    assert train[1] < train[2] == train[0]
    assert on.checkpointing and not auto.checkpointing
    assert off.floor_bytes == off.peak_bytes  # false: nothing to turn on
    assert auto.floor_bytes == on.peak_bytes < auto.peak_bytes  # auto can turn it on


def test_micro_batches_and_ranks_divide_the_work():
    # micro-batch 2 of a group of 4: one prompt, 10 + 2 x 6 = 22 tokens
    assert _plan(_cfg(optim={"micro_batch_size": 2})).micro_tokens == 22
    # 2 ranks: 4 sequences each
    plan = plan_run(_cfg(), SHAPE, prompt_tokens=10, precision="fp32", engine="vllm", world_size=2)
    assert plan.sequences == 4


def test_a_plan_that_fits_passes_and_one_that_does_not_names_what_would_fit():
    big = dataclasses.replace(SHAPE, params=1_000_000_000)
    cfg = _cfg()
    plan = _plan(cfg, shape=big)
    check_run_fits(cfg, plan, available_bytes=plan.floor_bytes)  # exactly enough: no error
    # 1e9 params: the policy 16 GB, vLLM's copy 4 GB, pushes 1 GB; with LoRA the policy is 4 GB
    with pytest.raises(ConfigError) as err:
        check_run_fits(cfg, plan, available_bytes=plan.floor_bytes - 10**9)
    text = str(err.value)
    assert "planned to need" in text and "policygrad memory --config" in text
    assert "model.lora.rank=16" in text  # 12 GB less than the policy's 16
    assert "optim.micro_batch_size" not in text  # a smaller micro-batch saves nothing here
    # two processes on the host need twice as much
    with pytest.raises(ConfigError, match=r"\(2 processes\)"):
        check_run_fits(cfg, plan, available_bytes=plan.floor_bytes, processes=2)
    # far too little: no single option is enough, and the message says so
    with pytest.raises(ConfigError, match="no single option fits"):
        check_run_fits(cfg, plan, available_bytes=10**8)


def test_a_multi_turn_episode_is_planned_at_its_tightest_limit_and_the_context():
    env = {"name": "builtin:guess"}
    # 4 turns x (6 new + 5 observation) = 44 after the prompt
    assert _plan(_cfg(env=env, rollout={"max_observation_tokens": 5})).seq_len == 10 + 44
    # max_episode_tokens 20 is tighter; 1000 is not
    for limit, seq_len in ((20, 30), (1000, 54)):
        rollout = {"max_observation_tokens": 5, "max_episode_tokens": limit}
        assert _plan(_cfg(env=env, rollout=rollout)).seq_len == seq_len
    # and never past the model's context: 32 positions leave 22 after a 10-token prompt
    short = dataclasses.replace(SHAPE, max_positions=32)
    assert _plan(_cfg(env=env, rollout={"max_observation_tokens": 5}), shape=short).seq_len == 32


def test_the_floor_leaves_out_vllms_measured_sampling_line():
    # the refusal rests on arithmetic: resident lines + the checkpointed micro-batch (68 x 636 B)
    plan = _plan()
    resident = sum(it.bytes for it in plan.items if it.state == "resident")
    assert plan.floor_bytes == resident + 68 * 636
    # the hf engine's KV cache (8 x 16 x 2 x 2 x 4 x 4 = 8192) is arithmetic, so it counts
    hf = _plan(engine="hf")
    resident = sum(it.bytes for it in hf.items if it.state == "resident")
    assert hf.floor_bytes == resident + max(8192, 68 * 636)


def test_fsdp_shards_the_trained_models_and_never_names_lora():
    plan = plan_run(
        _cfg(kl={"beta": 0.04, "placement": "loss"}),
        SHAPE,
        prompt_tokens=10,
        precision="fp32",
        engine="hf",
        world_size=2,
        sharded=True,
    )
    lines = {it.component: it.bytes for it in plan.items}
    assert lines["policy"] == 8_000 and lines["reference"] == 2_000  # 16 000 and 4 000 over 2 ranks
    with pytest.raises(ConfigError) as err:
        check_run_fits(_cfg(), plan, available_bytes=10**6)
    assert "model.lora.rank" not in str(err.value)


def test_the_critics_own_lora_and_micro_batch_are_planned():
    cfg = _cfg(algorithm="ppo", critic={"lora": {"rank": 2}, "micro_batch_size": 2})
    lines = {it.component: it.bytes for it in _plan(cfg).items}
    # base 4 B/param; adapters 2 x 2 x (8 + 8) = 64 at 16 B
    assert lines["critic (base)"] == 4_000 and lines["critic (LoRA adapters)"] == 64 * 16
    assert lines["critic micro-batch"] == 2 * 16 * 964  # 2 sequences x T 16, 964 B/token


def test_remedies_are_judged_per_rank_and_one_the_config_refuses_is_skipped():
    cfg = _cfg(rollout={"max_new_tokens": 4000}, model={"gradient_checkpointing": False})

    def plan(c, world):
        return plan_run(c, SHAPE, prompt_tokens=10, precision="fp32", engine="hf", world_size=world)

    two = plan(cfg, 2)
    auto = _cfg(rollout={"max_new_tokens": 4000}, model={"gradient_checkpointing": "auto"})
    # enough for checkpointing with each rank's 4 sequences, not with all 8 in one process
    available = plan(auto, 2).floor_bytes
    assert plan(auto, 1).floor_bytes > available
    with pytest.raises(ConfigError) as err:
        check_run_fits(cfg, two, available_bytes=available)
    assert "model.gradient_checkpointing=auto" in str(err.value)
    # rollout.dtype set: the hf-engine remedy is a config the config refuses, so it is left out,
    # and the error is the plan's own
    vllm_cfg = _cfg(rollout={"dtype": "float32"})
    plan = _plan(vllm_cfg)
    with pytest.raises(ConfigError, match="planned to need at least") as err:
        check_run_fits(vllm_cfg, plan, available_bytes=plan.floor_bytes - 2**28)
    assert "rollout.engine=hf" not in str(err.value) and "rollout.vllm_kv_cache_gb=0.25" in str(err.value)


def test_an_engine_object_given_to_the_run_is_not_priced_as_the_configs_engine():
    # rollout.engine=vllm in the config, but the run was given its own engine object: no vLLM
    # lines, a sampling line of 0 that says why, and remedies replanned with the given engine
    cfg = _cfg(rollout={"engine": "vllm"})
    given = _plan(cfg, engine="given")
    lines = {it.component: it for it in given.items}
    assert not any(name.startswith(("vLLM", "weight push")) for name in lines)
    assert lines["sampling"].bytes == 0 and "engine given to the run" in lines["sampling"].note
    vllm = _plan(cfg, engine="vllm")
    # exactly what the vLLM lines add: runtime, weights 4 B/param, KV cache 0.5 GiB, pushes 1 B/param
    assert vllm.floor_bytes - given.floor_bytes == VLLM_RUNTIME_BYTES + 4_000 + 2**29 + 1_000
    # 1 byte short: LoRA's 12 KB saving fits with the given engine's replan; priced as vLLM
    # (0.5 GiB more) no option would, and the message would say "no single option fits"
    with pytest.raises(ConfigError) as err:
        check_run_fits(cfg, given, available_bytes=given.floor_bytes - 1)
    assert "model.lora.rank=16" in str(err.value) and "no single option" not in str(err.value)


def test_a_reward_model_adds_its_frozen_weights_at_the_runs_dtype_on_every_rank():
    # 500 parameters: 2,000 B in float32, 1,000 B in bf16; not sharded by fsdp (every rank scores)
    base = _plan()
    plan = plan_run(
        _cfg(), SHAPE, prompt_tokens=10, precision="fp32", engine="vllm", reward_models=(("rm", 500),)
    )
    lines = [it for it in plan.items if it.component == "reward model"]
    assert [(it.bytes, it.params, it.bytes_per_param) for it in lines] == [(2_000, 500, 4)]
    assert "reward_model:rm" in lines[0].note
    assert plan.floor_bytes - base.floor_bytes == 2_000 and plan.peak_bytes - base.peak_bytes == 2_000
    two = plan_run(
        _cfg(),
        SHAPE,
        prompt_tokens=10,
        precision="fp32",
        engine="vllm",
        model_dtype_bytes=2,
        reward_models=(("a", 500), ("b", 300)),
    )
    assert [it.bytes for it in two.items if it.component == "reward model"] == [1_000, 600]
    sharded = plan_run(
        _cfg(),
        SHAPE,
        prompt_tokens=10,
        precision="fp32",
        engine="vllm",
        world_size=2,
        sharded=True,
        reward_models=(("rm", 500),),
    )
    assert [it.bytes for it in sharded.items if it.component == "reward model"] == [2_000]


def test_a_packed_row_holds_whole_responses_and_at_least_one():
    # The mask row of a packed micro-batch: the prompt plus as many whole responses of a group as
    # fit 512 tokens. Per layer and token in fp32 the row adds 4 B per position (see the worked
    # default plan: 400 B without it), so the line is tokens x (2 x (400 + 4 x row) + 36).
    def line(new_tokens):
        cfg = _cfg(rollout={"max_new_tokens": new_tokens})
        plan = _plan(cfg, engine="hf", shape=dataclasses.replace(SHAPE, max_positions=None))
        return plan.micro_tokens, {it.component: it.bytes for it in plan.items}["training micro-batch"]

    # 300 tokens: one response a row (two would be 600 > 512): row 10 + 300, not 10 + 512
    tokens, got = line(300)
    assert got == tokens * (2 * (400 + 4 * 310) + 36)
    # 600 tokens: longer than a row, it gets its own: 10 + 600, not 10 + 512
    tokens, got = line(600)
    assert got == tokens * (2 * (400 + 4 * 610) + 36)
    # 100 tokens: 5 whole responses fit, but a group has 4: 10 + 400
    tokens, got = line(100)
    assert got == tokens * (2 * (400 + 4 * 410) + 36)


def test_bf16_pure_prices_the_hf_engines_cache_and_copy_in_bf16():
    # bf16-pure: no autocast, but the weights and generate's KV cache are bf16 (2 B)
    cfg = _cfg(rollout={"max_staleness": 1})
    pure = {it.component: it.bytes for it in _plan(cfg, engine="hf", precision="bf16-pure").items}
    fp32 = {it.component: it.bytes for it in _plan(cfg, engine="hf").items}
    # B 8 x T 16 x 2 (K, V) x 2 layers x width 4 x 2 B, half of fp32's
    assert pure["sampling"] == 8 * 16 * 2 * 2 * 4 * 2 == fp32["sampling"] // 2
    assert pure["sampler copy"] == 2_000 and fp32["sampler copy"] == 4_000


def test_vllms_prefill_is_never_negative_when_the_context_cuts_the_response():
    # a 12-token context after a 10-token prompt leaves 2 response tokens of the 6 asked for: the
    # prefill is the prompt's 10 tokens (seq_len 12 - min(6, 2))
    plan = _plan(shape=dataclasses.replace(SHAPE, max_positions=12))
    assert plan.seq_len == 12
    assert {it.component: it.bytes for it in plan.items}["sampling"] == 8 * 10 * VLLM_WORKING_BYTES_PER_TOKEN


def test_a_remedy_the_model_cannot_take_is_skipped_not_raised():
    cfg = _cfg()
    plan = _plan(cfg)

    def replan(c):
        if c.model.lora.rank:
            raise ValueError("no linear layer to adapt")
        return _plan(c)

    with pytest.raises(ConfigError, match="planned to need") as err:
        check_run_fits(cfg, plan, available_bytes=plan.floor_bytes - 1, replan=replan)
    assert "model.lora.rank" not in str(err.value)
