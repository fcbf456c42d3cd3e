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
resumes: the tokenizer, the counts and every finished shard (its sha256 checked again) are
kept. Its bookkeeping files are written whole or not at all; one found damaged anyway is made
again, with a line saying so.

One prepare writes ``<out>`` at a time: it holds ``<out>.lock`` (an exclusive ``flock``, which
the kernel drops when its holder ends in any way). A second one waits, naming the holder; if
the first made ``<out>`` from the same inputs and settings meanwhile, the second returns it as
it is (two ``seqshard train`` runs starting on one fresh ``data.dir``). Ctrl-C raises
:class:`PrepareInterrupted` (the CLI's one line and status 130); a full disk,
:class:`~seqshard.data.shards.PrepareWriteError`.

Document ``i`` (in corpus order) goes to val iff a hash of ``(seed, i)`` falls below
``val_fraction``: deterministic, independent of the text, and about ``val_fraction`` of the
documents. If that picks none of a small corpus's documents, the one with the smallest hash goes
to val (it was then also seen when training the tokenizer; nothing else of val ever is).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from seqshard.data.corpus import Corpus
from seqshard.data.sft import Pieces
from seqshard.data.shards import (
    RECORDS,
    UnitSpec,
    document_units,
    encode_units,
    split_entry,
    writing,
)
from seqshard.data.tokenfile import FORMAT, FORMAT_VERSION, META_FILE, dtype_for_vocab, write_meta
from seqshard.data.tokenizer import (
    Tokenizer,
    eot_id,
    load_tokenizer,
    tokenizer_hash,
    tokenizer_json,
    train_tokenizer,
)
from seqshard.files import write_whole

__all__ = [
    "DEFAULT_OUT",
    "DEFAULT_VOCAB",
    "PrepareConfig",
    "PrepareInterrupted",
    "is_val_doc",
    "prepare",
]

DEFAULT_OUT = "data/stdlib"  # where the configs look (base.yaml's data.dir) for the default corpus
DEFAULT_VOCAB = 4096
DEFAULT_SHARD_TOKENS = 1 << 27  # 128 Mi tokens: 256 MiB of uint16 a shard
_PLAN_FILE = "prepare-plan.json"  # in <out>.tmp: the inputs and settings being prepared
_COUNT_FILE = "prepare-count.json"  # in <out>.tmp: pass 1's document counts
_PLAN_KEY = "prepare_plan_sha256"  # in meta.json: the plan's fingerprint
TOKENIZER_FILE = "tokenizer.json"
_MASK64 = (1 << 64) - 1
_ENCODE_CHARS = 1 << 20  # characters per encode_batch call: big enough to use every core


@dataclasses.dataclass(frozen=True)
class PrepareConfig:
    """How :func:`prepare` makes a corpus's tokens (meta.json records each field).

    ``tokenizer_path=None`` trains a byte-level BPE of ``vocab_size`` tokens on the train
    documents; a given tokenizer.json (or a Hugging Face Hub name's: ``ORG/NAME``) is copied
    into the output (``vocab_size`` is then ignored). ``val_fraction`` and ``seed`` pick the val documents (see the module docstring).
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


class PrepareInterrupted(RuntimeError):
    """Ctrl-C (SIGINT) stopped a prepare; ``<out>.tmp`` keeps its work for a rerun to resume."""

    exit_code = 130  # the CLI's status: 128 + SIGINT, as a shell reports a process it stopped


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
    ``overwrite=True``; one that another prepare made from the same inputs and settings while
    this one waited for it is returned as it is (see the module docstring).
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
    before = _meta_stamp(out_dir)
    t_start = time.perf_counter()
    log(f"prepare: source {corpus.description}")
    plan = _plan(corpus, config)
    try:
        with _one_writer(out_dir, log):
            if _meta_stamp(out_dir) not in (None, before):
                return _prepared_meanwhile(out_dir, plan, log)
            with _staged(out_dir, plan, log) as tmp:
                tok, count, read = _tokenizer_pass(corpus, config, tmp, log)
                splits = _encode_pass(
                    corpus, tok, _val_rule(count, config), count, config, tmp, log
                )
                if not read:  # pass 1 was resumed: this read is the first of this run
                    _note_skipped(corpus, log)
                _write_meta(tmp, tok, corpus, count, splits, config, plan)
            _swap_into_place(tmp, out_dir)
    except KeyboardInterrupt:
        raise PrepareInterrupted(
            f"interrupted (Ctrl-C); rerun the same command to resume: {out_dir}.tmp keeps the "
            f"work done so far."
        ) from None
    log(f"prepare: wrote {out_dir} in {time.perf_counter() - t_start:.1f}s")
    return out_dir


def _meta_stamp(out_dir: Path) -> tuple[int, int] | None:
    """Which meta.json ``out_dir`` holds (inode, modification time), None if none."""
    try:
        st = os.stat(out_dir / META_FILE)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _fingerprint(plan: dict) -> str:
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


def _prepared_meanwhile(out_dir: Path, plan: dict, log: Callable[[str], None]) -> Path:
    """``out_dir``, finished by another prepare while this one waited for the lock, if that
    one had the same ``plan``; else a FileExistsError."""
    try:
        meta = json.loads((out_dir / META_FILE).read_text())
    except (OSError, ValueError):
        meta = {}
    if isinstance(meta, dict) and meta.get(_PLAN_KEY) == _fingerprint(plan):
        log(
            f"prepare: {out_dir} was prepared from the same inputs and settings by another "
            f"process while this one waited; using it"
        )
        return out_dir
    source = meta.get("source") if isinstance(meta, dict) else None
    raise FileExistsError(
        f"{out_dir} was prepared by another process while this one waited for it, from other "
        f"inputs or settings (source: {source}); prepare into another --out, or rerun with "
        f"--force (overwrite=True) to replace it."
    )


@contextlib.contextmanager
def _one_writer(out_dir: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Hold ``<out>.lock`` while the block prepares ``out_dir``: another prepare of it waits
    here until this one lets go. The holder removes the file as it lets go (a waiter then
    locks a fresh one: see :func:`_lock_file`); one that died holds nothing (the kernel drops
    its ``flock``), and the next prepare takes the file it left."""
    path = Path(f"{out_dir}.lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file where a directory of the path should be, say
        raise OSError(
            e.errno,
            f"cannot prepare {out_dir}: {path.parent} cannot be made a directory ({e.strerror}: "
            f"{e.filename}); choose an --out (data.dir) whose parents are directories or "
            f"can be made",
        ) from None
    fd = _lock_file(path, out_dir, log)
    if fd is None:
        yield
        return
    try:
        started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        record = {"pid": os.getpid(), "host": socket.gethostname(), "started": started}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # still holding the lock: nobody takes this file from now on
        os.close(fd)


def _lock_file(path: Path, out_dir: Path, log: Callable[[str], None]) -> int | None:
    """An open descriptor of ``path`` that holds its exclusive ``flock``, after waiting for its
    holder if need be (None on a filesystem without locks)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    log(
                        f"prepare: {path.parent} has no file locks ({e.strerror}); make sure no "
                        f"other prepare writes {out_dir} meanwhile"
                    )
                    os.close(fd)
                    return None
                if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                log(f"prepare: waiting for {_holder(fd)} to finish preparing {out_dir} ({path})")
                fcntl.flock(fd, fcntl.LOCK_EX)
            if _same_file(fd, path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the holder removed this file as it let go: lock the one at path now


def _holder(fd: int) -> str:
    """Who holds the lock file ``fd``, from the record it wrote there."""
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode())
        return f"process {info['pid']} on {info['host']} (started {info['started']})"
    except (OSError, ValueError, TypeError, KeyError):
        return "another process (it has not written its name yet)"


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)


def _write_whole(path: Path, data: bytes) -> None:
    """``path`` holds ``data``, or what it held before (a kill, a full disk), never a part; a
    full disk is a PrepareWriteError."""
    with writing(path, len(data)):
        write_whole(path, data)


def _read_json(path: Path) -> tuple[object, str]:
    """(the JSON in ``path``, ``''``), or (None, why not: missing or damaged)."""
    try:
        return json.loads(path.read_bytes()), ""
    except FileNotFoundError:
        return None, "missing"
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError included
        return None, f"damaged ({e})"


@contextlib.contextmanager
def _staged(out_dir: Path, plan: dict, log: Callable[[str], None]) -> Iterator[Path]:
    """``<out>.tmp`` to write in: the one an interrupted prepare of the same ``plan`` (inputs
    and settings) left, to resume, else a fresh one. It stays when the block fails (a rerun
    resumes it); only the final rename makes ``<out>``, so nothing unfinished looks prepared."""
    tmp = Path(f"{out_dir}.tmp")
    plan_file = tmp / _PLAN_FILE
    if tmp.exists():
        found, why = _read_json(plan_file)
        if found == plan:
            log(f"prepare: resuming the unfinished {tmp}")
        else:
            if found is not None:
                log(f"prepare: {tmp} is from a prepare of other inputs or settings; starting over")
            else:  # whatever it holds cannot be told to fit this prepare
                log(f"prepare: {plan_file} is {why}; starting over")
            shutil.rmtree(tmp)
    if not tmp.exists():
        tmp.mkdir(parents=True)
        _write_whole(plan_file, json.dumps(plan, indent=1, sort_keys=True).encode())
    yield tmp


def _plan(corpus: Corpus, config: PrepareConfig) -> dict:
    """What decides the output (not ``workers``): a resumed prepare must have the same."""
    plan = dataclasses.asdict(config)
    del plan["workers"]
    if config.tokenizer_path is not None:
        plan["tokenizer_path"] = str(config.tokenizer_path)
        plan["tokenizer_sha256"] = tokenizer_hash(config.tokenizer_path)
    return {**plan, "source": corpus.description, "format_version": FORMAT_VERSION}


class _Counter:
    """Counts the documents of one read of a corpus (for the small-corpus rule: the val ones
    and the one nearest to val) as :meth:`train_texts` passes them."""

    def __init__(self, config: PrepareConfig):
        self.config = config
        self.n_docs = self.n_val = self.n_chars = 0
        self.smallest = (2.0, -1)  # (hash, index) of the document nearest to val

    def train_texts(self, corpus: Corpus) -> Iterator[str]:
        """The text of each train document of ``corpus``, every document counted."""
        val_fraction, seed = self.config.val_fraction, self.config.seed
        for i, doc in enumerate(corpus):
            self.n_docs, self.n_chars = i + 1, self.n_chars + len(doc)
            self.smallest = min(self.smallest, (_unit_hash(i, seed), i))
            if is_val_doc(i, val_fraction, seed):
                self.n_val += 1
            else:
                yield doc.text if isinstance(doc, Pieces) else doc

    def count(self, corpus: Corpus, log: Callable[[str], None]) -> _Count:
        """What was counted (after the whole read), the skipped files said; an error if no
        document came."""
        skipped = _skipped_note(corpus)
        if self.n_docs == 0:
            fix = f"it {skipped}" if skipped else "give prepare inputs with text in them"
            raise ValueError(f"source {corpus.description} gave no non-empty documents: {fix}.")
        if skipped:
            log(f"prepare: {skipped}")
        log(f"prepare: {self.n_docs} documents, {_fmt(self.n_chars)} characters")
        return _Count(self.n_docs, self.n_val, self.n_chars, self.smallest[1])


def _skipped_note(corpus: Corpus) -> str:
    """The input files the corpus's latest read skipped, as a sentence ('' if none)."""
    skipped = corpus.skipped()
    if not skipped:
        return ""
    shown = "; ".join(skipped[:3]) + (f"; and {len(skipped) - 3} more" if len(skipped) > 3 else "")
    return (
        f"skipped {len(skipped)} input file{'s' if len(skipped) > 1 else ''} that "
        f"{'are' if len(skipped) > 1 else 'is'} not UTF-8 text or unreadable: {shown}; convert "
        f"such files to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) to include them"
    )


def _note_skipped(corpus: Corpus, log: Callable[[str], None]) -> None:
    if skipped := _skipped_note(corpus):
        log(f"prepare: {skipped}")


def _tokenizer_pass(
    corpus: Corpus, config: PrepareConfig, tmp: Path, log: Callable[[str], None]
) -> tuple[Tokenizer, _Count, bool]:
    """Pass 1: train the tokenizer on the train documents (or copy the given one into ``tmp``),
    counting the documents and the val documents (for the small-corpus rule) on the way; and
    whether it read the corpus (not when resuming). The count file of an unfinished run found
    damaged is counted again, its tokenizer kept (its finished shards were encoded with it)."""
    counted, tok_file = tmp / _COUNT_FILE, tmp / TOKENIZER_FILE
    counter = _Counter(config)
    if counted.is_file() and tok_file.is_file():  # resuming: pass 1 was done
        tok = load_tokenizer(tok_file)
        count, why = _read_count(counted)
        if count is not None:
            log("prepare: the tokenizer and document counts of the unfinished run are reused")
            return tok, count, False
        log(f"prepare: {counted} is {why}; counting the documents again")
        for _ in counter.train_texts(corpus):
            pass
        return tok, _save_count(counter.count(corpus, log), counted), True
    t0 = time.perf_counter()
    if config.tokenizer_path is None:
        tok = train_tokenizer(counter.train_texts(corpus), config.vocab_size)
        _write_whole(tok_file, tok.to_str(pretty=True).encode())  # the bytes Tokenizer.save writes
        log(
            f"prepare: trained a byte-level BPE of {tok.get_vocab_size()} tokens in "
            f"{time.perf_counter() - t0:.1f}s"
        )
    else:
        tok = load_tokenizer(config.tokenizer_path)
        _write_whole(tok_file, tokenizer_json(config.tokenizer_path))  # a file, or a Hub name's
        for _ in counter.train_texts(corpus):
            pass
        log(f"prepare: using tokenizer {config.tokenizer_path} ({tok.get_vocab_size()} tokens)")
    return tok, _save_count(counter.count(corpus, log), counted), True


def _read_count(path: Path) -> tuple[_Count | None, str]:
    """(the count in ``path``, ``''``), or (None, why not)."""
    found, why = _read_json(path)
    try:
        return _Count(**found), ""
    except TypeError:  # not JSON, or not a count's fields
        return None, why or f"damaged (not a count: {found!r:.80})"


def _save_count(count: _Count, path: Path) -> _Count:
    _write_whole(path, json.dumps(dataclasses.asdict(count)).encode())
    return count


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
    done = encode_units(units, spec, in_val, config.workers, log, count.n_docs)
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
    plan: dict,
) -> None:
    """Pass 3: ``tmp``'s meta.json: the format, the tokenizer, the source, the splits, and the
    fingerprint of the plan (a prepare that waited for this one compares its own)."""
    vocab = tok.get_vocab_size()
    tokenizer_path = config.tokenizer_path
    meta = {
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
        _PLAN_KEY: _fingerprint(plan),
    }
    with writing(tmp / META_FILE, len(json.dumps(meta, indent=2))):
        write_meta(tmp, meta)


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
