"""``StopSignals``: the first SIGINT/SIGTERM asks for a stop at the next safe point, a second one
stops at once; ``at_once`` makes the first one stop at once (:class:`Stopped`); the previous
handlers come back on exit. Signals are raised in this (the main) thread with
``signal.raise_signal``, whose handler runs before the call returns."""

from __future__ import annotations

import signal
import threading

import pytest

from policygrad.run.interrupts import EXIT_STATUS, Stopped, StopSignals

pytestmark = pytest.mark.unit


def test_exit_status_is_128_plus_the_signal_number():
    # As a shell reports a process killed by the signal: 128 + 2 and 128 + 15.
    assert (
        EXIT_STATUS
        == {"SIGINT": 128 + signal.SIGINT, "SIGTERM": 128 + signal.SIGTERM}
        == {
            "SIGINT": 130,
            "SIGTERM": 143,
        }
    )


def test_stopped_is_a_keyboard_interrupt_naming_the_signal():
    stop = Stopped("SIGTERM")
    assert isinstance(stop, KeyboardInterrupt) and not isinstance(stop, Exception)
    assert stop.signal == "SIGTERM"
    assert str(stop) == "stopped by SIGTERM"


@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM])
def test_the_first_signal_is_recorded_and_the_second_stops_at_once(first):
    with StopSignals() as stop:
        assert stop.received is None
        signal.raise_signal(first)  # no exception: the loop checks ``received`` at its safe point
        assert stop.received == first.name
        with pytest.raises(KeyboardInterrupt, match=r"second stop signal \(SIGINT\)") as caught:
            signal.raise_signal(signal.SIGINT)
        assert not isinstance(caught.value, Stopped)
        assert stop.received == first.name  # still the first one's name


def test_at_once_raises_stopped_on_the_first_signal():
    with StopSignals(at_once=True) as stop:
        with pytest.raises(Stopped) as caught:
            signal.raise_signal(signal.SIGTERM)
        assert caught.value.signal == "SIGTERM" and stop.received == "SIGTERM"
        with pytest.raises(KeyboardInterrupt, match="second stop signal"):
            signal.raise_signal(signal.SIGTERM)


def test_at_once_can_be_switched_while_inside():
    with StopSignals(at_once=True) as stop:
        stop.at_once = False  # the run reached its first step: waiting saves a checkpoint now
        signal.raise_signal(signal.SIGINT)
        assert stop.received == "SIGINT"


def test_the_previous_handlers_come_back_on_exit():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with StopSignals() as stop:
        assert signal.getsignal(signal.SIGINT) == stop._handle
        assert signal.getsignal(signal.SIGTERM) == stop._handle
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_the_previous_handlers_come_back_when_the_body_raises():
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(Stopped):
        with StopSignals(at_once=True):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) == before


def test_outside_the_main_thread_no_handler_is_installed():
    before = signal.getsignal(signal.SIGINT)
    seen = {}

    def body():
        with StopSignals() as stop:
            seen["previous"] = dict(stop._previous)
            seen["handler"] = signal.getsignal(signal.SIGINT)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == {"previous": {}, "handler": before}
