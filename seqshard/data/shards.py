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
documents), then ``units/k.json``; a unit whose record and files are in place is not encoded
again.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np

from seqshard.data.sft import Pieces
from seqshard.data.tokenfile import SPLITS, SplitWriter
from seqshard.data.tokenizer import Tokenizer, load_tokenizer

__all__ = ["UnitSpec", "document_units", "encode_units", "split_entry"]

RECORDS = "units"  # <tmp>/units/<k>.json: a finished unit's shard entries


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
    out = {}
    for split in SPLITS:
        mine = [e for e, v in zip(encoded, val, strict=True) if v == (split == "val")]
        if not mine:
            continue
        with SplitWriter(spec.tmp, split, spec.dtype, name=f"{split}-{k:05d}") as writer:
            writer.add([ids for ids, _ in mine], [mask for _, mask in mine])
        out[split] = writer.summary
    record = _record_path(spec.tmp, k)
    record.parent.mkdir(exist_ok=True)
    partial = record.with_name(record.name + ".tmp")
    partial.write_text(json.dumps(out))
    os.replace(partial, record)
    return out


def _finished(tmp: Path, k: int, itemsize: int) -> dict | None:
    """Unit ``k``'s shard entries if its record and files are complete (sizes as recorded)."""
    path = _record_path(tmp, k)
    if not path.is_file():
        return None
    try:
        out = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    for entry in out.values():
        name, n = entry["name"], entry["n_tokens"]
        files = {f"{name}.bin": n * itemsize} | (
            {f"{name}.mask.bin": n} if entry["has_mask"] else {}
        )
        if any(
            not (tmp / f).is_file() or (tmp / f).stat().st_size != size for f, size in files.items()
        ):
            return None
        if not (tmp / f"{name}.offsets.npy").is_file():
            return None
    return out


def encode_units(
    units: Iterable[list[tuple[int, str | Pieces]]],
    spec: UnitSpec,
    in_val: Callable[[int], bool],
    workers: int,
    log: Callable[[str], None],
) -> list[dict[str, dict]]:
    """Every unit's ``{split: shard entry}``, in unit order: finished ones read back, the others
    encoded by ``workers`` processes (1: in this one), at most two per worker in flight (the
    corpus is read as they finish, never held whole)."""
    itemsize = np.dtype(spec.dtype).itemsize
    results: list[dict[str, dict]] = []
    reused = 0
    t_last = time.perf_counter()

    def jobs():
        nonlocal reused
        for k, unit in enumerate(units):
            done = _finished(spec.tmp, k, itemsize)
            if done is not None:
                reused += 1
            yield k, unit, done

    def report():
        nonlocal t_last
        if time.perf_counter() - t_last > 5:
            t_last = time.perf_counter()
            log(f"prepare: {len(results)} shards done ({reused} from an earlier run)")

    if workers == 1:
        for k, unit, done in jobs():
            results.append(done or _encode_unit((spec, k, unit, [in_val(i) for i, _ in unit])))
            report()
    else:
        # Each worker's tokenizer encodes on a Rust thread pool: share the cores among them.
        threads = str(max(1, (os.cpu_count() or 1) // workers))
        with (
            _environment(RAYON_NUM_THREADS=threads),
            multiprocessing.get_context("spawn").Pool(workers) as pool,
        ):
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
            (tmp / f"{s['name']}.mask.bin").write_bytes(b"\x01" * s["n_tokens"])
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
