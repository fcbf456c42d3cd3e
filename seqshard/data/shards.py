"""Pass 2 of ``prepare``: the documents in units of bounded size, each unit encoded into its own
train and val shard by a pool of worker processes, each finished unit recorded, so a killed
``prepare`` resumes from its finished shards.

    units = document_units(enumerate(corpus), shard_tokens=2**27)   # decided by the text alone
    shards = encode_units(units, UnitSpec(tmp, tokenizer_file, eot, "uint16"), in_val, workers=8)

A unit is consecutive documents whose UTF-8 bytes, plus one a document (its end-of-text
token), stay within ``shard_tokens`` (a document larger than that is a unit alone). A
byte-level BPE never makes more tokens than bytes, so its shards hold at most ``shard_tokens``
tokens; other tokenizers may exceed it slightly. Units depend on the text alone and each is
encoded the same way wherever it runs, so the output is the same files for any number of
workers. Unit ``k`` writes ``train-k`` and ``val-k`` (a split's shard only when it has
documents), then ``units/k.json``; a unit whose record and files are in place, each ``.bin``
hashing to its recorded sha256, is not encoded again (a damaged one is, with a line saying so).

The workers ignore SIGINT: Ctrl-C reaches the whole process group, and only this process acts
on it (the pool is terminated as the KeyboardInterrupt leaves :func:`encode_units`). A full
disk is one line, :class:`PrepareWriteError`: the file, the OS error, the bytes the write
needed and the space free.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import errno
import functools
import hashlib
import json
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from seqshard.data.sft import Pieces
from seqshard.data.tokenfile import SPLITS, SplitWriter
from seqshard.data.tokenizer import Tokenizer, load_tokenizer
from seqshard.files import free_space, write_whole
from seqshard.shardlib.tables import format_bytes

__all__ = [
    "PrepareWriteError",
    "UnitSpec",
    "document_units",
    "encode_units",
    "split_entry",
    "writing",
]

PROGRESS_EVERY_S = 5.0  # seconds between prepare's progress lines while it encodes
RECORDS = "units"  # <tmp>/units/<k>.json: a finished unit's shard entries
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class PrepareWriteError(OSError):
    """A write of ``prepare`` found the disk (or the quota) full; its message is the whole
    line. Made of ``(errno, message)`` alone, so it comes back from a worker process intact."""

    def __str__(self) -> str:
        return self.strerror


@contextlib.contextmanager
def writing(path: Path, needed: int) -> Iterator[None]:
    """The block writes ``path`` (about ``needed`` bytes): a full disk there raises
    :class:`PrepareWriteError` naming the file, the bytes and the space free."""
    try:
        yield
    except PrepareWriteError:
        raise
    except OSError as e:
        if e.errno not in _DISK_FULL:
            raise
        raise PrepareWriteError(
            e.errno,
            f"could not write {path}: [Errno {e.errno}] {e.strerror}. The write needed about "
            f"{format_bytes(needed)}; {path.parent} has {free_space(path.parent)}. Free space there "
            f"and rerun the same command (it keeps the shards already finished), or prepare "
            f"into another --out.",
        ) from None


def _size(doc: str | Pieces) -> int:
    text = doc if isinstance(doc, str) else doc.text
    return len(text.encode("utf-8")) + 1


def document_units(
    docs: Iterable[tuple[int, str | Pieces]], shard_tokens: int
) -> Iterator[list[tuple[int, str | Pieces]]]:
    """Consecutive ``(index, document)`` pairs grouped into units (see the module docstring)."""
    unit, size = [], 0
    for item in docs:
        n = _size(item[1])
        if unit and size + n > shard_tokens:
            yield unit
            unit, size = [], 0
        unit.append(item)
        size += n
    if unit:
        yield unit


@dataclasses.dataclass(frozen=True)
class UnitSpec:
    """What every unit is encoded with."""

    tmp: Path
    tokenizer: Path  # tokenizer.json, loaded once per worker
    eot: int | None
    dtype: str


def encode(
    tok: Tokenizer, docs: list[str | Pieces], eot: int | None
) -> list[tuple[list[int], np.ndarray | None]]:
    """Each document's ids (then ``eot``) and loss mask (None for plain text: all count). A
    fine-tuning document's pieces are encoded one by one (one batch for all), so no token
    straddles a counted and an uncounted span."""
    texts = [text for doc in docs for text in _texts(doc)]
    encodings = iter(tok.encode_batch(texts, add_special_tokens=False))
    end = [] if eot is None else [eot]
    out = []
    for doc in docs:
        if isinstance(doc, str):
            out.append((next(encodings).ids + end, None))
            continue
        ids, mask = [], []
        for _, counted in doc.parts:
            piece = next(encodings).ids
            ids += piece
            mask += [counted] * len(piece)
        out.append((ids + end, np.asarray(mask + [doc.end_counted] * len(end), np.uint8)))
    return out


def _texts(doc: str | Pieces) -> list[str]:
    return [doc] if isinstance(doc, str) else [text for text, _ in doc.parts]


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str) -> Tokenizer:
    return load_tokenizer(path)


def _record_path(tmp: Path, k: int) -> Path:
    return tmp / RECORDS / f"{k:05d}.json"


def _encode_unit(spec_and_unit: tuple[UnitSpec, int, list[tuple[int, str | Pieces]], list[bool]]):
    """One unit's shards (in a worker): {split: shard entry}, recorded when complete."""
    spec, k, unit, val = spec_and_unit
    encoded = encode(_tokenizer(str(spec.tokenizer)), [doc for _, doc in unit], spec.eot)
    itemsize = np.dtype(spec.dtype).itemsize
    out = {}
    for split in SPLITS:
        mine = [e for e, v in zip(encoded, val, strict=True) if v == (split == "val")]
        if not mine:
            continue
        name = f"{split}-{k:05d}"
        n_tokens = sum(len(ids) for ids, _ in mine)
        mask_bytes = n_tokens if any(mask is not None for _, mask in mine) else 0
        needed = n_tokens * itemsize + mask_bytes + 8 * (len(mine) + 1)  # .bin, mask, offsets
        with (
            writing(spec.tmp / f"{name}.bin", needed),
            SplitWriter(spec.tmp, split, spec.dtype, name=name) as writer,
        ):
            writer.add([ids for ids, _ in mine], [mask for _, mask in mine])
        out[split] = writer.summary
    record = _record_path(spec.tmp, k)
    record.parent.mkdir(exist_ok=True)
    text = json.dumps(out).encode()
    with writing(record, len(text)):
        write_whole(record, text)
    return out


def _finished(tmp: Path, k: int, itemsize: int, log: Callable[[str], None]) -> dict | None:
    """Unit ``k``'s shard entries if its record and files are complete: sizes as recorded, each
    ``.bin`` hashing to its recorded sha256, offsets ending at its token count. A unit that
    was recorded but no longer holds is said so (it is encoded again)."""
    path = _record_path(tmp, k)
    if not path.is_file():
        return None
    try:
        out = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        log(f"prepare: {path} is damaged (not JSON); encoding unit {k} again")
        return None
    for entry in out.values():
        damage = _shard_damage(tmp, entry, itemsize)
        if damage:
            log(f"prepare: {tmp / entry['name']}{damage}; encoding unit {k} again")
            return None
    return out


def _shard_damage(tmp: Path, entry: dict, itemsize: int) -> str:
    """What is wrong with a recorded shard's files (``''``: nothing)."""
    name, n = entry["name"], entry["n_tokens"]
    sizes = {".bin": n * itemsize} | ({".mask.bin": n} if entry["has_mask"] else {})
    for suffix, size in sizes.items():
        file = tmp / f"{name}{suffix}"
        if not file.is_file():
            return f"{suffix} is missing"
        if file.stat().st_size != size:
            return f"{suffix} holds {file.stat().st_size} bytes, not the {size} recorded"
    try:
        offsets = np.load(tmp / f"{name}.offsets.npy")
    except (OSError, ValueError) as e:
        return f".offsets.npy is unreadable ({e})"
    if offsets.shape != (entry["n_docs"] + 1,) or offsets[-1] != n:
        return f".offsets.npy does not fit the {entry['n_docs']} documents recorded"
    sha = hashlib.sha256()
    with open(tmp / f"{name}.bin", "rb") as f:
        while block := f.read(1 << 24):
            sha.update(block)
    if sha.hexdigest() != entry["sha256"]:
        return ".bin does not match its recorded sha256 (damaged since it was written)"
    return ""


def encode_units(
    units: Iterable[list[tuple[int, str | Pieces]]],
    spec: UnitSpec,
    in_val: Callable[[int], bool],
    workers: int,
    log: Callable[[str], None],
    n_docs: int | None = None,
) -> list[dict[str, dict]]:
    """Every unit's ``{split: shard entry}``, in unit order: finished ones read back, the others
    encoded by ``workers`` processes (1: in this one), at most two per worker in flight (the
    corpus is read as they finish, never held whole). ``n_docs``: the corpus's documents (pass
    1 counted them), for the progress line's total."""
    itemsize = np.dtype(spec.dtype).itemsize
    results: list[dict[str, dict]] = []
    reused = 0
    t_last = time.perf_counter()
    ends: list[int] = []  # per unit: the documents up to its end

    def jobs():
        nonlocal reused
        for k, unit in enumerate(units):
            done = _finished(spec.tmp, k, itemsize, log)
            if done is not None:
                reused += 1
            ends.append(unit[-1][0] + 1 if unit else 0)
            yield k, unit, done

    def report():
        nonlocal t_last
        if time.perf_counter() - t_last > PROGRESS_EVERY_S:
            t_last = time.perf_counter()
            docs = ends[len(results) - 1] if results else 0
            total = f" of {n_docs:,} ({docs / max(n_docs, 1):.0%})" if n_docs else ""
            log(
                f"prepare: {len(results)} shards done, {docs:,}{total} documents ({reused} "
                f"shards from an earlier run)"
            )

    if workers == 1:
        for k, unit, done in jobs():
            results.append(done or _encode_unit((spec, k, unit, [in_val(i) for i, _ in unit])))
            report()
    else:
        # Each worker's tokenizer encodes on a Rust thread pool: share the cores among them.
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        with _environment(RAYON_NUM_THREADS=threads):
            with _sigint_ignored():  # while the workers start (they inherit it): _ignore_sigint
                pool = multiprocessing.get_context("spawn").Pool(workers, _ignore_sigint)
            # Leaving the block in any way (Ctrl-C here included) terminates the workers.
            with pool:
                pending: collections.deque = collections.deque()
                for k, unit, done in jobs():
                    val = [in_val(i) for i, _ in unit]
                    pending.append(done or pool.apply_async(_encode_unit, ((spec, k, unit, val),)))
                    while len(pending) > 2 * workers:
                        results.append(_result(pending.popleft()))
                        report()
                while pending:
                    results.append(_result(pending.popleft()))
    if reused:
        log(f"prepare: reused {reused} of {len(results)} units finished by an earlier run")
    return results


def _ignore_sigint() -> None:
    """A worker's initializer: Ctrl-C goes to the whole process group, and only the parent acts
    on it (else every worker prints its own KeyboardInterrupt traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def _sigint_ignored():
    """SIGINT ignored while the block runs: a process started in it ignores SIGINT from its
    first instruction (Python keeps an ignored SIGINT ignored), before its initializer runs."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; its own handler decides then
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@contextlib.contextmanager
def _environment(**values: str):
    """Environment variables set while the block runs (spawned workers inherit them)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _result(item):
    return item if isinstance(item, dict) else item.get()


def split_entry(shards: list[dict], tmp: Path) -> dict:
    """A split's meta.json entry from its shards' (in order). Once one shard has a loss mask,
    every shard gets one (all 1 where its data had none)."""
    has_mask = any(s["has_mask"] for s in shards)
    for s in shards:
        if has_mask and not s["has_mask"]:
            path = tmp / f"{s['name']}.mask.bin"
            with writing(path, s["n_tokens"]):
                path.write_bytes(b"\x01" * s["n_tokens"])
            s["has_mask"] = True
    sha = (
        shards[0]["sha256"]
        if len(shards) == 1
        else _sha256("".join(f"{s['name']}:{s['sha256']}\n" for s in shards))
    )
    return {
        "n_tokens": sum(s["n_tokens"] for s in shards),
        "n_docs": sum(s["n_docs"] for s in shards),
        "max_id": max((s["max_id"] for s in shards), default=-1),
        "sha256": sha,
        "has_mask": has_mask,
        "shards": shards,
    }


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
