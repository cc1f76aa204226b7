"""benchmarks/gpu_check.py on the CPU with its tiny shape: the GPU path's code runs end to end,
every response has the fixed length, and at lr 1e-6 the float32 master weights move while their
bf16 roundings mostly do not (the defect bf16 weights stepped by AdamW had)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_check.py")


def test_gpu_check_runs_on_the_tiny_shape(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    out = tmp_path / "report.json"
    argv = ["--shape", "tiny", "--allow-cpu", "--steps", "2", "--prompts", "2", "--group-size", "4"]
    argv += ["--prompt-tokens", "16", "--new-tokens", "12", "--micro-batch-size", "4"]
    argv += ["--staleness-steps", "3", "--server-steps", "0"]  # servers: by hand (each starts vLLM)
    report = gpu_check.main([*argv, "--precision", "bf16-mixed", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["precision"] == "bf16-mixed" and report["master_dtype"] == "float32"
    assert report["response_length_by_step"] == [12.0, 12.0]  # rollout.ignore_eos: equal work
    assert report["generation_tokens_per_s"] > 0 and report["training_flops_per_step"] > 0
    assert report["lr_1e-6_step_applied"]
    assert report["lr_1e-6_master_changed_frac"] >= 0.99
    assert report["lr_1e-6_bf16_rounding_changed_frac"] < 0.5
    # 6 N per trained token + 2 N per token of the reference pass (kl in the loss): 8 N x 8 x 28.
    n = report["multiplying_params"]
    assert report["training_flops_per_step"] == 8 * n * 8 * (16 + 12)
    # the roofline: measured peaks (a small CPU probe) and every phase counted
    assert (
        report["peaks_measured"]["fp32_square_flops"] > 0 and report["peaks_measured"]["copy_bytes_per_s"] > 0
    )
    phases = report["roofline"]["measured"]
    assert phases["forward"]["gflop"] > 0 and phases["backward"]["gflop"] > 2 * phases["forward"]["gflop"]
    assert phases["logprob_passes"]["gflop"] == pytest.approx(phases["forward"]["gflop"])  # the ref pass
    assert phases["generation"]["gb"] > 0 and phases["optimizer"]["gb"] > 0
    assert phases["forward"]["frac_matmul_peak"] > 0
    # max_staleness 1: step m trains the batch of weights max(0, m - 1)
    assert report["staleness"]["k1"]["staleness_by_step"] == [0.0, 1.0, 1.0]
    assert report["staleness"]["k0"]["staleness_by_step"] == [0.0, 0.0, 0.0]
    assert report["staleness"]["step_time_k1_over_k0"] > 0
    assert "servers" not in report


def test_bf16_peaks_match_device_names():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.bf16_peak("NVIDIA H200") == 989.4e12
    assert gpu_check.bf16_peak("NVIDIA H100 PCIe") == 756.0e12  # before the SXM "H100" entry
    assert gpu_check.bf16_peak("NVIDIA A100-SXM4-80GB") == 312.0e12
    assert gpu_check.bf16_peak("Some GPU") is None


def test_hbm_bandwidths_match_device_names():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.hbm_bandwidth("NVIDIA H200") == 4.8e12
    assert gpu_check.hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert gpu_check.hbm_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert gpu_check.hbm_bandwidth("NVIDIA A100-SXM4-80GB") == 2.039e12
    assert gpu_check.hbm_bandwidth("NVIDIA A100-SXM4-40GB") == 1.555e12
    assert gpu_check.hbm_bandwidth("Some GPU") is None
