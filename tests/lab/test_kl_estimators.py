"""Tests of the KL-estimator lab: the token experiment on a tiny model, the files and the CLI (the
Gaussian table and the placements: test_kl_exact.py)."""

from __future__ import annotations

import json

import pytest
import torch

from policygrad.cli import main
from policygrad.lab.kl_estimators import perturbed_copy, run_kl_estimators, token_kl_measurements

pytestmark = pytest.mark.integration


def test_perturbed_copy_leaves_the_model_alone(tiny_lm):
    model, _ = tiny_lm
    before = [p.clone() for p in model.parameters()]
    other = perturbed_copy(model, 0.1, seed=3)
    for p, q in zip(before, model.parameters()):
        assert torch.equal(p, q)
    w, w2 = model.model.layers[0].mlp.down_proj.weight, other.model.layers[0].mlp.down_proj.weight
    # noise std = 0.1 * rms(W) (to sampling error over 2048 entries)
    ratio = float((w2 - w).detach().std() / w.detach().square().mean().sqrt())
    assert 0.09 < ratio < 0.11
    assert torch.equal(perturbed_copy(model, 0.0).model.norm.weight, model.model.norm.weight)


def test_token_measurements_on_tiny_model(tiny_lm):
    model, tokenizer = tiny_lm
    rows, values = token_kl_measurements(
        model,
        tokenizer,
        ["What is 2+3?", "Say hi."],
        noise_scales=[0.05],
        samples_per_prompt=4,
        max_new_tokens=8,
        seed=0,
    )
    assert [r.kind for r in rows] == ["k1", "k2", "k3"]
    n = rows[0].n_tokens
    assert len(values[0.05]["exact"]) == n == len(values[0.05]["k3"])
    exact = torch.tensor(values[0.05]["exact"])
    assert bool((exact >= 0).all()) and float(exact.mean()) > 0
    assert rows[1].frac_negative == 0.0 and rows[2].frac_negative == 0.0
    # Close distributions: k3's spread is far below k1's (k1 = k3 minus the zero-mean (r - 1)).
    assert rows[2].std_rel < 0.5 * rows[0].std_rel


def test_run_writes_files_and_cli(tmp_path, capsys, tiny_lm):
    model, tokenizer = tiny_lm
    result = run_kl_estimators(
        mus=[0.1, 1.0],
        n_samples=20_000,
        model=model,
        tokenizer=tokenizer,
        model_name="tiny",
        prompts=["Hi"],
        noise_scales=[0.05],
        samples_per_prompt=2,
        max_new_tokens=4,
        output_dir=str(tmp_path),
    )
    data = json.loads(open(result.json_path).read())
    assert len(data["gaussian"]) == 6 and len(data["tokens"]) == 3 and len(data["placements"]) == 14
    assert open(result.png_path, "rb").read(4) == b"\x89PNG"
    assert (
        main(
            [
                "lab",
                "kl-estimators",
                "--model",
                "none",
                "--samples",
                "10000",
                "--mu",
                "0.1,0.5",
                "--output-dir",
                str(tmp_path / "cli"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "std/KL" in out and "forward KL" in out
    assert (tmp_path / "cli" / "kl_estimators.png").exists()
    assert main(["lab", "kl-estimators", "--model", "none", "--mu", "0.1,zero"]) == 2
    assert "error: --mu: 'zero' is not a number" in capsys.readouterr().err
