"""benchmarks/_common.py: a benchmark's default output never replaces a result already kept."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


@pytest.fixture
def common(import_script, monkeypatch, tmp_path):
    module = import_script("_common")
    monkeypatch.setattr(module, "RESULTS_DIR", tmp_path)
    return module


def test_the_default_result_path_takes_the_next_free_name(common, tmp_path):
    first = common.new_result_path("levers", "2026-12-02")
    assert first == tmp_path / "2026-12-02-levers.json"
    first.write_text("{}")
    assert common.new_result_path("levers", "2026-12-02") == tmp_path / "2026-12-02-levers-2.json"
    (tmp_path / "2026-12-02-levers-2.png").write_text("")  # a plot alone holds the name too
    assert common.new_result_path("levers", "2026-12-02") == tmp_path / "2026-12-02-levers-3.json"
    # another benchmark, or another day, is not affected
    assert common.new_result_path("scaling", "2026-12-02") == tmp_path / "2026-12-02-scaling.json"
    assert common.new_result_path("levers", "2026-12-03") == tmp_path / "2026-12-03-levers.json"
    assert first.read_text() == "{}"
