"""Text -> token files: ``seqshard prepare``.

    prepare("data/tokens", stdlib_corpus())          # the stdlib, a new 4096-token BPE
    prepare("data/mine", path_corpus(["notes/"]),
            PrepareConfig(tokenizer_path="data/tokens/tokenizer.json"))

Passes over a :class:`~seqshard.data.corpus.Corpus`: (1) read the documents once to train a
tokenizer on the train documents (or, with a given tokenizer, only to count them); (2) read
them again, encode them in parallel batches and append each, followed by ``<|endoftext|>``, to
``train.bin`` or ``val.bin``; (3) write meta.json. All of it happens in ``<out>.tmp``, renamed
to ``<out>`` at the end, so an interrupted run never leaves a directory that looks prepared.

Document ``i`` (in corpus order) goes to val iff a hash of ``(seed, i)`` falls below
``val_fraction``: deterministic, independent of the text, and about ``val_fraction`` of the
documents. If that picks none of a small corpus's documents, the one with the smallest hash goes
to val (it was then also seen when training the tokenizer; nothing else of val ever is).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from seqshard.data.corpus import Corpus
from seqshard.data.sft import Pieces
from seqshard.data.tokenfile import (
    FORMAT,
    FORMAT_VERSION,
    SplitWriter,
    dtype_for_vocab,
    write_meta,
)
from seqshard.data.tokenizer import (
    Tokenizer,
    eot_id,
    load_tokenizer,
    tokenizer_hash,
    train_tokenizer,
)

__all__ = ["DEFAULT_OUT", "DEFAULT_VOCAB", "PrepareConfig", "is_val_doc", "prepare"]

DEFAULT_OUT = "data/tokens"
DEFAULT_VOCAB = 4096
TOKENIZER_FILE = "tokenizer.json"
_MASK64 = (1 << 64) - 1
_ENCODE_CHARS = 1 << 20  # characters per encode_batch call: big enough to use every core


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """How :func:`prepare` makes a corpus's tokens (meta.json records each field).

    ``tokenizer_path=None`` trains a byte-level BPE of ``vocab_size`` tokens on the train
    documents; a given tokenizer.json is copied into the output (``vocab_size`` is then
    ignored). ``val_fraction`` and ``seed`` pick the val documents (see the module docstring).
    """

    vocab_size: int = DEFAULT_VOCAB
    val_fraction: float = 0.01
    tokenizer_path: str | os.PathLike | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}; e.g. 0.01.")


@dataclasses.dataclass(frozen=True)
class _Count:
    """What the first pass saw of the corpus."""

    n_docs: int
    n_val: int  # documents the hash rule puts in val
    n_chars: int
    nearest_val: int  # the document with the smallest hash: val by the small-corpus rule


def _unit_hash(i: int, seed: int) -> float:
    """splitmix64 of (seed, i), as a float in [0, 1)."""
    z = (i + (seed + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) / 2.0**64


def is_val_doc(i: int, val_fraction: float, seed: int = 0) -> bool:
    """Whether document ``i`` belongs to val by the hash rule (before the small-corpus rule)."""
    return _unit_hash(i, seed) < val_fraction


def _chunks(docs: Iterator[tuple[int, str]], max_chars: int) -> Iterator[list[tuple[int, str]]]:
    chunk, chars = [], 0
    for item in docs:
        chunk.append(item)
        chars += len(item[1])
        if chars >= max_chars:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _fmt(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)


def prepare(
    out_dir: str | os.PathLike,
    corpus: Corpus,
    config: PrepareConfig = PrepareConfig(),
    *,
    overwrite: bool = False,
    log: Callable[[str], None] | None = print,
) -> Path:
    """Prepare a token directory at ``out_dir`` (see :mod:`seqshard.data.tokenfile`) from the
    documents of ``corpus``, as ``config`` says, and return its path.

    ``corpus``: :func:`~seqshard.data.corpus.path_corpus`, ``hf_corpus`` or ``stdlib_corpus``
    (``.take(n)`` for the first n documents). An existing ``out_dir`` is replaced only with
    ``overwrite=True``.
    """
    log = log or (lambda _msg: None)
    out_dir = Path(out_dir)
    if not isinstance(corpus, Corpus):
        raise TypeError(
            f"prepare: corpus must be a seqshard.data.Corpus, got {type(corpus).__name__}; "
            f"make one with path_corpus(paths), hf_corpus(name) or stdlib_corpus()."
        )
    if out_dir.exists() and not overwrite:
        raise FileExistsError(
            f"{out_dir} already exists; choose another --out, or pass --force "
            f"(overwrite=True) to replace it."
        )
    t_start = time.perf_counter()
    log(f"prepare: source {corpus.description}")
    with _staged(out_dir) as tmp:
        tok, count = _tokenizer_pass(corpus, config, tmp, log)
        splits = _encode_pass(corpus, tok, _val_rule(count, config), count, tmp, log)
        _write_meta(tmp, tok, corpus, count, splits, config)
    _swap_into_place(tmp, out_dir)
    log(f"prepare: wrote {out_dir} in {time.perf_counter() - t_start:.1f}s")
    return out_dir


@contextlib.contextmanager
def _staged(out_dir: Path) -> Iterator[Path]:
    """A fresh ``<out>.tmp`` to write in, removed if the block fails: an interrupted run never
    leaves a directory that looks prepared."""
    tmp = Path(f"{out_dir}.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # left by an interrupted run
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _tokenizer_pass(
    corpus: Corpus, config: PrepareConfig, tmp: Path, log: Callable[[str], None]
) -> tuple[Tokenizer, _Count]:
    """Pass 1: train the tokenizer on the train documents (or copy the given one into ``tmp``),
    counting the documents and the val documents (for the small-corpus rule) on the way."""
    val_fraction, seed, tokenizer_path = config.val_fraction, config.seed, config.tokenizer_path
    n_docs = n_val = n_chars = 0
    smallest = (2.0, -1)  # (hash, index) of the document nearest to val

    def counted_train_docs() -> Iterator[str]:
        nonlocal n_docs, n_val, n_chars, smallest
        for i, doc in enumerate(corpus):
            n_docs, n_chars = i + 1, n_chars + len(doc)
            smallest = min(smallest, (_unit_hash(i, seed), i))
            if is_val_doc(i, val_fraction, seed):
                n_val += 1
            else:
                yield doc.text if isinstance(doc, Pieces) else doc

    t0 = time.perf_counter()
    if tokenizer_path is None:
        tok = train_tokenizer(counted_train_docs(), config.vocab_size, tmp / TOKENIZER_FILE)
        log(
            f"prepare: trained a byte-level BPE of {tok.get_vocab_size()} tokens in "
            f"{time.perf_counter() - t0:.1f}s"
        )
    else:
        tok = load_tokenizer(tokenizer_path)
        shutil.copyfile(tokenizer_path, tmp / TOKENIZER_FILE)
        for _ in counted_train_docs():
            pass
        log(f"prepare: using tokenizer {tokenizer_path} ({tok.get_vocab_size()} tokens)")
    if n_docs == 0:
        raise ValueError(
            f"source {corpus.description} gave no non-empty documents; give prepare "
            f"inputs with text in them."
        )
    log(f"prepare: {n_docs} documents, {_fmt(n_chars)} characters")
    return tok, _Count(n_docs, n_val, n_chars, smallest[1])


def _val_rule(count: _Count, config: PrepareConfig) -> Callable[[int], bool]:
    """Whether document ``i`` goes to val: the hash rule, or the small-corpus rule when the
    hash rule picked none of at least two documents."""
    small = count.n_val == 0 and config.val_fraction > 0 and count.n_docs >= 2
    extra_val = count.nearest_val if small else -1

    def in_val(i: int) -> bool:
        return i == extra_val or is_val_doc(i, config.val_fraction, config.seed)

    return in_val


def _encode_pass(
    corpus: Corpus,
    tok: Tokenizer,
    in_val: Callable[[int], bool],
    count: _Count,
    tmp: Path,
    log: Callable[[str], None],
) -> dict[str, dict]:
    """Pass 2: encode in batches (parallel in Rust) and append each document, followed by
    ``<|endoftext|>``, to ``tmp``'s train or val files; each split's entry for meta.json."""
    eot = eot_id(tok)
    if eot is None:
        log("prepare: the tokenizer has no <|endoftext|>; documents are not terminated")
    t0 = last = time.perf_counter()
    writers = {
        s: SplitWriter(tmp, s, dtype_for_vocab(tok.get_vocab_size())) for s in ("train", "val")
    }
    done = 0
    for chunk in _chunks(enumerate(corpus), _ENCODE_CHARS):
        encoded = _encode(tok, [doc for _, doc in chunk], eot)
        for split in ("train", "val"):
            mine = [
                e for (i, _), e in zip(chunk, encoded, strict=True) if in_val(i) == (split == "val")
            ]
            writers[split].add([ids for ids, _ in mine], [mask for _, mask in mine])
        done += len(chunk)
        if time.perf_counter() - last > 5:
            last = time.perf_counter()
            log(f"prepare: encoded {done}/{count.n_docs} documents")
    splits = {s: w.close() for s, w in writers.items()}
    n_tok = sum(s["n_tokens"] for s in splits.values())
    log(
        f"prepare: encoded {_fmt(n_tok)} tokens ({count.n_chars / max(n_tok, 1):.2f} chars/token) "
        f"in {time.perf_counter() - t0:.1f}s: train {_fmt(splits['train']['n_tokens'])} "
        f"tokens / {splits['train']['n_docs']} docs, val {_fmt(splits['val']['n_tokens'])} "
        f"tokens / {splits['val']['n_docs']} docs"
    )
    if splits["val"]["n_docs"] == 0:
        log("prepare: warning: the val split is empty (raise --val-fraction for evaluation)")
    return splits


def _encode(
    tok: Tokenizer, docs: list[str | Pieces], eot: int | None
) -> list[tuple[list[int], np.ndarray | None]]:
    """Each document's ids (then ``eot``) and loss mask (None for plain text: all count). A
    fine-tuning document's pieces are encoded one by one (one batch for the chunk), so no token
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


def _write_meta(
    tmp: Path,
    tok: Tokenizer,
    corpus: Corpus,
    count: _Count,
    splits: dict[str, dict],
    config: PrepareConfig,
) -> None:
    """Pass 3: ``tmp``'s meta.json: the format, the tokenizer, the source and the splits."""
    vocab = tok.get_vocab_size()
    tokenizer_path = config.tokenizer_path
    write_meta(
        tmp,
        {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "dtype": dtype_for_vocab(vocab).name,
            "vocab_size": vocab,
            "eot_id": eot_id(tok),
            "tokenizer": TOKENIZER_FILE,
            "tokenizer_sha256": tokenizer_hash(tmp / TOKENIZER_FILE),
            "tokenizer_source": "trained" if tokenizer_path is None else str(tokenizer_path),
            "source": corpus.description,
            "n_chars": count.n_chars,
            "val_fraction": config.val_fraction,
            "split_seed": config.seed,
            "splits": splits,
        },
    )


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    """``tmp`` becomes ``out_dir``; the old directory (if any) goes only once the new one is
    complete."""
    old = Path(f"{out_dir}.old")
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
