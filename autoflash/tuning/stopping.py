"""Stopping a tune from outside: a SIGTERM (a batch scheduler's preemption or time limit,
`timeout`, `kill`) stops it the way Ctrl-C does. The trial in flight is dropped, finished trials
and winners stay stored, the run is marked interrupted, and the results DB is closed into one
file: a process killed by the signal's default action leaves its last writes in the `-wal` file
beside the DB, where a copy of the DB file alone does not have them."""

from __future__ import annotations

import contextlib
import signal
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread. A KeyboardInterrupt, so every clean-up path of Ctrl-C
    (the tuner's close, the sandboxes' shutdown, the worker processes' report) runs for it too."""


def _raise_terminated(signum, frame):
    # Once: a second SIGTERM (a scheduler signals the whole process group, and a parent passes the
    # signal on to its workers) must not break off the clean-up the first one started. A Python
    # no-op, not SIG_IGN, which processes started from here on would inherit.
    signal.signal(signal.SIGTERM, _ignore)
    raise Terminated()


def _ignore(signum, frame):
    pass


@contextlib.contextmanager
def sigterm_interrupts():
    """While inside: SIGTERM raises `Terminated` in the main thread. A no-op outside the main
    thread (Python delivers signals there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
