"""The tiny-run fixtures of tests/trainer, for the environment tests that train."""

from tests.training import _every_test_on_one_thread, eos_model_dir, rewards_py  # noqa: F401
