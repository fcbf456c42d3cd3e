"""The on-disk token format: one directory per prepared data set.

    <dir>/meta.json              format, dtype, vocab_size, tokenizer (+ sha256), source, splits
    <dir>/tokenizer.json         the tokenizer that produced the ids (path in meta is relative)
    <dir>/<split>.bin            all token ids of the split, flat, in meta's dtype (no header)
    <dir>/<split>.offsets.npy    int64 [n_docs + 1]: document i is bin[offsets[i]:offsets[i+1]]

Splits are ``train`` and ``val``. The dtype is the smallest unsigned one that holds every id
(uint8 for vocab <= 256, uint16 for <= 65536, else uint32), so the .bin of a 4096-token vocab
takes 2 bytes a token. Each document ends with ``<|endoftext|>`` when meta's ``eot_id`` is set.

Files are written under temporary names and renamed when complete. :func:`open_split` checks
everything a corrupt or mismatched directory could get wrong and says how to fix it; the check
of the ids against the vocabulary reads the .bin once per process (a chunked max).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from seqshard.data.tokenizer import tokenizer_hash

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "META_FILE",
    "SPLITS",
    "SplitWriter",
    "TokenSplit",
    "bin_path",
    "check_tokenizer",
    "dtype_for_vocab",
    "offsets_path",
    "open_split",
    "read_meta",
    "write_meta",
]

FORMAT = "seqshard-tokens"
FORMAT_VERSION = 1
META_FILE = "meta.json"
SPLITS = ("train", "val")
_SCAN_CHUNK = 1 << 24  # tokens per chunk when scanning a .bin (32 MiB of uint16)


def _fix(data_dir: Path) -> str:
    return f"run `seqshard prepare --out {data_dir}` to (re)create it"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest unsigned integer dtype that holds ids ``0 .. vocab_size - 1``."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}.")
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ValueError(f"vocab_size {vocab_size} does not fit in uint32; the largest is 2**32.")


def bin_path(data_dir: str | os.PathLike, split: str) -> Path:
    """``<data_dir>/<split>.bin``."""
    return Path(data_dir) / f"{split}.bin"


def offsets_path(data_dir: str | os.PathLike, split: str) -> Path:
    """``<data_dir>/<split>.offsets.npy``."""
    return Path(data_dir) / f"{split}.offsets.npy"


def _check_split_name(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")


class SplitWriter:
    """Appends documents to ``<split>.bin`` and ``<split>.offsets.npy`` under temporary names;
    :meth:`close` renames them into place and returns the split's entry for meta.json.

        with SplitWriter(out_dir, "train", np.uint16) as w:
            w.add([[5, 9, 0], [7, 0]])
        w.summary   # {'n_tokens': 5, 'n_docs': 2, 'max_id': 9, 'sha256': '...'}
    """

    def __init__(self, data_dir: str | os.PathLike, split: str, dtype: np.dtype | type) -> None:
        _check_split_name(split)
        self.data_dir, self.split, self.dtype = Path(data_dir), split, np.dtype(dtype)
        self._bin = bin_path(data_dir, split)
        self._tmp = self._bin.with_name(self._bin.name + ".tmp")
        self._file = self._tmp.open("wb")
        self._sha = hashlib.sha256()
        self._lengths: list[np.ndarray] = []
        self._n_tokens = 0
        self._max_id = -1
        self.summary: dict | None = None

    def add(self, docs: Iterable[Sequence[int] | np.ndarray]) -> None:
        """Append documents (each a sequence of ids); empty documents are skipped."""
        docs = [d for d in docs if len(d)]
        if not docs:
            return
        lengths = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        flat = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs])
        lo, hi = int(flat.min()), int(flat.max())
        if lo < 0 or hi > np.iinfo(self.dtype).max:
            raise ValueError(
                f"{self._bin}: token ids must lie in [0, {np.iinfo(self.dtype).max}] for dtype "
                f"{self.dtype}, got range [{lo}, {hi}]; the dtype comes from the vocab size."
            )
        data = flat.astype(self.dtype).tobytes()
        self._file.write(data)
        self._sha.update(data)
        self._lengths.append(lengths)
        self._n_tokens += len(flat)
        self._max_id = max(self._max_id, hi)

    def close(self) -> dict:
        """Finish the files (rename into place); returns and keeps :attr:`summary`."""
        if self.summary is not None:
            return self.summary
        self._file.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        off = offsets_path(self.data_dir, self.split)
        off_tmp = off.with_name(off.name + ".tmp")
        with off_tmp.open("wb") as f:
            np.save(f, offsets)
        os.replace(off_tmp, off)
        os.replace(self._tmp, self._bin)
        self.summary = {
            "n_tokens": self._n_tokens,
            "n_docs": len(lengths),
            "max_id": self._max_id,
            "sha256": self._sha.hexdigest(),
        }
        return self.summary

    def abort(self) -> None:
        """Close and delete the temporary files."""
        self._file.close()
        self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> SplitWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_meta(data_dir: str | os.PathLike, meta: dict) -> Path:
    """Write ``meta.json`` atomically (temporary file, then rename)."""
    path = Path(data_dir) / META_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path


_META_KEYS = ("format_version", "dtype", "vocab_size", "tokenizer", "tokenizer_sha256", "splits")


def read_meta(data_dir: str | os.PathLike) -> dict:
    """Read and check ``<data_dir>/meta.json``: it exists, parses, has this format's version and
    keys, and its dtype holds its vocabulary."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        hint = ""
        if Path(f"{data_dir}.tmp").exists():
            hint = f" ({data_dir}.tmp exists: an earlier prepare did not finish; delete it)"
        raise FileNotFoundError(
            f"data directory {data_dir} does not exist{hint}; {_fix(data_dir)}."
        )
    path = data_dir / META_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing, so {data_dir} is not a prepared data directory; {_fix(data_dir)}."
        )
    try:
        meta = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); {_fix(data_dir)}.") from None
    missing = [k for k in _META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise ValueError(
            f"{path} lacks the keys {missing} (expected all of {list(_META_KEYS)}); it was not "
            f"written by `seqshard prepare` or is from an old version; {_fix(data_dir)}."
        )
    if meta["format_version"] != FORMAT_VERSION:
        raise ValueError(
            f"{path} has format_version {meta['format_version']!r}, but this seqshard reads "
            f"version {FORMAT_VERSION}; {_fix(data_dir)}."
        )
    expected = dtype_for_vocab(int(meta["vocab_size"]))
    if meta["dtype"] != expected.name:
        raise ValueError(
            f"{path}: dtype {meta['dtype']!r} does not match vocab_size {meta['vocab_size']} "
            f"(expected {expected.name!r}); {_fix(data_dir)}."
        )
    return meta


@functools.lru_cache(maxsize=64)
def _scan_max(path: str, dtype: str, size: int, mtime_ns: int) -> int:
    """Largest id in a .bin, read in chunks; cached on (path, size, mtime), so once a process."""
    del size, mtime_ns  # cache key only: a rewritten file is scanned again
    tokens = np.memmap(path, dtype=dtype, mode="r")
    return max(int(tokens[i : i + _SCAN_CHUNK].max()) for i in range(0, len(tokens), _SCAN_CHUNK))


@dataclasses.dataclass(frozen=True, eq=False)
class TokenSplit:
    """One checked split of a data directory: its tokens (a read-only memmap, never loaded
    whole) and document offsets. ``doc(i)`` is the ids of document ``i``."""

    data_dir: Path
    split: str
    tokens: np.ndarray  # np.memmap [n_tokens], meta dtype
    offsets: np.ndarray  # int64 [n_docs + 1]
    meta: dict
    max_id: int

    @property
    def n_tokens(self) -> int:
        return int(self.offsets[-1])

    @property
    def n_docs(self) -> int:
        return len(self.offsets) - 1

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def sha256(self) -> str:
        """The sha256 of the .bin recorded by prepare (not recomputed)."""
        return str(self.meta["splits"][self.split].get("sha256", ""))

    @property
    def path(self) -> Path:
        return bin_path(self.data_dir, self.split)

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def open_split(data_dir: str | os.PathLike, split: str) -> TokenSplit:
    """Open and check one split: meta, .bin size and dtype, offsets, ids < vocab_size."""
    _check_split_name(split)
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    fix = _fix(data_dir)
    if split not in meta["splits"]:
        raise ValueError(
            f"{data_dir / META_FILE} has no {split!r} split (it has {sorted(meta['splits'])}); "
            f"{fix}."
        )
    entry = meta["splits"][split]
    dtype = np.dtype(meta["dtype"])

    path = bin_path(data_dir, split)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; {fix}.")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(
            f"{path} is {size} bytes, not a multiple of {dtype.itemsize} (the size of "
            f"{dtype.name}, meta.json's dtype): the file is truncated or corrupt; {fix}."
        )
    n_tokens = size // dtype.itemsize
    if n_tokens != entry["n_tokens"]:
        raise ValueError(
            f"{path} holds {n_tokens} tokens but meta.json says {entry['n_tokens']}: the file "
            f"was changed or truncated after prepare; {fix}."
        )
    if n_tokens == 0:
        raise ValueError(
            f"{path} is empty (0 tokens, {entry.get('n_docs', 0)} documents): nothing to read. "
            f"Give prepare more text"
            + (", or a larger --val-fraction" if split == "val" else "")
            + f"; {fix}."
        )

    off_path = offsets_path(data_dir, split)
    if not off_path.is_file():
        raise FileNotFoundError(f"{off_path} is missing; {fix}.")
    try:
        offsets = np.load(off_path, allow_pickle=False)
    except ValueError as e:
        raise ValueError(f"{off_path} is not a readable .npy file ({e}); {fix}.") from None
    n_docs = int(entry["n_docs"])
    if offsets.dtype != np.int64 or offsets.shape != (n_docs + 1,):
        raise ValueError(
            f"{off_path}: expected int64 offsets of shape ({n_docs + 1},) (n_docs + 1 from "
            f"meta.json), got {offsets.dtype} of shape {offsets.shape}; {fix}."
        )
    if offsets[0] != 0 or offsets[-1] != n_tokens or np.any(np.diff(offsets) <= 0):
        raise ValueError(
            f"{off_path} is inconsistent with {path}: expected offsets rising strictly from 0 to "
            f"{n_tokens} (the token count), got first {int(offsets[0])}, last "
            f"{int(offsets[-1])}, {int(np.sum(np.diff(offsets) <= 0))} non-rising steps; {fix}."
        )

    stat = path.stat()
    max_id = _scan_max(str(path.resolve()), dtype.name, stat.st_size, stat.st_mtime_ns)
    vocab_size = int(meta["vocab_size"])
    if max_id >= vocab_size:
        raise ValueError(
            f"{path} holds token id {max_id}, outside the vocabulary of {vocab_size} in "
            f"meta.json (expected ids < {vocab_size}): the file is corrupt or from another "
            f"tokenizer; {fix}."
        )
    tokens = np.memmap(path, dtype=dtype, mode="r")
    return TokenSplit(data_dir, split, tokens, offsets, meta, max_id)


def check_tokenizer(
    data_dir: str | os.PathLike, tokenizer_path: str | os.PathLike | None = None
) -> Path:
    """Check that a tokenizer file (default: the one meta.json names) is the one that produced
    the data, by sha256; returns its path."""
    data_dir = Path(data_dir)
    meta = read_meta(data_dir)
    path = data_dir / meta["tokenizer"] if tokenizer_path is None else Path(tokenizer_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer {path} (named by {data_dir / META_FILE}) is missing; {_fix(data_dir)}."
        )
    actual = tokenizer_hash(path)
    if actual != meta["tokenizer_sha256"]:
        raise ValueError(
            f"tokenizer {path} has sha256 {actual[:16]}..., but the data in {data_dir} was "
            f"tokenized with sha256 {meta['tokenizer_sha256'][:16]}... (meta.json): ids would "
            f"decode to the wrong text. Use {data_dir / meta['tokenizer']}, or re-run "
            f"`seqshard prepare --out {data_dir} --tokenizer {path}`."
        )
    return path
