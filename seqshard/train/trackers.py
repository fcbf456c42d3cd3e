"""Where a run's metrics go: one small interface, one class per sink (``run.trackers``).

    trackers = open_trackers(("jsonl", "tensorboard"), run_dir, config=cfg_dict, name="tiny")
    for t in trackers:
        t.truncate_after(4)                      # on resume: the crashed run's tail goes
        t.log(5, {"loss": 3.41, "val_loss": 3.5})
        t.close()

:class:`~seqshard.train.metrics.MetricsLogger` checks the values (plain floats) and writes
them through every tracker; nothing else in the loop knows which sinks a run has.

- ``jsonl``: ``RUN_DIR/metrics.jsonl``, one JSON object per step, ``{"step": 120, "loss": 3.41,
  ..., "time": 1718000000.0}``, each line appended whole in one write, so a kill loses at most
  the line being written (:func:`read_metrics` skips such a torn last line) and a full disk
  none: a line cut short is truncated away and
  :class:`~seqshard.train.run_files.RunWriteError` names the file and the space.
- ``tensorboard``: ``RUN_DIR/tb/``, tags ``train/<key>`` and, for keys ``val_<name>``,
  ``val/<name>`` (:func:`tb_tag`), written synchronously (:class:`EventFile`).
- ``wandb``: Weights & Biases (the ``wandb`` extra): the run's resolved config, and the same
  tags as TensorBoard keyed by step; its files in ``RUN_DIR/wandb/``.

``jsonl`` cannot be turned off (``run.trackers`` without it is a config error): metrics.jsonl
is the run's own record, which seqshard itself reads. Resume truncates it to the checkpoint's
step, ``seqshard plot`` draws it, and a directory holding it is known to hold a run, which a
run of another config must not overwrite (``seqshard.train.loop``). A run without it would
resume into an unchecked directory and plot nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import socket
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from seqshard.train.run_files import RunWriteError, append_whole, atomic_write_text

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
WANDB_DIR = "wandb"  # W&B's own files; it writes its runs in RUN_DIR/wandb/

__all__ = [
    "METRICS_FILE",
    "SINKS",
    "TB_DIR",
    "WANDB_DIR",
    "EventFile",
    "JsonlTracker",
    "TensorBoardTracker",
    "Tracker",
    "WandbTracker",
    "open_trackers",
    "read_metrics",
    "require_trackers",
    "tb_tag",
]


class Tracker(Protocol):
    """A sink of a run's scalar metrics."""

    def log(self, step: int, values: Mapping[str, float]) -> None:
        """Record ``values`` (plain floats, keys as the loop names them) at ``step``."""

    def truncate_after(self, step: int) -> int:
        """A resumed run starts after ``step``: forget (or hide) what a crashed run recorded
        after it. Returns the records dropped (0 where the sink only hides them)."""

    def close(self) -> None:
        """Flush and close. Idempotent."""


def tb_tag(key: str) -> str:
    """TensorBoard's (and W&B's) tag of a metric key: ``val_loss -> val/loss``, ``loss ->
    train/loss``."""
    if key.startswith("val_"):
        return "val/" + key[len("val_") :]
    return "train/" + key


# -- jsonl ------------------------------------------------------------------------------------


class JsonlTracker:
    """``RUN_DIR/metrics.jsonl`` (see the module docstring). A resumed run appends to the
    existing file: a torn last line (a crash mid-write) is repaired on open, and
    :meth:`truncate_after` drops the lines after the checkpoint's step."""

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.path = Path(run_dir) / METRICS_FILE
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _repair_torn_tail(self.path)
        except OSError as e:
            raise RunWriteError(self.path, e, 0) from None
        self._fd: int | None = self._open()

    def log(self, step: int, values: Mapping[str, float]) -> None:
        record = {"step": int(step), **values, "time": time.time()}
        # One write per line: a kill leaves at most this line torn, a full disk none of it.
        append_whole(self._fd, (json.dumps(record) + "\n").encode("utf-8"), self.path)

    def truncate_after(self, step: int) -> int:
        """Rewritten atomically (temp file + ``os.replace``); returns the lines dropped."""
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
        return dropped

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as e:
            raise RunWriteError(self.path, e, 0) from None


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
                stacklevel=4,
            )
            f.truncate(start)
        else:
            f.seek(0, os.SEEK_END)
            f.write(b"\n")


# -- TensorBoard ------------------------------------------------------------------------------


class EventFile:
    """A TensorBoard event file written synchronously: ``RUN_DIR/tb/events.out.tfevents.
    <time>.<host>.<pid>``, TFRecords of tensorboardX's ``Event`` protos, each record appended
    whole (:func:`~seqshard.train.run_files.append_whole`) or not at all. (tensorboardX's own
    writer writes from a thread and flushes from an atexit hook, so a full disk surfaced there
    as tracebacks at exit instead of one error.)

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


class TensorBoardTracker:
    """``RUN_DIR/tb/``: one :class:`EventFile` per tracker, created on the first :meth:`log`
    so that :meth:`truncate_after` can give it the resumed run's ``purge_step`` first."""

    def __init__(self, run_dir: str | os.PathLike[str]):
        self.directory = Path(run_dir) / TB_DIR
        self._events: EventFile | None = None
        self._purge_step: int | None = None

    def log(self, step: int, values: Mapping[str, float]) -> None:
        if self._events is None:
            self._events = EventFile(self.directory, purge_step=self._purge_step)
            self._purge_step = None
        self._events.scalars(step, values)

    def truncate_after(self, step: int) -> int:
        """TensorBoard keeps the old events but hides those of steps > ``step`` once it reads
        the next file's ``purge_step``, so its curves do not double back; nothing is dropped."""
        self.close()
        self._purge_step = step + 1  # TensorBoard discards events with step >= purge_step
        return 0

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None


# -- Weights & Biases -------------------------------------------------------------------------

_WANDB_MISSING = (
    "run.trackers includes wandb, but the wandb package is not installed: pip install "
    "'seqshard[wandb]', or drop wandb from run.trackers."
)


class WandbTracker:
    """A Weights & Biases run in ``RUN_DIR/wandb/``, holding the run's resolved ``config`` and
    the metrics under their TensorBoard tags, keyed by step.

    The environment picks the rest, as W&B documents: ``WANDB_MODE`` (``offline`` writes the
    files alone; ``wandb sync RUN_DIR/wandb/offline-run-*`` uploads them later),
    ``WANDB_PROJECT`` (default ``seqshard``), ``WANDB_ENTITY``, ``WANDB_API_KEY``. Every
    start of the same run directory continues one W&B run (its id is kept in
    ``RUN_DIR/wandb/seqshard-run-id``). W&B's steps only increase, so the steps a crashed run
    had logged past its checkpoint keep their first values: a resumed run retrains them
    exactly, so they are the same numbers."""

    def __init__(self, run_dir: str | os.PathLike[str], *, config: Mapping[str, Any], name: str):
        try:
            import wandb
        except ImportError:
            raise ImportError(_WANDB_MISSING) from None
        directory = Path(run_dir) / WANDB_DIR
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunWriteError(directory, e, 0) from None
        id_file = directory / "seqshard-run-id"
        if id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            run_id = secrets.token_hex(4)  # W&B ids: 8 characters of [a-z0-9]
            atomic_write_text(id_file, run_id + "\n")
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "seqshard"),
            name=name,
            id=run_id,
            resume="allow",
            dir=str(Path(run_dir)),
            # Our stdout holds the progress bar and the lines; log.txt keeps the notes.
            settings=wandb.Settings(console="off"),
        )
        # A resumed run may change resumable keys (train.steps, ...): the config says what now is.
        self._run.config.update(dict(config), allow_val_change=True)
        self._closed = False

    def log(self, step: int, values: Mapping[str, float]) -> None:
        if step < self._run.step:  # logged before a crash past the checkpoint (see above)
            return
        self._run.log({tb_tag(k): v for k, v in values.items()}, step=step)

    def truncate_after(self, step: int) -> int:
        return 0  # W&B cannot drop steps; log() skips those it holds

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._run.finish()


# -- choosing -----------------------------------------------------------------------------------

SINKS = {"jsonl": JsonlTracker, "tensorboard": TensorBoardTracker, "wandb": WandbTracker}


def require_trackers(names: Sequence[str]) -> None:
    """ImportError naming the fix if a tracker in ``names`` needs a package that is missing
    (checked without importing it: before anything is written)."""
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        raise ImportError(_WANDB_MISSING)


def open_trackers(
    names: Sequence[str],
    run_dir: str | os.PathLike[str],
    *,
    config: Mapping[str, Any],
    name: str,
) -> list[Tracker]:
    """The trackers ``names`` (``run.trackers``, checked by the config) of the run in
    ``run_dir``; ``config`` is the resolved config as a mapping, ``name`` the run's name."""
    trackers: list[Tracker] = []
    try:
        for sink in names:
            if sink == "wandb":
                trackers.append(WandbTracker(run_dir, config=config, name=name))
            else:
                trackers.append(SINKS[sink](run_dir))
    except BaseException:
        for tracker in trackers:
            tracker.close()
        raise
    return trackers
