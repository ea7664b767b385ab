"""Waiting in a daemon's main thread for the signal that stops it."""

from __future__ import annotations

import threading

# Python runs signal handlers in the main thread only, and a signal the kernel hands to another thread (gRPC's, the
# lanes') does not wake a main thread blocked on a lock: an untimed Event.wait() can sleep through a SIGTERM. A
# short timed wait lets the handler run within this long.
SIGNAL_POLL_S = 0.5


def wait_for_stop(stop: threading.Event) -> None:
    """Block until `stop` is set (by a signal handler), running pending signal handlers at least every
    SIGNAL_POLL_S."""
    while not stop.wait(SIGNAL_POLL_S):
        pass
