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
import shutil
import tempfile
from pathlib import Path

from seqshard.shardlib.tables import format_bytes

__all__ = ["RunWriteError", "append_whole", "atomic_write_text"]


def _free(path: Path) -> str:
    for where in (path, *path.parents):
        try:
            return f"{format_bytes(shutil.disk_usage(where).free)} free"
        except OSError:
            continue
    return "an unknown amount free"


class RunWriteError(OSError):
    """A write of one of a run's files failed; what was written before is intact."""

    def __init__(self, path: Path, error: OSError, needed: int, checkpoint: str = ""):
        self.path, self.error, self.needed, self.checkpoint = Path(path), error, needed, checkpoint
        why = f"[Errno {error.errno}] {error.strerror}" if error.errno else str(error)
        text = (
            f"could not write {self.path}: {why}. The write needed {format_bytes(needed)}; "
            f"{self.path.parent} has {_free(self.path.parent)}."
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
    """Replace ``path`` by ``text`` (a temporary file renamed over it): a kill or a full disk
    leaves the old file or the new one, never a torn one, and no temporary file. The file is
    readable by all (0644 under the usual umask), like the run's other files: mkstemp's 0600
    would hide config.yaml and run.json from the rest of a team."""
    path = Path(path)
    data = text.encode("utf-8")
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise RunWriteError(path, e, len(data)) from None
    except BaseException:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        raise


def _umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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
