"""A daemon's main thread wakes for its stop signal whichever thread the kernel hands the signal to (a coordinator
once slept through a SIGTERM for 90 s: gRPC's threads took it)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from nodeagent.signals import SIGNAL_POLL_S, wait_for_stop

pytestmark = pytest.mark.unit

FALLBACK_S = 10.0  # the test's own bound: it sets the event itself if the handler never ran


def test_a_signal_taken_by_another_thread_stops_the_wait_within_the_poll():
    stop = threading.Event()
    ran_in: list[str] = []

    def handler(*_: object) -> None:
        ran_in.append(threading.current_thread().name)
        stop.set()

    previous = signal.signal(signal.SIGUSR1, handler)

    def sender() -> None:
        time.sleep(0.2)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # to this thread, not the main one
        if not stop.wait(FALLBACK_S):
            stop.set()

    thread = threading.Thread(target=sender, name="sender", daemon=True)
    try:
        started = time.monotonic()
        thread.start()
        wait_for_stop(stop)
        waited = time.monotonic() - started
    finally:
        signal.signal(signal.SIGUSR1, previous)
        thread.join(FALLBACK_S + 1)
    assert ran_in == ["MainThread"]  # the handler ran, in the main thread, as Python runs them
    assert waited < 0.2 + SIGNAL_POLL_S + 2.0, waited  # not the fallback: an untimed wait sleeps until it
