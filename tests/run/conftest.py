"""The training fixtures (tests/training.py) for the tests of this folder."""

from tests.training import *  # noqa: F401, F403
from tests.training import _every_test_on_one_thread  # noqa: F401  (autouse; a leading _ escapes *)
