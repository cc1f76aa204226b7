"""Tests of policygrad.core.checks (the shared input checks) and of core's import rules."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from policygrad.core import checks

pytestmark = pytest.mark.unit

CORE = pathlib.Path(checks.__file__).parent


def test_shared_messages():
    with pytest.raises(TypeError, match="^x must be a torch.Tensor, got list$"):
        checks.check_tensor([1.0], "x")
    with pytest.raises(ValueError, match=r"^scores must be 2-D \[B, T\], got shape \(3,\)$"):
        checks.check_2d(torch.zeros(3), "scores")
    with pytest.raises(TypeError, match="^lp must be a floating tensor, got dtype torch.int64$"):
        checks.check_floating(torch.zeros(2, dtype=torch.long), "lp")
    with pytest.raises(ValueError, match=r"^b must have the same shape as a \(2, 3\), got \(3, 2\)$"):
        checks.check_same_shape(torch.zeros(2, 3), "a", b=torch.zeros(3, 2))
    checks.check_same_shape(torch.zeros(2, 3), "a", b=None)  # an optional argument left out
    with pytest.raises(TypeError, match="^dual_clip must be a number or None, got str$"):
        checks.check_number("3", "dual_clip", or_none=True)
    with pytest.raises(ValueError, match=r"^clip_low must be a finite number in \[0, 1.0\], got 1.5$"):
        checks.check_fraction(1.5, "clip_low", allow_none=False, upper=1.0)
    assert checks.check_fraction(None, "clip_low", allow_none=True) is None
    with pytest.raises(ValueError, match=r"^gae: lam must be a number in \[0, 1\], got True$"):
        checks.check_unit_interval(True, "lam", "gae")
    with pytest.raises(ValueError, match="^beta must be finite, got inf$"):
        checks.check_real(float("inf"), "beta")
    assert checks.check_real(torch.tensor([0.5]), "beta") == 0.5
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        checks.check_temperature(0.0)
    assert checks.check_chunk_size(None, 7) == 7
    with pytest.raises(ValueError, match=r"^chunk_size must be a positive int \(rows per block\), got 0$"):
        checks.check_chunk_size(0, 7)
    mask = checks.as_bool_mask(torch.zeros(2, 2), torch.tensor([[1, 0], [2, 0]]))
    assert mask.dtype == torch.bool and mask.tolist() == [[True, False], [True, False]]


def _imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = ("." * node.level) + (node.module or "")
            yield module, [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_core_imports_only_core_and_no_private_names(path):
    for module, names in _imports(path):
        if module.startswith("policygrad"):
            # policygrad.specs: the torch-free declarations core's registries implement (a floor below)
            assert module.startswith(("policygrad.core", "policygrad.specs")), (path.name, module)
        assert not any(name.startswith("_") and name != "__future__" for name in names), (path.name, names)
