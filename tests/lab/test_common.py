"""The lab commands' plumbing: one-line argument errors, output folders, JSON-ready values,
table cells and tables (worked by hand), plots, list and number options, prompts as the trainer
tokenizes them."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import torch

from policygrad.lab.common import (
    DEFAULT_OUTPUT_DIR,
    _numeric,
    add_run_args,
    check_output_dir,
    check_positive_int,
    ensure_output_dir,
    fmt,
    format_table,
    load_lab_model,
    parse_float_list,
    plain,
    pyplot,
    repeat_each,
    save_figure,
    set_threads,
    tokenize_user_prompts,
    write_json,
)
from tests.tiny import BOS_ID, CHARACTERS, EOS_ID

unit = pytest.mark.unit


def char_ids(text):
    """Ids of the tiny tokenizer: 4 + the character's index in CHARACTERS (see tests/tiny.py)."""
    return [4 + CHARACTERS.index(c) for c in text]


# ----------------------------------------------------------------------------- arguments


@unit
def test_run_args_and_their_defaults():
    parser = argparse.ArgumentParser()
    add_run_args(parser)
    assert vars(parser.parse_args([])) == {"seed": 0, "threads": None, "output_dir": DEFAULT_OUTPUT_DIR}
    args = parser.parse_args(["--seed", "3", "--threads", "1", "--output-dir", "out"])
    assert (args.seed, args.threads, args.output_dir) == (3, 1, "out")


# ----------------------------------------------------------------------------- output folders


@unit
def test_check_output_dir_makes_nothing(tmp_path):
    target = tmp_path / "a" / "b"
    assert check_output_dir(target) == str(target)
    assert not (tmp_path / "a").exists()
    assert check_output_dir(tmp_path) == str(tmp_path)  # an existing folder


@unit
@pytest.mark.parametrize("below", ["", "sub/dir"])
def test_a_file_in_the_way_names_output_dir(tmp_path, below):
    (tmp_path / "f").write_text("")
    path = str(tmp_path / "f" / below) if below else str(tmp_path / "f")
    with pytest.raises(ValueError, match=r"^--output-dir '.*' is a file; give a folder"):
        check_output_dir(path)


@unit
def test_ensure_output_dir_makes_the_folders(tmp_path):
    target = tmp_path / "a" / "b"
    assert ensure_output_dir(target) == str(target)
    assert target.is_dir()
    assert ensure_output_dir(target) == str(target)  # again: nothing to do
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="--output-dir .* is a file"):
        ensure_output_dir(tmp_path / "f")


# ----------------------------------------------------------------------------- JSON values


@unit
def test_plain_makes_values_json_ready():
    assert plain(torch.tensor(1.5)) == 1.5 and type(plain(torch.tensor(1.5))) is float
    assert plain(torch.tensor([1.0, float("nan")])) == [1.0, None]
    assert plain(np.float32(0.25)) == 0.25 and type(plain(np.int64(3))) is int
    assert plain(float("nan")) is None
    assert (plain(float("inf")), plain(float("-inf"))) == ("inf", "-inf")
    assert plain((1, (2.0, "x"))) == [1, [2.0, "x"]]
    assert plain({1: {"a": torch.tensor([2, 3])}, "b": True}) == {"1": {"a": [2, 3]}, "b": True}
    assert plain("text") == "text" and plain(None) is None


@unit
def test_write_json_writes_the_plain_value(tmp_path):
    path = write_json(tmp_path / "r.json", {"loss": float("nan"), "x": torch.tensor([1, 2])})
    assert path == str(tmp_path / "r.json")
    text = (tmp_path / "r.json").read_text()
    assert text.endswith("}\n") and "\n  " in text  # indented, one newline at the end
    assert json.loads(text) == {"loss": None, "x": [1, 2]}


# ----------------------------------------------------------------------------- tables


@unit
@pytest.mark.parametrize(
    ("value", "digits", "cell"),
    [
        (None, 4, "-"),
        (True, 4, "yes"),
        (False, 4, "no"),
        (12, 4, "12"),
        (0.0, 4, "0"),
        (0.5, 4, "0.5"),
        (1234.5678, 4, "1235"),  # 4 significant digits
        (3.14159, 2, "3.1"),
        (0.0001234, 4, "1.234e-04"),  # below 1e-3: scientific, digits - 1 decimals
        (123456.0, 4, "1.235e+05"),  # 1e5 and above: scientific
        (-0.0005, 1, "-5.0e-04"),  # at least one decimal
        (float("nan"), 4, "nan"),
        (float("-inf"), 4, "-inf"),
        ("text", 4, "text"),
    ],
)
def test_fmt(value, digits, cell):
    assert fmt(value, digits) == cell


@unit
def test_format_table_aligns_text_left_and_numbers_right():
    table = format_table(["model", "loss", "note"], [["a", 1.5, "x"], ["bbb", 0.25, None]])
    # Widths: model 5, loss max(4, 3, 4) = 4, note max(4, 1, 1) = 4; "loss" is numeric (right),
    # "note" holds text (left), the first column is always left; trailing spaces stripped.
    assert table.splitlines() == [
        "model  loss  note",
        "-----  ----  ----",
        "a       1.5  x",
        "bbb    0.25  -",
    ]


@unit
def test_numeric_strings_are_right_aligned():
    table = format_table(["name", "params"], [["smollm2", "135M"], ["tiny", "16"]])
    assert table.splitlines()[2:] == ["smollm2    135M", "tiny         16"]


@unit
@pytest.mark.parametrize(
    ("text", "numeric"),
    [("1.5", True), ("-", True), ("", True), ("135M", True), ("1,024", True), ("2k", True), ("abc", False)],
)
def test_numeric(text, numeric):
    assert _numeric(text) is numeric


# ----------------------------------------------------------------------------- plots


@unit
def test_pyplot_uses_agg_and_save_figure_writes_a_png(tmp_path):
    plt = pyplot()
    import matplotlib

    assert matplotlib.get_backend().lower() == "agg"
    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = save_figure(fig, tmp_path / "p.png", dpi=20)
    assert path == str(tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not plt.fignum_exists(fig.number)  # closed


# ----------------------------------------------------------------------------- options


@unit
def test_parse_float_list():
    assert parse_float_list("0.1, 0.5,1,", "--betas") == [0.1, 0.5, 1.0]
    assert parse_float_list([1, 2.5], "--betas") == [1.0, 2.5]


@unit
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "--betas is empty; give comma-separated numbers"),
        (" , ", "--betas is empty"),
        ([], "--betas is empty"),
        ("0.1,abc", "--betas: 'abc' is not a number"),
        ([0.1, None], "--betas: None is not a number"),
        ("1,nan", "--betas: 'nan' is not finite"),
        ("inf", "--betas: 'inf' is not finite"),
    ],
)
def test_parse_float_list_errors_name_the_option(text, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        parse_float_list(text, "--betas")


@unit
def test_check_positive_int():
    assert check_positive_int(3, "--samples") == 3
    assert check_positive_int(0, "--skip", minimum=0) == 0
    with pytest.raises(ValueError, match=r"^--samples must be >= 1, got 0$"):
        check_positive_int(0, "--samples")
    with pytest.raises(TypeError, match=r"^--samples must be an int, got bool$"):
        check_positive_int(True, "--samples")
    with pytest.raises(TypeError, match=r"^--samples must be an int, got float$"):
        check_positive_int(2.0, "--samples")


@unit
def test_set_threads():
    before = torch.get_num_threads()
    set_threads(None)
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match=r"^--threads must be >= 1, got 0$"):
        set_threads(0)
    try:
        set_threads(2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@unit
def test_repeat_each():
    assert repeat_each(["a", "b"], 2) == ["a", "a", "b", "b"]
    assert repeat_each([1, 2, 3], 1) == [1, 2, 3]
    assert repeat_each(["a"], 0) == []


# ----------------------------------------------------------------------------- prompts and models


@unit
def test_prompts_are_rendered_with_the_chat_template_up_to_the_assistant_header():
    from tests.tiny import make_tiny_tokenizer

    ids = tokenize_user_prompts(make_tiny_tokenizer(), ["hi", "2+2?"])
    # ChatML: <|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n
    header = [BOS_ID, *char_ids("assistant\n")]
    assert ids == [
        [BOS_ID, *char_ids("user\nhi"), EOS_ID, *char_ids("\n"), *header],
        [BOS_ID, *char_ids("user\n2+2?"), EOS_ID, *char_ids("\n"), *header],
    ]


@unit
@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([], "^prompts is empty; give at least one prompt$"),
        (["ok", ""], r"^prompts\[1\] must be a non-empty string, got ''$"),
        (["ok", "ok", 3], r"^prompts\[2\] must be a non-empty string, got 3$"),
    ],
)
def test_bad_prompts_are_named(prompts, message):
    from tests.tiny import make_tiny_tokenizer

    with pytest.raises(ValueError, match=message):
        tokenize_user_prompts(make_tiny_tokenizer(), prompts)


@pytest.mark.integration
def test_load_lab_model_is_frozen_and_in_eval_mode(tiny_lm_dir):
    model, tokenizer = load_lab_model(tiny_lm_dir)
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert next(model.parameters()).dtype == torch.float32
    assert tokenizer.eos_token_id == EOS_ID
    bf16, _ = load_lab_model(tiny_lm_dir, dtype="bfloat16")
    assert next(bf16.parameters()).dtype == torch.bfloat16
    assert math.isfinite(float(model(torch.tensor([[BOS_ID, 5, 6]])).logits.sum()))
