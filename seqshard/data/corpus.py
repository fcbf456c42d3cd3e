"""Where text comes from: the default corpus (Python's own standard library), user files, and
optionally a Hugging Face dataset.

Every source is a *re-iterable* :class:`Corpus`: ``prepare`` reads it twice (once to train the
tokenizer, once to encode), and each ``iter(corpus)`` yields the same documents in the same
order. A document is one ``str``, or a fine-tuning record's :class:`~seqshard.data.sft.Pieces`
(text counted in the loss or not); empty documents are skipped. A text file that is not UTF-8
(or cannot be read) is skipped too, and said so: ``corpus.skipped()`` lists it; a ``.jsonl``
line that is not UTF-8 is an error naming ``file:line``.

    corpus = stdlib_corpus()                       # ~730 .py files, ~12 MB, no network needed
    corpus = path_corpus(["notes/", "a.jsonl"])    # .txt .md .py files; .jsonl: one doc a line
    corpus = hf_corpus("roneneldan/TinyStories")   # needs `pip install 'seqshard[hf]'`
"""

from __future__ import annotations

import dataclasses
import glob
import itertools
import json
import os
import sys
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from seqshard.data.sft import ChatTemplate, Pieces, record_kind, record_pieces

__all__ = [
    "STDLIB_EXCLUDED_DIRS",
    "TEXT_SUFFIXES",
    "Corpus",
    "hf_corpus",
    "iter_path_documents",
    "path_corpus",
    "stdlib_corpus",
    "stdlib_dir",
    "stdlib_files",
]

# Directory names skipped anywhere under the stdlib: installed packages (not the stdlib, and
# different on every machine), the test suites (huge generated data files and deliberately odd
# encodings), and build leftovers.
STDLIB_EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "__pycache__",
        "lib-dynload",
    }
)

# Suffixes read when walking a directory. A file named explicitly is read whatever its suffix.
TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl")


def _nothing_skipped() -> list[str]:
    return []


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A re-iterable sequence of documents with a human-readable description (kept in meta.json).

    ``iter(corpus)`` calls ``open()`` afresh each time, so a corpus can be read more than once.
    ``skipped()``: the input files the latest read passed over, each ``"path (why)"``.
    """

    description: str
    open: Callable[[], Iterator[str]]
    skipped: Callable[[], list[str]] = _nothing_skipped

    def __iter__(self) -> Iterator[str]:
        return (doc for doc in self.open() if doc)

    def take(self, max_docs: int | None) -> Corpus:
        """The first ``max_docs`` non-empty documents (all of them if None)."""
        if max_docs is None:
            return self
        if max_docs < 1:
            raise ValueError(f"max_docs must be >= 1 or None, got {max_docs}.")
        return Corpus(
            f"{self.description} (first {max_docs} docs)",
            lambda: itertools.islice(iter(self), max_docs),
            self.skipped,
        )


def stdlib_dir() -> Path:
    """The standard library directory of the running interpreter.

    In a virtual environment ``sysconfig.get_path('stdlib')`` still names the *base*
    interpreter's library (venvs hold only site-packages), so this works in venvs too.
    """
    path = Path(sysconfig.get_path("stdlib"))
    if not (path / "os.py").is_file():
        raise FileNotFoundError(
            f"Python standard library not found: expected {path / 'os.py'} (from "
            f"sysconfig.get_path('stdlib')), but it does not exist. This interpreter may ship "
            f"only compiled .pyc files; give text inputs to prepare instead, e.g. "
            f"`seqshard prepare path/to/texts/`."
        )
    return path


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Every ``.py`` file of the standard library minus :data:`STDLIB_EXCLUDED_DIRS`, sorted by
    path relative to ``root`` (POSIX form), so the order is the same on every machine."""
    root = stdlib_dir() if root is None else Path(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # config-3.11-x86_64-linux-gnu holds build files, not library source.
        dirnames[:] = [
            d for d in dirnames if d not in STDLIB_EXCLUDED_DIRS and not d.startswith("config-")
        ]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _read_text(path: Path, skip: Callable[[str], None]) -> str | None:
    """The file's text as UTF-8, or None (after ``skip("path (why)")``) if it cannot be read or
    is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        skip(f"{path} (unreadable: {e.strerror or e})")
    except UnicodeDecodeError as e:
        skip(f"{path} (not UTF-8: byte 0x{e.object[e.start]:02x} at offset {e.start})")
    return None


def _skipping(read: Callable[[Callable[[str], None]], Iterator]) -> tuple[Callable, Callable]:
    """(``open``, ``skipped``) of a :class:`Corpus` whose reader ``read(skip)`` reports the files
    it passes over: each read starts the list afresh."""
    skipped: list[str] = []

    def documents() -> Iterator:
        skipped.clear()
        yield from read(skipped.append)

    return documents, lambda: list(skipped)


def stdlib_corpus() -> Corpus:
    """The default corpus: one document per standard-library source file (see
    :func:`stdlib_files`); unreadable or non-UTF-8 files are skipped (``corpus.skipped()``)."""
    root = stdlib_dir()
    files = stdlib_files(root)
    version = ".".join(map(str, sys.version_info[:3]))

    def read(skip: Callable[[str], None]) -> Iterator[str]:
        for path in files:
            text = _read_text(path, skip)
            if text is not None:
                yield text

    description = f"python {version} stdlib ({len(files)} .py files under {root})"
    return Corpus(description, *_skipping(read))


def _walk_text_files(directory: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(TEXT_SUFFIXES))
    return sorted(found, key=lambda p: p.relative_to(directory).as_posix())


def _jsonl_documents(
    path: Path, text_field: str, chat_template: ChatTemplate | None = None
) -> Iterator[str | Pieces]:
    with path.open("rb") as f:  # decoded line by line, so a bad byte is reported at its line
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at column "
                    f"{e.start + 1}); a .jsonl file must be UTF-8 text: fix the line, or convert "
                    f"the file (e.g. `iconv -f latin1 -t utf-8`)."
                ) from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not valid JSON ({e.msg}); each line of a .jsonl file must "
                    f'be one JSON object with a "{text_field}" field.'
                ) from None
            kind = record_kind(record) if isinstance(record, dict) else None
            if kind in ("prompt_completion", "messages"):
                yield record_pieces(record, chat_template, f"{path}:{lineno}")
                continue
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                got = type(record).__name__ if not isinstance(record, dict) else sorted(record)
                raise ValueError(
                    f'{path}:{lineno}: expected a JSON object with a string "{text_field}" '
                    f'field, "prompt" and "completion", or chat "messages"; got {got}. Fix the '
                    f"line or convert the file."
                )
            yield record[text_field]


def _resolve_inputs(paths: Sequence[str | os.PathLike]) -> list[Path]:
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            found = _walk_text_files(p)
            if not found:
                raise FileNotFoundError(
                    f"input directory {p} holds no text files (looked for {', '.join(TEXT_SUFFIXES)}"
                    f" recursively); point prepare at files or directories with text in them."
                )
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(
                f"input {p} does not exist; give existing files or directories to prepare."
            )
    return files


def iter_path_documents(
    paths: Sequence[str | os.PathLike],
    *,
    text_field: str = "text",
    chat_template: ChatTemplate | None = None,
    skip: Callable[[str], None] = lambda _why: None,
) -> Iterator[str | Pieces]:
    """Documents from files and directories, in the order given (directories: sorted, recursive,
    files with :data:`TEXT_SUFFIXES`). A ``.jsonl`` file gives one document per line: its
    ``text_field``, or a fine-tuning record's :class:`~seqshard.data.sft.Pieces` (prompt and
    completion, or chat messages rendered by ``chat_template``); any other file is one
    document. A non-UTF-8 (or unreadable) file is skipped, and ``skip("path (why)")`` called."""
    for path in _resolve_inputs(paths):
        if path.suffix == ".jsonl":
            yield from _jsonl_documents(path, text_field, chat_template)
        else:
            text = _read_text(path, skip)
            if text is not None:
                yield text


def path_corpus(
    paths: Sequence[str | os.PathLike],
    *,
    text_field: str = "text",
    chat_template: ChatTemplate | None = None,
) -> Corpus:
    """A :class:`Corpus` over :func:`iter_path_documents` (inputs are checked now)."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("path_corpus: no input paths given; pass files or directories.")
    n_files = len(_resolve_inputs(paths))
    shown = ", ".join(str(p) for p in paths[:3]) + (", ..." if len(paths) > 3 else "")

    def read(skip: Callable[[str], None]) -> Iterator[str | Pieces]:
        return iter_path_documents(
            paths, text_field=text_field, chat_template=chat_template, skip=skip
        )

    return Corpus(f"{n_files} files from {shown}", *_skipping(read))


_FILE_BUILDERS = ("json", "text", "csv", "parquet", "arrow")
"""``datasets`` builders that read local files given as ``data_files``."""


def hf_corpus(
    name: str,
    *,
    config: str | None = None,
    split: str = "train",
    text_field: str = "text",
) -> Corpus:
    """Documents from a Hugging Face dataset, streamed (nothing is downloaded up front).

    ``name`` may carry a config after a colon: ``"wikitext:wikitext-103-raw-v1"``. For the
    builders that read local files (json, text, csv, parquet, arrow) the part after the colon
    is the files, a path or glob: ``"json:corpus/*.jsonl"``, ``"text:notes.txt"`` (offline).
    Needs the optional ``datasets`` package: ``pip install 'seqshard[hf]'``.
    """
    try:
        import datasets  # noqa: PLC0415 -- optional dependency, imported only when used
    except ImportError:
        raise ImportError(
            f"--hf-dataset {name!r} needs the Hugging Face `datasets` package, which is not "
            f"installed; install it with `pip install 'seqshard[hf]'`."
        ) from None
    if config is None and ":" in name:
        name, config = name.split(":", 1)
    files = None
    if name in _FILE_BUILDERS and config is not None:
        files, config = config, None
        if not glob.glob(files):
            raise FileNotFoundError(
                f"--hf-dataset {name}:{files}: no file matches {files!r}; give a path or glob "
                f"of local {name} files."
            )

    def documents() -> Iterator[str]:
        ds = datasets.load_dataset(name, config, data_files=files, split=split, streaming=True)
        for i, record in enumerate(ds):
            text = record.get(text_field)
            if not isinstance(text, str):
                raise ValueError(
                    f"Hugging Face dataset {name!r} record {i} has no string field "
                    f"{text_field!r} (fields: {sorted(record)}); pick the text field with "
                    f"text_field=..."
                )
            yield text

    label = name + (f":{config or files}" if config or files else "")
    return Corpus(f"huggingface {label} split={split} field={text_field}", documents)
