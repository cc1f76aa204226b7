"""Ctrl-C and SIGTERM as routine: the first asks the run to stop at its next safe point (after
the current step, with a checkpoint), the second stops it at once. Where waiting saves nothing
(a run starting or evaluating before its first step, or after its final checkpoint) the first
one stops the run at once (:class:`Stopped`)."""

from __future__ import annotations

import logging
import signal
import threading

__all__ = ["EXIT_STATUS", "StopSignals", "Stopped"]

log = logging.getLogger("policygrad")

# The exit status of a run stopped by a signal (128 + the signal's number, as a shell reports it).
EXIT_STATUS = {"SIGINT": 130, "SIGTERM": 143}


class Stopped(KeyboardInterrupt):
    """A stop signal received where waiting would save nothing (a run starting, evaluating before
    its first step, or after its final checkpoint): it ends the run at once. A ``KeyboardInterrupt``, so no
    ``except Exception`` on the way swallows it and every ``finally`` runs.

    Attributes:
        signal: ``"SIGINT"`` or ``"SIGTERM"``.
    """

    def __init__(self, name: str):
        super().__init__(f"stopped by {name}")
        self.signal = name


class StopSignals:
    """A context in which SIGINT and SIGTERM do not interrupt the code: the first one sets
    :attr:`received` (``"SIGINT"`` or ``"SIGTERM"``) for the loop to check at its next safe
    point; a second one raises ``KeyboardInterrupt`` at once. Outside the context (and in any
    thread but the main one, where handlers cannot be installed) the previous handlers apply.

    ``at_once`` (settable while inside): the first signal raises :class:`Stopped` instead, for
    the stretches where nothing would be saved by waiting.

    Attributes:
        received: the name of the first signal received, or None.
    """

    def __init__(self, *, at_once: bool = False):
        self.at_once = at_once
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

    def _handle(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if self.at_once and self.received is None:
            self.received = name
            raise Stopped(name)
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
