"""The seeds a run derives from its one config seed: the formulas, and that a prompt's seed
depends only on (run, step, round, position)."""

from __future__ import annotations

import hashlib

import pytest
import torch

from policygrad.seeds import Seeds, offset_seed, seeded_torch

pytestmark = pytest.mark.unit


def test_offset_seed_formula():
    # 3 * 1_000_003 + 5 = 3_000_014; base 0 gives k itself.
    assert offset_seed(3, 5) == 3_000_014
    assert offset_seed(0, 7) == 7


def test_offset_seeds_of_two_bases_do_not_collide_below_the_prime():
    # base * P + k with 0 <= k < P is base's "digit" in base P: unique for every (base, k).
    seen = {offset_seed(base, k) for base in range(4) for k in (0, 1, 999_999, 1_000_002)}
    assert len(seen) == 16
    assert offset_seed(1, 0) == offset_seed(0, 1_000_003)  # the bound is real: k = P is base + 1


def test_step_update_and_evaluation_seeds():
    seeds = Seeds(run=2)
    # step/evaluation: 2 * 1_000_003 + 9 = 2_000_015; update: 2 * 7919 + 9 = 15_847.
    assert seeds.step(9) == 2_000_015
    assert seeds.evaluation(9) == 2_000_015
    assert seeds.update(9) == 15_847
    assert Seeds(run=0).update(4) == 4


def test_prompt_seeds_are_the_sha256_of_run_step_round_and_position():
    got = Seeds(run=1).prompts(step=3, round_index=0, n=2)
    # The first 8 bytes of SHA-256("1:3:0:i") as a little-endian integer, shifted right by 2.
    want = [
        int.from_bytes(hashlib.sha256(f"1:3:0:{i}".encode()).digest()[:8], "little") >> 2 for i in range(2)
    ]
    assert got == want
    assert all(0 <= s < 2**62 for s in got)


def test_a_prompt_seed_depends_only_on_run_step_round_and_position():
    seeds = Seeds(run=5)
    # The same position in a longer batch (another world size, or more prompts per step) keeps
    # its seed: the list is a prefix of any longer one.
    assert seeds.prompts(4, 1, 8)[:3] == seeds.prompts(4, 1, 3)
    assert Seeds(run=5).prompts(4, 1, 3) == seeds.prompts(4, 1, 3)  # no hidden state
    base = seeds.prompts(4, 1, 3)
    # Changing any one of run, step, round changes every seed; positions differ from each other.
    for other in (Seeds(run=6).prompts(4, 1, 3), seeds.prompts(5, 1, 3), seeds.prompts(4, 2, 3)):
        assert all(a != b for a, b in zip(base, other))
    assert len(set(base)) == 3
    assert seeds.prompts(4, 1, 0) == []


def test_seeded_torch_draws_what_the_seed_draws_and_leaves_the_stream_as_it_was():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    with seeded_torch(11):
        inside = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's stream goes on as if nothing ran
    assert torch.equal(inside, torch.rand(3, generator=torch.Generator().manual_seed(11)))
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(5)))
