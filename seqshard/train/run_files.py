"""Writing a run's own files (``config.yaml``, ``run.json``, ``metrics.jsonl``, TensorBoard
events) so that a full disk or a permission error loses nothing and says what happened.

    atomic_write_text(run_dir / "run.json", text)   # the old file or the new one, never half
    append_whole(fd, line.encode(), path)           # the whole record appended, or nothing

Each raises :class:`RunWriteError` on failure, one line: the file, the OS error, the bytes the
write needed and the space free. The training loop adds which checkpoint is the newest intact
one (:meth:`RunWriteError.with_checkpoint`). Checkpoints have their own error
(``seqshard.train.checkpoint.CheckpointSaveError``)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from seqshard.files import free_space, write_whole
from seqshard.shardlib.tables import format_bytes

__all__ = ["RunWriteError", "append_whole", "atomic_write_text"]


class RunWriteError(OSError):
    """A write of one of a run's files failed; what was written before is intact."""

    def __init__(self, path: Path, error: OSError, needed: int, checkpoint: str = ""):
        self.path, self.error, self.needed, self.checkpoint = Path(path), error, needed, checkpoint
        why = f"[Errno {error.errno}] {error.strerror}" if error.errno else str(error)
        text = (
            f"could not write {self.path}: {why}. The write needed {format_bytes(needed)}; "
            f"{self.path.parent} has {free_space(self.path.parent)}."
        )
        if checkpoint:
            text += f" {checkpoint}"
        text += " Free space (or fix the directory's permissions) and resume."
        super().__init__(error.errno, text)
        self.text = text

    def __str__(self) -> str:
        return self.text

    def with_checkpoint(self, sentence: str) -> RunWriteError:
        """The same error, with a sentence on the newest intact checkpoint."""
        return RunWriteError(self.path, self.error, self.needed, sentence)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` whole, readable by all (:func:`seqshard.files.write_whole`):
    a kill or a full disk leaves the old file or the new one; a failure is a RunWriteError."""
    data = text.encode("utf-8")
    try:
        write_whole(path, data)
    except OSError as e:
        raise RunWriteError(Path(path), e, len(data)) from None


def append_whole(fd: int, data: bytes, path: Path) -> None:
    """Append ``data`` to the file open as ``fd`` (``O_APPEND``), all of it or none: a write
    cut short (``ENOSPC`` part-way) is truncated back to the file's previous end."""
    start = os.fstat(fd).st_size
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except OSError as e:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, start)
        raise RunWriteError(path, e, len(data)) from None
