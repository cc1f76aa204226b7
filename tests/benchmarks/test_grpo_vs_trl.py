"""benchmarks/grpo_vs_trl.py (and learn_vs_trl.py, which shares it): TRL's default precision is
refused, saying why and what to pass, only where the CPU would emulate it."""

from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.unit

BENCH = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks"
)


@pytest.fixture
def gvt(monkeypatch):
    monkeypatch.syspath_prepend(BENCH)  # the script imports _common by its bare name
    import grpo_vs_trl

    return grpo_vs_trl


def test_trls_default_bf16_is_refused_only_where_the_cpu_emulates_it(gvt):
    # no bf16 in the overrides: TRL would run GRPOConfig's default, bf16 autocast
    why = gvt.slow_trl_precision({}, fast_bf16=False)
    assert "emulated on this CPU" in why and "--trl-override bf16=false" in why
    assert gvt.slow_trl_precision({}, fast_bf16=True) is None  # AVX512-BF16 or AMX: measured as is
    # an explicit choice is the user's: fp32, or bf16 anyway, or fp16
    for overrides in ({"bf16": False}, {"bf16": True}, {"fp16": True}):
        assert gvt.slow_trl_precision(overrides, fast_bf16=False) is None


def test_the_refusal_is_one_argparse_error(gvt, capsys, monkeypatch):
    import argparse

    monkeypatch.setattr(gvt, "slow_trl_precision", lambda overrides: None if overrides else "slow here")
    parser = argparse.ArgumentParser(prog="grpo_vs_trl.py")
    gvt.refuse_slow_trl_precision(parser, ["bf16=false"])  # passes
    with pytest.raises(SystemExit) as stop:
        gvt.refuse_slow_trl_precision(parser, [])
    assert stop.value.code == 2
    assert capsys.readouterr().err.strip().endswith("error: slow here")
