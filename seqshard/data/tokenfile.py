"""The on-disk token format: one directory per prepared data set.

    <dir>/meta.json                  format_version 2, dtype, vocab_size, tokenizer (+ sha256),
                                     source, per split: n_tokens, n_docs, max_id, sha256,
                                     has_mask, shards [{name, n_tokens, n_docs, max_id, sha256}]
    <dir>/tokenizer.json             the tokenizer that produced the ids (path in meta is relative)
    <dir>/<split>-NNNNN.bin          a shard's token ids, flat, in meta's dtype (no header)
    <dir>/<split>-NNNNN.offsets.npy  int64 [n_docs + 1]: document i is bin[offsets[i]:offsets[i+1]]
    <dir>/<split>-NNNNN.mask.bin     uint8 per token, 1 = counts in the loss (has_mask only)

Splits are ``train`` and ``val``, each its shards' documents in shard order; the split's
``sha256`` is its one shard's, or the sha256 of the lines ``name:sha256`` of its shards. A
format-1 directory (``<split>.bin`` and ``<split>.offsets.npy``, no shards) is read as one shard
named after the split. The dtype is the smallest unsigned one that holds every id (uint8 for
vocab <= 256, uint16 for <= 65536, else uint32), so a 4096-token vocab takes 2 bytes a token.
Each document ends with ``<|endoftext|>`` when meta's ``eot_id`` is set.

Files are written under temporary names and renamed when complete. :func:`open_split` checks
everything a corrupt or mismatched directory could get wrong that sizes and meta.json show,
and says how to fix it, without reading the tokens (see :class:`TokenSplit`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
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
    "Shard",
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
FORMAT_VERSION = 2
META_FILE = "meta.json"
SPLITS = ("train", "val")


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
    """Appends documents to one shard of a split, ``<name>.bin`` and ``<name>.offsets.npy``
    (and ``<name>.mask.bin``) under temporary names; :meth:`close` renames them into place and
    returns the shard's entry for meta.json. ``name`` defaults to the split's (format 1's one
    file a split); ``prepare`` writes ``train-00000``, ``train-00001``, ...

        with SplitWriter(out_dir, "train", np.uint16, name="train-00000") as w:
            w.add([[5, 9, 0], [7, 0]])
        w.summary   # {'name': 'train-00000', 'n_tokens': 5, 'n_docs': 2, 'max_id': 9,
                    #  'sha256': '...', 'has_mask': False}
    """

    def __init__(
        self,
        data_dir: str | os.PathLike,
        split: str,
        dtype: np.dtype | type,
        name: str | None = None,
    ) -> None:
        _check_split_name(split)
        self.data_dir, self.split, self.dtype = Path(data_dir), split, np.dtype(dtype)
        self.name = name or split
        self._bin = self.data_dir / f"{self.name}.bin"
        self._tmp = self._bin.with_name(self._bin.name + ".tmp")
        self._file = self._tmp.open("wb")
        self._sha = hashlib.sha256()
        self._lengths: list[np.ndarray] = []
        self._n_tokens = 0
        self._max_id = -1
        self._mask_tmp = self._bin.with_name(f"{self.name}.mask.bin.tmp")
        self._mask_file = None  # opened at the first masked document
        self.summary: dict | None = None

    def add(
        self,
        docs: Iterable[Sequence[int] | np.ndarray],
        masks: Sequence[np.ndarray | None] | None = None,
    ) -> None:
        """Append documents (each a sequence of ids) and, for fine-tuning data, their loss masks
        (1 where a token counts; None: every token counts). Once any document has a mask the
        split has a mask file (``has_mask``): documents without one count every token."""
        docs = list(docs)
        masks = [None] * len(docs) if masks is None else list(masks)
        kept = [(d, m) for d, m in zip(docs, masks, strict=True) if len(d)]
        if not kept:
            return
        docs = [d for d, _ in kept]
        if self._mask_file is None and any(m is not None for _, m in kept):
            self._mask_file = self._mask_tmp.open("wb")
            self._mask_file.write(b"\x01" * self._n_tokens)  # the earlier documents: all count
        if self._mask_file is not None:
            for d, m in kept:
                m = np.ones(len(d), np.uint8) if m is None else np.asarray(m, np.uint8)
                if len(m) != len(d):
                    raise ValueError(f"a loss mask of {len(m)} entries for {len(d)} tokens.")
                self._mask_file.write(m.tobytes())
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
        if self._mask_file is not None:
            self._mask_file.close()
            os.replace(self._mask_tmp, self._bin.with_name(f"{self.name}.mask.bin"))
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        off = self.data_dir / f"{self.name}.offsets.npy"
        off_tmp = off.with_name(off.name + ".tmp")
        with off_tmp.open("wb") as f:
            np.save(f, offsets)
        os.replace(off_tmp, off)
        os.replace(self._tmp, self._bin)
        self.summary = {
            "name": self.name,
            "n_tokens": self._n_tokens,
            "n_docs": len(lengths),
            "max_id": self._max_id,
            "sha256": self._sha.hexdigest(),
            "has_mask": self._mask_file is not None,
        }
        return self.summary

    def abort(self) -> None:
        """Close and delete the temporary files."""
        self._file.close()
        self._tmp.unlink(missing_ok=True)
        if self._mask_file is not None:
            self._mask_file.close()
            self._mask_tmp.unlink(missing_ok=True)

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


READABLE_VERSIONS = (1, 2)
"""Version 1: one ``<split>.bin`` and ``<split>.offsets.npy`` a split; 2: shards (see above)."""
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
    if meta["format_version"] not in READABLE_VERSIONS:
        raise ValueError(
            f"{path} has format_version {meta['format_version']!r}, but this seqshard reads "
            f"versions {list(READABLE_VERSIONS)}; {_fix(data_dir)}."
        )
    expected = dtype_for_vocab(int(meta["vocab_size"]))
    if meta["dtype"] != expected.name:
        raise ValueError(
            f"{path}: dtype {meta['dtype']!r} does not match vocab_size {meta['vocab_size']} "
            f"(expected {expected.name!r}); {_fix(data_dir)}."
        )
    return meta


@dataclasses.dataclass(frozen=True, eq=False)
class Shard:
    """One shard of a split, memory-mapped (nothing is read until used): its tokens, document
    offsets (int64 ``[n_docs + 1]``, from 0 to its token count) and, in fine-tuning data, its
    loss mask (uint8, 1 where the token counts as a prediction target).
    ``start`` is its first token's position in the split."""

    name: str
    path: Path
    start: int
    tokens: np.ndarray
    offsets: np.ndarray
    mask: np.ndarray | None

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)


def _entry_count(key: str, doc: str) -> property:
    """A TokenSplit property: the int ``key`` of its split's entry in meta.json."""
    return property(lambda split: int(split.entry[key]), doc=doc)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenSplit:
    """One checked split of a data directory: its shards, read as one stream of documents.

    Opening reads meta.json and each shard's sizes and end offsets, never the tokens, so it
    takes the same time and memory for 10^6 tokens as for 10^12. What only a full read could
    check (ids below the vocabulary) ``prepare`` recorded in meta.json (``max_id``), and
    :meth:`read` checks each span it returns.

        split = open_split("data/stdlib", "train")
        tokens, is_doc_start, mask = split.read(1000, 128)   # tokens 1000 .. 1127
    """

    data_dir: Path
    split: str
    shards: tuple[Shard, ...]
    meta: dict

    def __post_init__(self) -> None:
        starts = [s.start for s in self.shards] + [self.n_tokens]
        object.__setattr__(self, "_starts", np.asarray(starts, np.int64))
        doc_starts = np.cumsum([0] + [len(s.offsets) - 1 for s in self.shards])
        object.__setattr__(self, "_doc_starts", doc_starts.astype(np.int64))

    @property
    def entry(self) -> dict:
        return self.meta["splits"][self.split]

    n_tokens = _entry_count("n_tokens", "The tokens in the split.")
    n_docs = _entry_count("n_docs", "The documents in the split.")
    max_id = _entry_count("max_id", "The largest id in the split, as prepare recorded it.")

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    @property
    def has_mask(self) -> bool:
        return bool(self.entry.get("has_mask", False))

    @property
    def sha256(self) -> str:
        """The split's hash recorded by prepare (not recomputed)."""
        return str(self.entry.get("sha256", ""))

    @property
    def path(self) -> Path:
        """The split's token file, or a pattern naming its shards' files."""
        if len(self.shards) == 1:
            return self.shards[0].path
        return self.data_dir / f"{self.split}-*.bin"

    def doc(self, i: int) -> np.ndarray:
        """The ids of document ``i`` (in shard order)."""
        k = int(np.searchsorted(self._doc_starts, i, side="right")) - 1
        shard, j = self.shards[k], i - int(self._doc_starts[k])
        self._checked_offsets(shard, j, j + 1, int(shard.offsets[j]), int(shard.offsets[j + 1]) + 1)
        return shard.tokens[shard.offsets[j] : shard.offsets[j + 1]]

    def long_prompts(self, seq_len: int, sample: int = 4096) -> tuple[int, int]:
        """(records, of those examined) whose loss mask counts none of their first ``seq_len``
        tokens but some later one: a prompt of at least ``seq_len`` tokens, so no row of
        ``seq_len`` holds it with its completion. Fine-tuning data only ((0, 0) without a
        mask). At most ``sample`` records, evenly spread, are examined: the same start-up
        time for any size of split."""
        if not self.has_mask or self.n_docs == 0:
            return 0, 0
        picked = np.unique(np.linspace(0, self.n_docs - 1, min(sample, self.n_docs)).astype(int))
        long = 0
        for i in picked:
            k = int(np.searchsorted(self._doc_starts, i, side="right")) - 1
            shard, j = self.shards[k], int(i) - int(self._doc_starts[k])
            if shard.mask is None:
                continue
            lo, hi = int(shard.offsets[j]), int(shard.offsets[j + 1])
            mask = shard.mask[lo:hi]
            long += bool(not mask[:seq_len].any() and mask[seq_len:].any())
        return long, len(picked)

    def read(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Tokens ``start .. start + length - 1`` of the split (int32), whether a document
        begins at each (bool) and the loss mask (bool; all True without a mask file); the span
        may cross shards, not the split's end."""
        if not 0 <= start <= start + length <= self.n_tokens:
            raise ValueError(
                f"span [{start}, {start + length}) is outside {self.split}'s {self.n_tokens} tokens."
            )
        tokens = np.empty(length, np.int32)
        doc_start = np.zeros(length, np.bool_)
        mask = np.ones(length, np.bool_)
        k = int(np.searchsorted(self._starts, start, side="right")) - 1
        done = 0
        while done < length:
            shard = self.shards[k]
            lo = start + done - shard.start
            hi = min(shard.n_tokens, lo + length - done)
            tokens[done : done + hi - lo] = shard.tokens[lo:hi]
            first, last = np.searchsorted(shard.offsets, [lo, hi], side="left")
            starts = self._checked_offsets(shard, first, last, lo, hi)
            doc_start[starts - lo + done] = True
            if shard.mask is not None:
                mask[done : done + hi - lo] = shard.mask[lo:hi]
            done, k = done + hi - lo, k + 1
        self._check_ids(tokens, start)
        return tokens, doc_start, mask

    def _checked_offsets(self, shard: Shard, first: int, last: int, lo: int, hi: int) -> np.ndarray:
        """The document starts in tokens ``[lo, hi)`` of ``shard``: its offsets ``first ..
        last - 1`` (a binary search found them), checked with their neighbours: rising, and
        inside the span. Opening checked only the first and last offset (reading them all would
        make start-up grow with the corpus); a corrupt inner one is caught here, by name."""
        base = max(first - 1, 0)
        around = np.asarray(shard.offsets[base : min(last + 1, len(shard.offsets))])
        starts = np.asarray(shard.offsets[first:last])
        outside = (around < 0) | (around > shard.n_tokens)
        falling = np.append(np.diff(around) < 0, False)
        in_span = len(starts) == 0 or (starts[0] >= lo and starts[-1] < hi)
        if not outside.any() and not falling.any() and in_span:
            return starts
        flagged = np.flatnonzero(outside) if outside.any() else np.flatnonzero(falling)
        bad = base + int(flagged[0]) if len(flagged) else base
        near = ", ".join(
            f"[{k}] {int(shard.offsets[k])}"
            for k in range(max(bad - 1, 0), min(bad + 2, len(shard.offsets)))
        )
        path = shard.path.with_name(f"{shard.name}.offsets.npy")
        raise ValueError(
            f"{path} is corrupt: entry {bad} of {len(shard.offsets)} is out of order or range "
            f"({near}); expected document offsets rising from 0 to the shard's "
            f"{shard.n_tokens} tokens; {_fix(self.data_dir)}."
        )

    def _check_ids(self, tokens: np.ndarray, start: int) -> None:
        if len(tokens) and int(tokens.max()) >= self.vocab_size:
            at = start + int(np.argmax(tokens >= self.vocab_size))
            k = int(np.searchsorted(self._starts, at, side="right")) - 1
            shard = self.shards[k]
            raise ValueError(
                f"{shard.path} holds token id {int(tokens.max())} at position "
                f"{at - shard.start}, outside the vocabulary of {self.vocab_size} in meta.json "
                f"(expected ids < {self.vocab_size}): the file is corrupt or from another "
                f"tokenizer; {_fix(self.data_dir)}."
            )


def _mapped(path: Path, dtype: np.dtype, offset: int = 0) -> np.ndarray:
    """The file from ``offset`` on as a read-only array, memory-mapped for random access: the
    kernel reads only the pages touched (no read-ahead around them), so a row read from a
    terabyte file costs its own pages, in I/O and in resident memory."""
    with path.open("rb") as f:
        if path.stat().st_size <= offset:
            return np.empty(0, dtype)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if hasattr(mm, "madvise"):
        mm.madvise(mmap.MADV_RANDOM)
    return np.frombuffer(mm, dtype=dtype, offset=offset)


def _mapped_npy(path: Path) -> np.ndarray:
    """A 1-D .npy file through :func:`_mapped`; ValueError if it is not one."""
    with path.open("rb") as f:
        version = np.lib.format.read_magic(f)
        read_header = (
            np.lib.format.read_array_header_1_0
            if version == (1, 0)
            else np.lib.format.read_array_header_2_0
        )
        shape, fortran_order, dtype = read_header(f)
        offset = f.tell()
    if len(shape) != 1 or fortran_order:
        raise ValueError(f"expected a 1-D array, got shape {shape}")
    return _mapped(path, np.dtype(dtype), offset)[: shape[0]]


def _shard_entries(meta: dict, split: str) -> list[dict]:
    """The split's shards as meta.json lists them; a version-1 directory's split is one shard
    named after the split (``train.bin``, ``train.offsets.npy``)."""
    entry = meta["splits"][split]
    if "shards" in entry:
        return list(entry["shards"])
    return [{key: entry[key] for key in ("n_tokens", "n_docs", "max_id")} | {"name": split}]


def _open_shard(data_dir: Path, entry: dict, start: int, dtype: np.dtype, masked: bool) -> Shard:
    """Map one shard's files, checking what is cheap: sizes, the offsets' dtype, shape and end
    values (two entries read)."""
    fix = _fix(data_dir)
    name, n_tokens, n_docs = entry["name"], int(entry["n_tokens"]), int(entry["n_docs"])
    path = data_dir / f"{name}.bin"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; {fix}.")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise ValueError(
            f"{path} is {size} bytes, not a multiple of {dtype.itemsize} (the size of "
            f"{dtype.name}, meta.json's dtype): the file is truncated or corrupt; {fix}."
        )
    if size // dtype.itemsize != n_tokens:
        raise ValueError(
            f"{path} holds {size // dtype.itemsize} tokens but meta.json says {n_tokens}: the "
            f"file was changed or truncated after prepare; {fix}."
        )
    off_path = data_dir / f"{name}.offsets.npy"
    if not off_path.is_file():
        raise FileNotFoundError(f"{off_path} is missing; {fix}.")
    try:
        offsets = _mapped_npy(off_path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{off_path} is not a readable .npy file ({e}); {fix}.") from None
    if offsets.dtype != np.int64 or offsets.shape != (n_docs + 1,):
        raise ValueError(
            f"{off_path}: expected int64 offsets of shape ({n_docs + 1},) (n_docs + 1 from "
            f"meta.json), got {offsets.dtype} of shape {offsets.shape}; {fix}."
        )
    if offsets[0] != 0 or offsets[-1] != n_tokens:
        raise ValueError(
            f"{off_path} is inconsistent with {path}: expected offsets from 0 to {n_tokens} "
            f"(the token count), got first {int(offsets[0])}, last {int(offsets[-1])}; {fix}."
        )
    mask = None
    if masked:
        mask_path = data_dir / f"{name}.mask.bin"
        if not mask_path.is_file() or mask_path.stat().st_size != n_tokens:
            actual = mask_path.stat().st_size if mask_path.is_file() else "no file"
            raise ValueError(
                f"{mask_path}: expected a loss mask of {n_tokens} bytes (one per token, "
                f"meta.json's has_mask is true), got {actual}; {fix}."
            )
        mask = _mapped(mask_path, np.dtype(np.uint8))
    tokens = _mapped(path, dtype)
    return Shard(name, path, start, tokens, offsets, mask)


def open_split(data_dir: str | os.PathLike, split: str) -> TokenSplit:
    """Open and check one split: meta, each shard's sizes and end offsets, the recorded largest
    id against the vocabulary. Reads no tokens (see :class:`TokenSplit`)."""
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
    if int(entry["n_tokens"]) == 0:
        raise ValueError(
            f"{data_dir}'s {split} split is empty (0 tokens, {entry.get('n_docs', 0)} "
            f"documents): nothing to read. Give prepare more text"
            + (", or a larger --val-fraction" if split == "val" else "")
            + f"; {fix}."
        )
    dtype = np.dtype(meta["dtype"])
    shards, start = [], 0
    for shard_entry in _shard_entries(meta, split):
        shard = _open_shard(data_dir, shard_entry, start, dtype, bool(entry.get("has_mask")))
        shards.append(shard)
        start += shard.n_tokens
    if start != int(entry["n_tokens"]):
        raise ValueError(
            f"{data_dir / META_FILE}: the {split} split's shards hold {start} tokens but the "
            f"split says {entry['n_tokens']}; {fix}."
        )
    vocab_size = int(meta["vocab_size"])
    if int(entry["max_id"]) >= vocab_size:
        raise ValueError(
            f"{data_dir / META_FILE}: the {split} split's largest id is {entry['max_id']}, "
            f"outside the vocabulary of {vocab_size} (expected ids < {vocab_size}): the data is "
            f"from another tokenizer; {fix}."
        )
    return TokenSplit(data_dir, split, tuple(shards), meta)


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
