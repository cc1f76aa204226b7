"""The errors a run ends with: one family under ``TrainingError`` (a ``RuntimeError``), so a caller
catches every run-ending error with one ``except`` and a checkpoint problem with a narrower one."""

from __future__ import annotations

import pytest

from policygrad import errors
from policygrad.errors import CheckpointError, CheckpointSaveError, TrainingError

pytestmark = pytest.mark.unit


def test_the_errors_form_one_chain_under_runtime_error():
    assert issubclass(TrainingError, RuntimeError)
    assert issubclass(CheckpointError, TrainingError)
    assert issubclass(CheckpointSaveError, CheckpointError)
    # Not the other way round: a plain TrainingError is no checkpoint error.
    assert not issubclass(TrainingError, CheckpointError)
    assert not issubclass(CheckpointError, CheckpointSaveError)


@pytest.mark.parametrize("cls", [TrainingError, CheckpointError, CheckpointSaveError])
def test_each_is_caught_as_a_training_error_with_its_message_unchanged(cls):
    with pytest.raises(TrainingError) as caught:
        raise cls("checkpoints/step_3: disk full")
    assert type(caught.value) is cls
    assert str(caught.value) == "checkpoints/step_3: disk full"


def test_all_names_exactly_the_three_errors():
    assert sorted(errors.__all__) == ["CheckpointError", "CheckpointSaveError", "TrainingError"]
    assert all(isinstance(getattr(errors, name), type) for name in errors.__all__)
