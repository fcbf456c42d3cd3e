"""safetensors files, read one tensor at a time and written one tensor at a time.

Reading goes through the ``safetensors`` library (``safe_open``: the file is memory-mapped and
only the tensor asked for is read). Writing is done here: ``safetensors.numpy.save_file`` takes
every tensor of a file at once, so a 5 GB shard would be 5 GB of host memory. The format is
simple enough to stream: an 8-byte little-endian header length, a JSON header naming each
tensor's dtype, shape and byte range, then the tensors' bytes back to back. The header is known
before any tensor is (from the config), so each tensor is gathered, written and dropped in turn.

A model of several files has an index, ``model.safetensors.index.json``:
``{"metadata": {"total_size": bytes}, "weight_map": {tensor name: file name}}``.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

from seqshard.hf.errors import HFFormatError

__all__ = [
    "DTYPES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "HFTensors",
    "plan_files",
    "tensor_names",
    "write_index",
    "write_safetensors",
]

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = {
    "float32": ("F32", np.dtype(np.float32)),
    "bfloat16": ("BF16", np.dtype(ml_dtypes.bfloat16)),
}
"""Export dtypes: name -> (safetensors code, numpy dtype)."""
_ALIGN = 8


def plan_files(
    tensors: Sequence[tuple[str, tuple[int, ...]]], itemsize: int, max_file_bytes: int
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Split ``tensors`` (in order) into files of at most ``max_file_bytes`` each (a tensor
    larger than that gets a file to itself)."""
    files: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = int(np.prod(shape)) * itemsize
        if files[-1] and size + nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append((name, shape))
        size += nbytes
    return files


def write_safetensors(
    path: Path,
    tensors: Sequence[tuple[str, tuple[int, ...]]],
    dtype: str,
    produce: Callable[[str], np.ndarray],
) -> int:
    """Write ``path`` holding ``tensors`` in order, calling ``produce(name)`` for each one's
    values just before writing it; return the bytes of tensor data written. The file is
    readable by ``safetensors.safe_open`` and transformers (metadata ``format: pt``)."""
    code, np_dtype = DTYPES[dtype]
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        nbytes = int(np.prod(shape)) * np_dtype.itemsize
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % _ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape in tensors:
            values = np.ascontiguousarray(produce(name)).astype(np_dtype, copy=False)
            if values.shape != tuple(shape):
                raise ValueError(f"{name}: produced shape {values.shape}, planned {tuple(shape)}.")
            f.write(values.reshape(-1).view(np.uint8).data)
            del values
        f.flush()
        os.fsync(f.fileno())
    return offset


def write_index(directory: Path, weight_map: dict[str, str], total_size: int) -> None:
    """``model.safetensors.index.json`` for a model split over several files."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


class HFTensors:
    """The tensors of a Hugging Face model directory: names, shapes and dtypes from the file
    headers (nothing else read), and one tensor's values at a time."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.file_of: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        for path, names in self._files().items():
            try:
                with safe_open(str(path), framework="np") as f:
                    present = set(f.keys())
                    for name in names if names is not None else sorted(present):
                        if name not in present:
                            raise HFFormatError(
                                f"{self.directory / INDEX_FILE} places tensor {name!r} in "
                                f"{path.name}, but that file has no such tensor: the download "
                                f"is incomplete or the index is stale."
                            )
                        piece = f.get_slice(name)
                        self.shapes[name] = tuple(piece.get_shape())
                        self.dtypes[name] = piece.get_dtype()
                        self.file_of[name] = path
            except SafetensorError as e:
                raise HFFormatError(
                    f"{path} is not a readable safetensors file ({e}): the download is "
                    f"incomplete or damaged; fetch it again."
                ) from None

    def _files(self) -> dict[Path, list[str] | None]:
        """Each weights file -> the tensor names the index places in it (None: all of them)."""
        files = _weight_files(self.directory)
        if files:
            return files
        other = sorted(p.name for p in self.directory.glob("*.bin")) + sorted(
            p.name for p in self.directory.glob("*.pth")
        )
        hint = (
            f" It has {', '.join(other)}: seqshard reads safetensors only; re-save the model "
            f"with save_pretrained (safe_serialization is the default)."
            if other
            else ""
        )
        raise HFFormatError(
            f"{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE}: no weights to "
            f"import.{hint}"
        )

    def read(self, name: str, rows: slice | None = None) -> np.ndarray:
        """One tensor's values (with ``rows``: those rows of its first dimension only), as
        stored (bf16 as ``ml_dtypes.bfloat16``)."""
        with safe_open(str(self.file_of[name]), framework="np") as f:
            return f.get_tensor(name) if rows is None else f.get_slice(name)[rows]


def _weight_files(directory: Path) -> dict[Path, list[str] | None]:
    """Each weights file of ``directory`` -> the tensor names its index places there (None:
    the single file, all of them); empty if it has neither an index nor the single file."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise HFFormatError(
                f"{index} is not a safetensors index (no weight_map: {e})."
            ) from None
        files: dict[Path, list[str] | None] = {}
        for name, file in weight_map.items():
            files.setdefault(directory / file, []).append(name)
        for path, names in files.items():
            if not path.is_file():
                raise HFFormatError(
                    f"{path} is missing: {index.name} places {len(names)} tensors in it "
                    f"(e.g. {names[0]}). Download or copy the whole model directory."
                )
        return files
    single = directory / SINGLE_FILE
    return {single: None} if single.is_file() else {}


def tensor_names(directory: str | Path) -> set[str]:
    """The names of the tensors a model directory's weights files hold (the index's, or the
    single file's header: no tensor is read); empty if it has no weights file."""
    names: set[str] = set()
    for path, listed in _weight_files(Path(directory)).items():
        if listed is not None:
            names.update(listed)
            continue
        try:
            with safe_open(str(path), framework="np") as f:
                names.update(f.keys())
        except SafetensorError as e:
            raise HFFormatError(
                f"{path} is not a readable safetensors file ({e}): the download is incomplete "
                f"or damaged; fetch it again."
            ) from None
    return names
