"""Signals during ``rayline up``: Ctrl-C and SIGTERM stop it cleanly, never between starting a child and its record."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Ctrl-C (SIGINT) and a supervisor's SIGTERM raise in ``up`` while it runs, so that it stops what it started.

    Installed whatever disposition was inherited: a shell without job control (a script, CI) starts background
    commands with SIGINT ignored, so Python installs no KeyboardInterrupt handler; SIGTERM's default would end
    the process at once, leaving what it started running. Outside the main thread signals cannot be handled.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    for signum in previous:
        signal.signal(signum, _on_interrupt)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class _Interrupts:
    """Whether a child is being started and recorded (``held``), and the signal that arrived meanwhile."""

    held = 0
    pending: int | None = None


def _on_interrupt(signum: int, frame: FrameType | None) -> None:
    if _Interrupts.held:
        _Interrupts.pending = signum  # raised once the child it would otherwise orphan is recorded
        return
    _raise_interrupt(signum)


def _raise_interrupt(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)  # the exit status of a process ended by the signal, as shells report it


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """A child started and recorded, or neither: a Ctrl-C between ``Popen`` and the record would orphan it."""
    _Interrupts.held += 1
    try:
        yield
    finally:
        _Interrupts.held -= 1
        if not _Interrupts.held and (signum := _Interrupts.pending) is not None:
            _Interrupts.pending = None
            _raise_interrupt(signum)
