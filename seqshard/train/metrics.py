"""Training metrics: the trackers a run writes (:mod:`seqshard.train.trackers`), its console
lines, and its notes in ``RUN_DIR/log.txt``.

One :class:`MetricsLogger` per run, driven by the training loop::

    with MetricsLogger(run_dir, total_steps=300, start_step=s, notes=notes) as log:
        log.truncate_after(s)  # on resume: drop what a crashed run logged after its checkpoint
        for step in range(s + 1, 301):
            ...
            log.log(step, {"loss": 3.41, "lr": 2.9e-3, "grad_norm": 0.61,
                           "tokens_per_s": 4512.0, "mfu": 0.012, "step_time_s": 0.91})

Each :meth:`MetricsLogger.log` call writes every tracker (by default ``metrics.jsonl`` and
TensorBoard) and prints one :func:`format_line` (step, loss, grad norm, lr, tokens/s, MFU,
ETA); on a terminal a tqdm bar below the lines shows the progress between them.

A run's notes (start, resume, checkpoints, warnings) go to a :class:`RunLog`: printed, and
appended to ``RUN_DIR/log.txt`` with the time. :func:`warnings_as_notes` makes a Python
warning raised during the run (the loader's "rows repeat", a library's deprecation) one such
note, ``warning: ...``. The numbers themselves are in metrics.jsonl, not in log.txt.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from seqshard.evals.tasks import task_of_figure
from seqshard.train.run_files import RunWriteError, append_whole
from seqshard.train.trackers import (
    METRICS_FILE,
    JsonlTracker,
    TensorBoardTracker,
    Tracker,
    read_metrics,
)

LOG_FILE = "log.txt"

# Keys the logger writes itself; a metrics dict may not use them.
_RESERVED = ("step", "time")

__all__ = [
    "LOG_FILE",
    "METRICS_FILE",  # defined in seqshard.train.trackers, with the reader of the file
    "MetricsLogger",
    "RunLog",
    "SilentMetricsLogger",
    "format_duration",
    "format_line",
    "read_metrics",
    "show",
    "warnings_as_notes",
]


def show(text: str) -> None:
    """Print a line on stdout above any live tqdm bar (``tqdm.write``; a plain print without
    one), flushed: a run's output piped to a file shows each line as it happens."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


def format_line(
    step: int, total_steps: int, metrics: Mapping[str, float], absent: Sequence[str] = ()
) -> str:
    """The progress line of a logged step, e.g.

    ``step 120/300  loss 3.412  val_loss 3.5  lr 2.9e-03  grad_norm 0.61  tok/s 4,512  mfu 1.2%
    (0.91 s/step, eta 2m44s)``. Missing keys are left out; keys without a known format follow
    as ``key 0.1234`` or, for whole numbers, ``key 16,384``. ``mfu`` is a fraction (``0.012``
    prints as ``1.2%``). Keys in ``absent`` have no value (a loss over no counted token):
    ``loss n/a``. The ETA is the steps left at ``step_time_s`` (the steps since the last line;
    evaluations and checkpoints not counted).
    """
    known = {
        "loss": ("loss", "{:.4g}"),
        "val_loss": ("val_loss", "{:.4g}"),
        "lr": ("lr", "{:.1e}"),
        "grad_norm": ("grad_norm", "{:.4g}"),
        "tokens_per_s": ("tok/s", "{:,.0f}"),
        "mfu": ("mfu", "{:.1%}"),
    }
    parts = [f"step {step}/{total_steps}"]
    for key, (label, fmt) in known.items():
        if key in metrics:
            parts.append(f"{label} {_value(fmt, metrics[key], key in absent)}")
    for key, value in metrics.items():
        task = task_of_figure(key)
        if task and task[1] in ("acc", "acc_norm", "nll"):  # a task's headlines
            parts.append(f"{task[0]} {task[1]} {_fmt('{:.3f}', value)}")
        # Per-layer and per-expert figures (``moe_load/3/17``) go to the files only.
        elif key not in known and key != "step_time_s" and "/" not in key:
            parts.append(f"{key} {'n/a' if key in absent else _general(value)}")
    if "step_time_s" in metrics:
        step_time = metrics["step_time_s"]
        timing = f"{_fmt('{:.2f}', step_time)} s/step"
        if step < total_steps and math.isfinite(step_time):
            timing += f", eta {format_duration((total_steps - step) * step_time)}"
        parts.append(f"({timing})")
    return "  ".join(parts)


def format_duration(seconds: float) -> str:
    """``'42s'``, ``'2m44s'``, ``'3h05m'``, ``'2d07h'``: two units at most."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _general(value: float) -> str:
    # Counts (e.g. tokens_counted) read better as 16,384 than as 1.638e+04.
    if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return f"{int(value):,}"
    return _fmt("{:.4g}", value)


def _value(fmt: str, value: float, absent: bool) -> str:
    return "n/a" if absent else _fmt(fmt, value)


def _fmt(fmt: str, value: float) -> str:
    # NaN/inf would print as "nan%" or raise for ",.0f"; show them plainly.
    return fmt.format(value) if math.isfinite(value) else str(value)


class RunLog:
    """A run's notes: each one echoed at once (``echo``, by default :func:`show`) and
    appended to ``RUN_DIR/log.txt`` after the time it was noted::

        2026-11-27 15:34:02  starting runs/tiny on mesh d=4 x t=2
        2026-11-27 15:34:09  warning: eval_batches(6) needs 48 rows of 32 tokens but ...

    Notes are kept in memory until :meth:`open` (called once the run has written its
    config.yaml), so a run refused on bad input before that leaves no log.txt behind (and its
    new run directory is removed again). A resumed run appends to the file. Each note is one
    write (``O_APPEND``): notes from other threads (a warning in the loader's prefetch thread)
    never interleave mid-line."""

    def __init__(self, echo: Callable[[str], None] = show):
        self.echo = echo
        self.path: Path | None = None
        self._fd: int | None = None
        self._pending: list[str] = []  # stamped lines noted before open()
        self._lock = threading.Lock()

    def open(self, run_dir: str | os.PathLike[str]) -> None:
        """Start writing ``run_dir/log.txt``, the notes so far first."""
        with self._lock:
            self.path = Path(run_dir) / LOG_FILE
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            except OSError as e:
                raise RunWriteError(self.path, e, 0) from None
            pending, self._pending = "".join(self._pending), []
            if pending:
                append_whole(self._fd, pending.encode(), self.path)

    def __call__(self, text: str) -> None:
        self.echo(text)
        line = f"{time.strftime('%Y-%m-%d %H:%M:%S')}  {text}\n"
        with self._lock:
            if self._fd is None:
                self._pending.append(line)
            else:
                append_whole(self._fd, line.encode(), self.path)

    def close(self) -> None:
        """Stop writing; notes never written (no :meth:`open`) are dropped. Idempotent."""
        with self._lock:
            self._pending = []
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


@contextlib.contextmanager
def warnings_as_notes(note: Callable[[str], None]) -> Iterator[None]:
    """Within the block, a Python warning (from any thread) becomes one note, ``warning:
    <message>`` (its category after it unless a plain UserWarning), instead of the
    interpreter's two lines on stderr. The warning filters stay as they are (each warning once
    per place by default)."""

    def showwarning(message, category, filename, lineno, file=None, line=None) -> None:
        text = " ".join(str(message).split("\n"))
        kind = "" if category is UserWarning else f" ({category.__name__})"
        note(f"warning: {text}{kind}")

    with warnings.catch_warnings():  # restores warnings.showwarning on the way out
        warnings.showwarning = showwarning
        yield


class SilentMetricsLogger:
    """The :class:`MetricsLogger` of a process other than 0 in a multi-process run: every
    process computes the same metrics (replicated scalars); process 0 writes them."""

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def truncate_after(self, step: int) -> int:
        return 0

    def close(self) -> None:
        pass


class MetricsLogger:
    """Writes a run's metrics through its ``trackers`` and prints its progress.

    ``trackers``: :mod:`seqshard.train.trackers` sinks, closed with the logger; by default
    ``metrics.jsonl`` and TensorBoard in ``run_dir``. ``notes``: where :meth:`message` goes
    (the run's :class:`RunLog` in training; by default :func:`show`). ``tty`` (default
    ``sys.stdout.isatty()``) adds a tqdm bar over ``total_steps`` (starting at
    ``start_step``) with the latest loss and tokens/s, below the lines. A resumed run appends
    to the existing files; call :meth:`truncate_after` with the checkpoint's step first.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        total_steps: int,
        start_step: int = 0,
        tty: bool | None = None,
        trackers: Sequence[Tracker] | None = None,
        notes: Callable[[str], None] = show,
    ) -> None:
        if total_steps < 0 or start_step < 0:
            raise ValueError(
                f"MetricsLogger: need total_steps >= 0 and start_step >= 0, got "
                f"total_steps={total_steps}, start_step={start_step}."
            )
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.tty = sys.stdout.isatty() if tty is None else tty
        if trackers is None:
            trackers = [JsonlTracker(self.run_dir), TensorBoardTracker(self.run_dir)]
        self.trackers = list(trackers)
        self._notes = notes
        self._closed = False
        self._bar: Any = None
        self._last_val: dict[str, float] = {}
        if self.tty:
            from tqdm import tqdm

            self._bar = tqdm(
                total=total_steps,
                initial=min(start_step, total_steps),
                file=sys.stdout,
                dynamic_ncols=True,
                unit="step",
            )

    # -- writing ---------------------------------------------------------------------------

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Write ``metrics`` at ``step`` to every tracker and print its line. A value of None
        is no value (a loss over no counted token): left out of the trackers, "n/a" on screen."""
        self._check_open("log")
        absent = [k for k, v in metrics.items() if v is None]
        values = _as_floats({k: v for k, v in metrics.items() if v is not None})
        for tracker in self.trackers:
            tracker.log(int(step), values)
        self._show(int(step), {**values, **dict.fromkeys(absent, math.nan)}, absent)

    def message(self, text: str) -> None:
        """A note: to ``notes`` (printed above the progress bar, and into log.txt in a run)."""
        self._notes(text)

    def truncate_after(self, step: int) -> int:
        """Make every tracker forget what was logged after ``step`` (a crashed run's tail);
        returns the metrics.jsonl lines dropped (rewritten atomically). TensorBoard hides its
        later events (``purge_step``), so its curves do not double back."""
        self._check_open("truncate_after")
        dropped = sum(tracker.truncate_after(step) for tracker in self.trackers)
        if self._bar is not None:
            self._bar.n = min(step, self.total_steps)
            self._bar.refresh()
        return dropped

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Close the trackers and the bar. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for tracker in self.trackers:
                tracker.close()
        finally:
            if self._bar is not None:
                self._bar.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ValueError(f"MetricsLogger.{what}: the logger for {self.run_dir} is closed.")

    def _show(self, step: int, values: dict[str, float], absent: Sequence[str] = ()) -> None:
        """``absent``: keys of ``values`` that have no value (NaN here), shown as n/a."""
        show(format_line(step, self.total_steps, values, absent))  # above the bar, if any
        if self._bar is None:
            return
        self._last_val.update({k: v for k, v in values.items() if k.startswith("val_")})
        postfix = []
        if "loss" in values:
            postfix.append(f"loss {_value('{:.4g}', values['loss'], 'loss' in absent)}")
        if "val_loss" in self._last_val:
            shown = _value("{:.4g}", self._last_val["val_loss"], "val_loss" in absent)
            postfix.append(f"val_loss {shown}")
        if "tokens_per_s" in values:
            postfix.append(f"tok/s {_fmt('{:,.0f}', values['tokens_per_s'])}")
        self._bar.set_postfix_str("  ".join(postfix), refresh=False)
        self._bar.update(max(0, min(step, self.total_steps) - self._bar.n))


def _as_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        if key in _RESERVED:
            raise ValueError(
                f"MetricsLogger.log: metric key {key!r} is reserved (the logger writes "
                f"{', '.join(_RESERVED)} itself); rename it."
            )
        try:
            # float() also takes numpy / 0-d JAX scalars (and blocks until they are ready).
            out[key] = float(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"MetricsLogger.log: metric {key!r} must be a number or a scalar array, "
                f"got {type(value).__name__} {value!r}."
            ) from None
    return out
