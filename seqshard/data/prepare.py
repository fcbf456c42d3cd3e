"""Text -> token files: ``seqshard prepare``.

    prepare("data/tokens", stdlib_corpus())          # the stdlib, a new 4096-token BPE
    prepare("data/mine", path_corpus(["notes/"]),
            PrepareConfig(tokenizer_path="data/tokens/tokenizer.json"))

Passes over a :class:`~seqshard.data.corpus.Corpus`: (1) read the documents once to train a
tokenizer on the train documents (or, with a given tokenizer, only to count them); (2) read
them again in units of at most ``shard_tokens``, each encoded by one of ``workers`` processes,
followed by ``<|endoftext|>``, into its ``train-NNNNN`` and ``val-NNNNN`` shards
(:mod:`seqshard.data.shards`: the same files for any number of workers); (3) write meta.json.
All of it happens in ``<out>.tmp``, renamed to ``<out>`` at the end, so an unfinished run never
leaves a directory that looks prepared; run again with the same inputs and settings, it
resumes: the tokenizer, the counts and every finished shard are kept.

Document ``i`` (in corpus order) goes to val iff a hash of ``(seed, i)`` falls below
``val_fraction``: deterministic, independent of the text, and about ``val_fraction`` of the
documents. If that picks none of a small corpus's documents, the one with the smallest hash goes
to val (it was then also seen when training the tokenizer; nothing else of val ever is).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from seqshard.data.corpus import Corpus
from seqshard.data.sft import Pieces
from seqshard.data.shards import RECORDS, UnitSpec, document_units, encode_units, split_entry
from seqshard.data.tokenfile import FORMAT, FORMAT_VERSION, dtype_for_vocab, write_meta
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
DEFAULT_SHARD_TOKENS = 1 << 27  # 128 Mi tokens: 256 MiB of uint16 a shard
_PLAN_FILE = "prepare-plan.json"  # in <out>.tmp: the inputs and settings being prepared
_COUNT_FILE = "prepare-count.json"  # in <out>.tmp: pass 1's document counts
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
    workers: int = 1  # encoding processes (the output is the same for any number)
    shard_tokens: int = DEFAULT_SHARD_TOKENS  # a shard's bound (see seqshard.data.shards)

    def __post_init__(self) -> None:
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {self.val_fraction}; e.g. 0.01.")
        if self.workers < 1 or self.shard_tokens < 1:
            raise ValueError(
                f"workers and shard_tokens must be >= 1, got {self.workers} and "
                f"{self.shard_tokens}; e.g. --workers 8 --shard-tokens {DEFAULT_SHARD_TOKENS}."
            )


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
    with _staged(out_dir, _plan(corpus, config), log) as tmp:
        tok, count = _tokenizer_pass(corpus, config, tmp, log)
        splits = _encode_pass(corpus, tok, _val_rule(count, config), count, config, tmp, log)
        _write_meta(tmp, tok, corpus, count, splits, config)
    _swap_into_place(tmp, out_dir)
    log(f"prepare: wrote {out_dir} in {time.perf_counter() - t_start:.1f}s")
    return out_dir


@contextlib.contextmanager
def _staged(out_dir: Path, plan: dict, log: Callable[[str], None]) -> Iterator[Path]:
    """``<out>.tmp`` to write in: the one an interrupted prepare of the same ``plan`` (inputs
    and settings) left, to resume, else a fresh one. It stays when the block fails (a rerun
    resumes it); only the final rename makes ``<out>``, so nothing unfinished looks prepared."""
    tmp = Path(f"{out_dir}.tmp")
    plan_file = tmp / _PLAN_FILE
    if tmp.exists():
        same = plan_file.is_file() and json.loads(plan_file.read_text() or "{}") == plan
        if same:
            log(f"prepare: resuming the unfinished {tmp}")
        else:
            log(f"prepare: {tmp} is from a prepare of other inputs or settings; starting over")
            shutil.rmtree(tmp)
    if not tmp.exists():
        tmp.mkdir(parents=True)
        plan_file.write_text(json.dumps(plan, indent=1, sort_keys=True))
    yield tmp


def _plan(corpus: Corpus, config: PrepareConfig) -> dict:
    """What decides the output (not ``workers``): a resumed prepare must have the same."""
    plan = dataclasses.asdict(config)
    del plan["workers"]
    if config.tokenizer_path is not None:
        plan["tokenizer_path"] = str(config.tokenizer_path)
        plan["tokenizer_sha256"] = tokenizer_hash(config.tokenizer_path)
    return {**plan, "source": corpus.description, "format_version": FORMAT_VERSION}


def _tokenizer_pass(
    corpus: Corpus, config: PrepareConfig, tmp: Path, log: Callable[[str], None]
) -> tuple[Tokenizer, _Count]:
    """Pass 1: train the tokenizer on the train documents (or copy the given one into ``tmp``),
    counting the documents and the val documents (for the small-corpus rule) on the way."""
    counted = tmp / _COUNT_FILE
    if counted.is_file() and (tmp / TOKENIZER_FILE).is_file():  # resuming: pass 1 was done
        log("prepare: the tokenizer and document counts of the unfinished run are reused")
        return load_tokenizer(tmp / TOKENIZER_FILE), _Count(**json.loads(counted.read_text()))
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
    count = _Count(n_docs, n_val, n_chars, smallest[1])
    counted.write_text(json.dumps(dataclasses.asdict(count)))
    return tok, count


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
    config: PrepareConfig,
    tmp: Path,
    log: Callable[[str], None],
) -> dict[str, dict]:
    """Pass 2: the documents in units (:mod:`seqshard.data.shards`), each encoded, followed by
    ``<|endoftext|>``, into its train and val shards by ``config.workers`` processes; each
    split's entry for meta.json."""
    eot = eot_id(tok)
    if eot is None:
        log("prepare: the tokenizer has no <|endoftext|>; documents are not terminated")
    t0 = time.perf_counter()
    spec = UnitSpec(tmp, tmp / TOKENIZER_FILE, eot, dtype_for_vocab(tok.get_vocab_size()).name)
    units = document_units(enumerate(corpus), config.shard_tokens)
    done = encode_units(units, spec, in_val, config.workers, log)
    splits = {s: split_entry([u[s] for u in done if s in u], tmp) for s in ("train", "val")}
    n_tok = sum(s["n_tokens"] for s in splits.values())
    log(
        f"prepare: encoded {_fmt(n_tok)} tokens ({count.n_chars / max(n_tok, 1):.2f} chars/token) "
        f"in {time.perf_counter() - t0:.1f}s with {config.workers} worker(s), "
        f"{len(done)} unit(s): train {_fmt(splits['train']['n_tokens'])} tokens / "
        f"{splits['train']['n_docs']} docs, val {_fmt(splits['val']['n_tokens'])} tokens / "
        f"{splits['val']['n_docs']} docs"
    )
    if splits["val"]["n_docs"] == 0:
        log("prepare: warning: the val split is empty (raise --val-fraction for evaluation)")
    return splits


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
    complete. The bookkeeping of resumption is dropped first."""
    for name in (_PLAN_FILE, _COUNT_FILE):
        (tmp / name).unlink(missing_ok=True)
    shutil.rmtree(tmp / RECORDS, ignore_errors=True)
    old = Path(f"{out_dir}.old")
    if out_dir.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
