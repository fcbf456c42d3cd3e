"""Training metrics: ``RUN_DIR/metrics.jsonl``, TensorBoard scalars, and a progress display.

One :class:`MetricsLogger` per run, driven by the training loop::

    with MetricsLogger(run_dir, total_steps=300, start_step=s) as log:
        log.truncate_after(s)  # on resume: drop lines a crashed run wrote after its checkpoint
        for step in range(s + 1, 301):
            ...
            log.log(step, {"loss": 3.41, "lr": 2.9e-3, "grad_norm": 0.61,
                           "tokens_per_s": 4512.0, "mfu": 0.012, "step_time_s": 0.91})

``metrics.jsonl`` holds one JSON object per ``log`` call, ``{"step": 120, "loss": 3.41, ...,
"time": 1718000000.0}``, each line appended whole in one write, so a kill loses at most the
line being written (:func:`read_metrics` skips such a torn last line) and a full disk none:
a line cut short is truncated away and :class:`~seqshard.train.run_files.RunWriteError` names
the file and the space. TensorBoard tags are ``train/<key>`` and, for keys ``val_<name>``,
``val/<name>`` (``val_loss`` -> ``val/loss``), written synchronously to one event file per
logger (:class:`EventFile`): tensorboardX's own writer writes from a thread and flushes from
an atexit hook, so a full disk surfaced there as tracebacks at exit instead of one error.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from seqshard.train.run_files import RunWriteError, append_whole, atomic_write_text

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"

# Keys the logger writes itself; a metrics dict may not use them.
_RESERVED = ("step", "time")

__all__ = [
    "METRICS_FILE",
    "EventFile",
    "MetricsLogger",
    "SilentMetricsLogger",
    "format_line",
    "read_metrics",
    "tb_tag",
]


def tb_tag(key: str) -> str:
    """TensorBoard tag of a metric key: ``val_loss -> val/loss``, ``loss -> train/loss``."""
    if key.startswith("val_"):
        return "val/" + key[len("val_") :]
    return "train/" + key


def format_line(
    step: int, total_steps: int, metrics: Mapping[str, float], absent: Sequence[str] = ()
) -> str:
    """The plain (non-TTY) progress line, e.g.

    ``step 120/300  loss 3.412  val_loss 3.5  lr 2.9e-03  grad_norm 0.61  tok/s 4,512  mfu 1.2%
    (0.91 s/step)``. Missing keys are left out; keys without a known format follow as
    ``key 0.1234`` or, for whole numbers, ``key 16,384``. ``mfu`` is a fraction (``0.012``
    prints as ``1.2%``). Keys in ``absent`` have no value (a loss over no counted token):
    ``loss n/a``.
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
        # Per-layer and per-expert figures (``moe_load/3/17``) go to the files only.
        if key not in known and key != "step_time_s" and "/" not in key:
            parts.append(f"{key} {'n/a' if key in absent else _general(value)}")
    if "step_time_s" in metrics:
        parts.append(f"({_fmt('{:.2f}', metrics['step_time_s'])} s/step)")
    return "  ".join(parts)


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


class EventFile:
    """A TensorBoard event file written synchronously: ``RUN_DIR/tb/events.out.tfevents.
    <time>.<host>.<pid>``, TFRecords of tensorboardX's ``Event`` protos, each record appended
    whole (:func:`~seqshard.train.run_files.append_whole`) or not at all.

    ``purge_step``: a resumed run's first step; TensorBoard hides the earlier events of steps
    >= it (a ``SessionLog.START`` at that step, as tensorboardX's ``purge_step`` writes)."""

    def __init__(self, directory: Path, purge_step: int | None = None):
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunWriteError(directory, e, 0) from None
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid()}"
        self.path = directory / name
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise RunWriteError(self.path, e, 0) from None
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:
            start = SessionLog(status=SessionLog.START)
            self._write(Event(wall_time=time.time(), step=purge_step, session_log=start))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        """One event of the values at ``step``, tagged by :func:`tb_tag`."""
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        summary = Summary(
            value=[Summary.Value(tag=tb_tag(k), simple_value=v) for k, v in values.items()]
        )
        self._write(Event(wall_time=time.time(), step=step, summary=summary))

    def _write(self, event) -> None:
        import struct

        from tensorboardX.record_writer import masked_crc32c

        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        record = (
            header
            + struct.pack("<I", masked_crc32c(header))
            + data
            + struct.pack("<I", masked_crc32c(data))
        )
        append_whole(self._fd, record, self.path)

    def close(self) -> None:
        os.close(self._fd)


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
    """Writes ``RUN_DIR/metrics.jsonl`` and ``RUN_DIR/tb``, and shows progress.

    ``tty`` picks the display: a tqdm bar over ``total_steps`` (starting at ``start_step``)
    with loss and tokens/s, or one plain :func:`format_line` per :meth:`log` call. It
    defaults to ``sys.stdout.isatty()``. A resumed run appends to the existing file; call
    :meth:`truncate_after` with the checkpoint's step first.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        total_steps: int,
        start_step: int = 0,
        tty: bool | None = None,
    ) -> None:
        if total_steps < 0 or start_step < 0:
            raise ValueError(
                f"MetricsLogger: need total_steps >= 0 and start_step >= 0, got "
                f"total_steps={total_steps}, start_step={start_step}."
            )
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.total_steps = total_steps
        self.tty = sys.stdout.isatty() if tty is None else tty
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            _repair_torn_tail(self.path)
        except OSError as e:
            raise RunWriteError(self.path, e, 0) from None
        self._fd = self._open()
        # Created on first use, so that truncate_after can pass purge_step before any event.
        self._tb: Any = None
        self._purge_step: int | None = None
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
        """Append ``{"step": step, **metrics, "time": now}`` to metrics.jsonl and TensorBoard."""
        self._check_open("log")
        # None: no value (a loss over no counted token): left out of the files, "n/a" on screen.
        absent = [k for k, v in metrics.items() if v is None]
        values = _as_floats({k: v for k, v in metrics.items() if v is not None})
        record: dict[str, Any] = {"step": int(step), **values, "time": time.time()}
        # One write per line: a kill leaves at most this line torn, a full disk none of it.
        append_whole(self._fd, (json.dumps(record) + "\n").encode("utf-8"), self.path)
        self._events().scalars(int(step), values)
        self._show(int(step), {**values, **dict.fromkeys(absent, math.nan)}, absent)

    def message(self, text: str) -> None:
        """Print a line above the progress bar without breaking it (plain print when no bar)."""
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def truncate_after(self, step: int) -> int:
        """Drop the lines logged after ``step`` (a crashed run's tail); returns the count dropped.

        The file is rewritten atomically (temp file + ``os.replace``). TensorBoard is told to
        purge its events after ``step`` too (``purge_step``), so its curves do not double back.
        """
        self._check_open("truncate_after")
        os.close(self._fd)
        kept: list[str] = []
        dropped = 0
        # The torn tail was repaired on open, so every line must parse.
        for line, record in _parse_lines(self.path, torn_tail_ok=False):
            if record["step"] > step:
                dropped += 1
            else:
                kept.append(line + "\n")
        if dropped:
            atomic_write_text(self.path, "".join(kept))
        self._fd = self._open()

        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self._purge_step = step + 1  # TensorBoard discards events with step >= purge_step
        if self._bar is not None:
            self._bar.n = min(step, self.total_steps)
            self._bar.refresh()
        return dropped

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Flush and close the file, the TensorBoard writer and the bar. Idempotent."""
        if self._closed:
            return
        self._closed = True
        os.close(self._fd)
        if self._tb is not None:
            self._tb.close()
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

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise RunWriteError(self.path, e, 0) from None

    def _events(self) -> EventFile:
        if self._tb is None:
            self._tb = EventFile(self.run_dir / TB_DIR, purge_step=self._purge_step)
            self._purge_step = None
        return self._tb

    def _show(self, step: int, values: dict[str, float], absent: Sequence[str] = ()) -> None:
        """``absent``: keys of ``values`` that have no value (NaN here), shown as n/a."""
        self._last_val.update({k: v for k, v in values.items() if k.startswith("val_")})
        if self._bar is None:
            print(format_line(step, self.total_steps, values, absent), flush=True)
            return
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


def read_metrics(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl`` in file order.

    A torn last line (a crash mid-write) is skipped with a warning; a bad line elsewhere raises
    ValueError with its line number. Raises FileNotFoundError when the file does not exist.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"read_metrics: no {METRICS_FILE} in run dir {str(run_dir)!r} "
            f"(looked for {path}); is this the run dir a training run wrote?"
        )
    return [record for _, record in _parse_lines(path, torn_tail_ok=True)]


def _parse_lines(path: Path, *, torn_tail_ok: bool) -> list[tuple[str, dict[str, Any]]]:
    lines = path.read_text(encoding="utf-8").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if torn_tail_ok and i == len(lines) - 1:
                warnings.warn(
                    f"read_metrics: skipping the torn last line {i + 1} of {path} "
                    f"(a crash mid-write): {line[:80]!r}",
                    stacklevel=3,
                )
                break
            raise ValueError(
                f"{path} line {i + 1} is not JSON ({e}): {line[:80]!r}; fix or delete that line."
            ) from e
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(
                f"{path} line {i + 1} should be an object with an integer 'step', got {line[:80]!r}"
            )
        out.append((line, record))
    return out


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


def _repair_torn_tail(path: Path) -> None:
    """Make the file end in a newline, so appends after a crash start on a line of their own.

    A torn tail that still parses (the newline alone was lost) keeps its record; otherwise it is
    cut off with a warning.
    """
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        start = data.rfind(b"\n") + 1
        try:
            json.loads(data[start:])
        except (json.JSONDecodeError, UnicodeDecodeError):
            warnings.warn(
                f"MetricsLogger: dropping the torn last line of {path} (a crash mid-write): "
                f"{data[start : start + 80]!r}",
                stacklevel=3,
            )
            f.truncate(start)
        else:
            f.seek(0, os.SEEK_END)
            f.write(b"\n")
