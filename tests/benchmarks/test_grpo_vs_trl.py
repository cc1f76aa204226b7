"""benchmarks/grpo_vs_trl.py (and learn_vs_trl.py, which shares it): TRL's default precision is
refused, saying why and what to pass, only where the CPU would emulate it; the roofline's floor
line."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture
def gvt(import_script):
    return import_script("grpo_vs_trl")


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


def test_the_floor_line_divides_each_sides_roofline_by_trls_measured_step(gvt):
    # policygrad: 18 GFLOP at 1e9 FLOP/s = 18 s; TRL: 30 GFLOP = 30 s; TRL measured 40 s
    peaks = {"fp32_square_flops": 1e9, "copy_bytes_per_s": 1e9}

    def side(gflop, step):
        return {
            "phases": {
                "forward": {"seconds": step, "gflop": gflop, "gb": math.nan, "matmul_peak_dtype": "float32"}
            }
        }

    run = {
        "beta": 0.04,
        "sides": {"policygrad": {"summary": {"step": 20.0}}, "trl": {"summary": {"step": 40.0}}},
        "roofline": {"policygrad": side(18.0, 20.0), "trl": side(30.0, 40.0)},
    }
    line = gvt.floor_line(run, peaks)
    assert "beta = 0.04" in line
    assert "policygrad 18.00 s (0.45x TRL's measured 40.00 s)" in line
    assert "TRL 30.00 s (0.75x TRL's measured 40.00 s)" in line
    assert gvt.floor_line(run, None) == ""  # no peaks measured: no line
