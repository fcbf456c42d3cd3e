"""Keeping orbax's own reports of a failure off stderr while the Checkpointer reports it once.

A failed asynchronous save makes orbax log the same OSError from several threads, each with a
traceback, and its abandoned tensorstore callbacks and coroutines print more when collected.
:class:`OrbaxQuiet`, a logging filter on :data:`ORBAX_LOGGERS`, holds orbax's ERROR records
while a save or read is in flight, and with ``sys.unraisablehook`` silences the leftovers
after one failed; :func:`settle` and :func:`join_orbax_threads` wait for orbax's abandoned
work to stop before the Checkpointer cleans up and raises.

    quiet = OrbaxQuiet()
    for name in ORBAX_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    quiet.hold()                 # a save or read starts
    quiet.release(ok=True)       # ... and ends: what was held goes through (ok) or is dropped
    quiet.close()
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ORBAX_LOGGERS", "OrbaxQuiet", "join_orbax_threads", "settle"]

ORBAX_LOGGERS = ("absl", "asyncio")  # where orbax's errors and those of its asyncio tasks go
_QUIET: set[OrbaxQuiet] = set()  # Checkpointers whose reads or writes' leftovers are silenced
_outer_unraisablehook: Callable[[Any], None] | None = None


def _orbax_leftover(u: Any) -> bool:
    """An error orbax's workers raise where nobody catches it, after a failed read or write:
    a tensorstore callback into the event loop orbax closed at the first error ("Event loop
    is closed"), or an abandoned read coroutine."""
    code = getattr(u.object, "cr_code", None)
    return (
        isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(u.exc_value)
    ) or (code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename)


_silenced = 0  # leftovers silenced so far (see settle)


def _unraisablehook(u: Any) -> None:
    global _silenced
    if _QUIET and _orbax_leftover(u):
        _silenced += 1
        return
    (_outer_unraisablehook or sys.__unraisablehook__)(u)


def settle(timeout_s: float = 2.0) -> None:
    """After a failed read or write, wait (within the Checkpointer's call, which the caller
    sees as one error) until orbax's abandoned work stops reporting: ~10 ms on a local disk."""
    deadline, seen = time.monotonic() + timeout_s, -1
    while seen != _silenced and time.monotonic() < deadline:
        seen = _silenced
        gc.collect()  # abandoned coroutines and tasks report when collected
        time.sleep(0.05)


class OrbaxQuiet(logging.Filter):
    """Keeps what orbax reports of a failure we report ourselves off stderr.

    A failed asynchronous save makes orbax log the same OSError from several threads, each
    with a traceback (hundreds of lines), and its abandoned tensorstore callbacks print more;
    the Checkpointer raises one CheckpointSaveError with what matters instead (a damaged
    checkpoint read: one CheckpointError or warning line). Held: orbax's ERROR records, only
    while a save or read of ours is in flight (let through afterwards if it succeeded), and
    the leftovers above, from then until close() if it failed."""

    def __init__(self):
        super().__init__()
        self.holding, self.failed, self.held = False, False, []

    def filter(self, record: logging.LogRecord) -> bool:
        """(On the absl and asyncio loggers.)"""
        global _silenced
        if record.levelno < logging.ERROR:
            return True
        if self.holding and f"{os.sep}orbax{os.sep}" in record.pathname:
            self.held.append(record)
            return False
        # asyncio's "Task exception was never retrieved" of an orbax task orbax abandoned.
        if self in _QUIET and record.name == "asyncio" and _from_orbax(record):
            _silenced += 1
            return False
        return True

    def hold(self) -> None:
        self.holding = True
        _quiet(self, True)

    def release(self, ok: bool) -> None:
        """End of a save or read: ``ok``, let what was held through; else drop it."""
        held, self.holding, self.held = self.held, False, []
        self.failed |= not ok
        if ok:
            _quiet(self, self.failed)
            for record in held:
                logging.getLogger(record.name).handle(record)

    def close(self) -> None:
        """Stop holding. After a failure, orbax's abandoned tasks and callbacks report when
        they are collected, which can be as late as the interpreter's exit, after the one
        line the run printed: those stay silenced for the rest of the process."""
        self.holding, self.held = False, []
        if not self.failed:
            _quiet(self, False)


def _from_orbax(record: logging.LogRecord) -> bool:
    """Whether a log record is about orbax's work: its message or its traceback names orbax."""
    if f"{os.sep}orbax{os.sep}" in record.getMessage():
        return True
    tb = record.exc_info[2] if record.exc_info else None
    while tb is not None:
        if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
            return True
        tb = tb.tb_next
    return False


def _quiet(owner: OrbaxQuiet, on: bool) -> None:
    """Add or remove ``owner`` from those silencing orbax's leftovers (sys.unraisablehook)."""
    global _outer_unraisablehook
    if on:
        if sys.unraisablehook is not _unraisablehook:
            _outer_unraisablehook, sys.unraisablehook = sys.unraisablehook, _unraisablehook
        _QUIET.add(owner)
    else:
        _QUIET.discard(owner)
        if not _QUIET and sys.unraisablehook is _unraisablehook:
            sys.unraisablehook, _outer_unraisablehook = _outer_unraisablehook, None


def join_orbax_threads(timeout_s: float = 120.0) -> None:
    """Wait for the worker threads orbax started for a save: they outlive its first error and
    go on writing into (and re-creating) the temporary directory for a moment."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = [
            t
            for t in threading.enumerate()
            if t is not threading.current_thread() and type(t).__module__.startswith("orbax.")
        ]
        if not workers:
            return
        for t in workers:
            # orbax's threads re-raise their error from join(): the one we report already.
            with contextlib.suppress(Exception):
                t.join(max(0.0, deadline - time.monotonic()))
