"""Ctrl-C and SIGTERM as routine: the first asks the run to stop at its next safe point (after
the current step, with a checkpoint), the second stops it at once."""

from __future__ import annotations

import logging
import signal
import threading

__all__ = ["EXIT_STATUS", "StopSignals"]

log = logging.getLogger("policygrad")

# The exit status of a run stopped by a signal (128 + the signal's number, as a shell reports it).
EXIT_STATUS = {"SIGINT": 130, "SIGTERM": 143}


class StopSignals:
    """A context in which SIGINT and SIGTERM do not interrupt the code: the first one sets
    :attr:`received` (``"SIGINT"`` or ``"SIGTERM"``) for the loop to check at its next safe
    point; a second one raises ``KeyboardInterrupt`` at once. Outside the context (and in any
    thread but the main one, where handlers cannot be installed) the previous handlers apply.

    Attributes:
        received: the name of the first signal received, or None.
    """

    def __init__(self):
        self.received: str | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            raise KeyboardInterrupt(f"second stop signal ({name})")
        self.received = name
        try:  # a handler may run while this thread is writing the same stream: then stay quiet
            log.warning(
                "%s received: finishing the current step, then saving a checkpoint "
                "(Ctrl-C again stops at once)",
                name,
            )
        except RuntimeError:
            pass
