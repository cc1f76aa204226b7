"""Running untrusted Python (model-written programs, tool calls) in an isolated process.

:mod:`policygrad.sandbox.runner` starts :mod:`policygrad.sandbox.worker` as a separate program
with limits; rewards (``code_tests``) and environments' tools both use it, so neither imports
the other.
"""

from policygrad.sandbox.runner import Sandbox, SandboxLimits, TestResult, TestSpec, available_isolation

__all__ = ["Sandbox", "SandboxLimits", "TestResult", "TestSpec", "available_isolation"]
