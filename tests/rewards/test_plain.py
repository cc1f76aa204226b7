"""What crosses back from the reward worker (:mod:`policygrad.rewards.plain`): plain data only,
arrays as float64 tensors of their values, other objects as stand-ins named after their type,
exceptions as classes named after the original."""

from __future__ import annotations

import pickle
from fractions import Fraction

import numpy as np
import pytest
import torch

from policygrad.rewards.plain import RemoteRewardError, from_plain, plain_loads, plain_result, remote_error

pytestmark = pytest.mark.unit


def test_plain_loads_takes_plain_data_and_refuses_any_class():
    reply = ("ok", ("list", [1, 2.5, "x", None, True]))
    assert plain_loads(pickle.dumps(reply)) == reply
    with pytest.raises(pickle.UnpicklingError, match=r"reward worker sent a fractions\.Fraction object"):
        plain_loads(pickle.dumps(("ok", Fraction(1, 2))))
    with pytest.raises(pickle.UnpicklingError, match=r"^the environment worker sent a fractions\.Fraction"):
        plain_loads(pickle.dumps([Fraction(1, 3)]), "environment worker")


def test_an_array_crosses_as_its_shape_and_values_and_comes_back_as_float64():
    out = plain_result(np.array([[1, 2], [3, 4]], dtype=np.int32))
    assert out == ("array", (2, 2), [1, 2, 3, 4])
    back = from_plain(out)
    assert back.dtype == torch.float64 and back.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    # float32 0.1 is 13421773 / 2**27 exactly; float64 keeps every bit of it.
    assert from_plain(plain_result(np.array([0.1], dtype=np.float32))).item() == 13421773 / 2**27


def test_scores_cross_as_python_numbers_and_other_objects_as_named_stand_ins():
    class Score:
        def __repr__(self):
            return "<Score 7>"

    out = plain_result([np.float32(0.5), np.array([2]), 3, None, Score()])
    assert out == ("list", [0.5, 2, 3, None, ("opaque", "Score", "<Score 7>")])
    back = from_plain(pickle.loads(pickle.dumps(out)))
    assert back[:4] == [0.5, 2, 3, None]
    assert type(back[4]).__name__ == "Score" and repr(back[4]) == "<Score 7>"
    whole = from_plain(plain_result("not a list"))  # a str is no sequence of scores
    assert type(whole).__name__ == "str" and repr(whole) == "'not a list'"


def test_a_remote_error_is_named_after_the_original_and_keeps_its_traceback():
    error = remote_error("SystemExit", "3", "Traceback ...")
    assert isinstance(error, RemoteRewardError) and not isinstance(error, SystemExit)
    assert type(error).__name__ == "SystemExit" and str(error) == "3"
    assert error.remote_traceback == "Traceback ..."
    assert type(remote_error("SystemExit", "4")) is type(error)  # one class per name
    assert type(remote_error("not a name", "x")).__name__ == "RewardError"
