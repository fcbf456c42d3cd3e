"""Tests of seqshard.data.corpus: the stdlib corpus, files and directories, JSON lines, Hugging Face."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from seqshard.data import corpus as corpus_lib
from seqshard.data import prepare, read_meta
from seqshard.data.prepare import PrepareConfig


def test_stdlib_corpus_is_the_base_stdlib_without_tests():
    root = corpus_lib.stdlib_dir()
    assert (root / "os.py").is_file()  # in a venv: the base interpreter's library
    files = corpus_lib.stdlib_files(root)
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and len(rel) > 300
    assert not any(set(r.split("/")[:-1]) & corpus_lib.STDLIB_EXCLUDED_DIRS for r in rel)
    assert 5e6 < sum(f.stat().st_size for f in files) < 40e6
    first = next(iter(corpus_lib.stdlib_corpus().take(2)))
    assert first == files[0].read_text(encoding="utf-8") or not files[0].read_text()


def test_path_corpus_files_dirs_jsonl_and_bad_input(tmp_path):
    (tmp_path / "d" / "e").mkdir(parents=True)
    (tmp_path / "d" / "b.md").write_text("bee")
    (tmp_path / "d" / "e" / "a.py").write_text("x = 1\n")
    (tmp_path / "d" / "skip.bin").write_bytes(b"\x00\x01")
    (tmp_path / "d" / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))  # not UTF-8
    (tmp_path / "d" / "empty.txt").write_text("")
    (tmp_path / "r.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "id": 3}\n')
    docs = list(corpus_lib.path_corpus([tmp_path / "d", tmp_path / "r.jsonl"]))
    assert docs == ["bee", "x = 1\n", "one", "two"]

    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected a JSON object.*text"):
        list(corpus_lib.iter_path_documents([tmp_path / "bad.jsonl"]))
    with pytest.raises(FileNotFoundError, match="nope.txt does not exist"):
        corpus_lib.path_corpus([tmp_path / "nope.txt"])


def test_hf_corpus_without_datasets_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: import fails
    with pytest.raises(ImportError, match=r"pip install 'seqshard\[hf\]'"):
        corpus_lib.hf_corpus("some/dataset")


@pytest.mark.skipif(
    importlib.util.find_spec("datasets") is None, reason="needs datasets: pip install -e '.[hf]'"
)
def test_hf_datasets_read_local_json_and_text_files_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no cache outside the test
    rows = [{"text": "def f(x):\n    return x\n", "id": 1}, {"text": "héllo wörld", "id": 2}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs = list(corpus_lib.hf_corpus(f"json:{tmp_path}/*.jsonl"))
    assert docs == [r["text"] for r in rows]
    (tmp_path / "notes.txt").write_text("line one\nline two\n")
    assert list(corpus_lib.hf_corpus(f"text:{tmp_path / 'notes.txt'}")) == ["line one", "line two"]
    with pytest.raises(ValueError, match=r"record 0 has no string field 'body'"):
        list(corpus_lib.hf_corpus(f"json:{tmp_path / 'a.jsonl'}", text_field="body"))
    with pytest.raises(FileNotFoundError, match="no file matches"):
        corpus_lib.hf_corpus(f"json:{tmp_path / 'none-*.jsonl'}")
    out = tmp_path / "prepared"
    source = corpus_lib.hf_corpus(f"json:{tmp_path / 'a.jsonl'}")
    prepare(out, source, PrepareConfig(vocab_size=300, val_fraction=0.4), log=None)
    meta = read_meta(out)
    assert sum(split["n_docs"] for split in meta["splits"].values()) == 2
    assert meta["source"] == f"huggingface json:{tmp_path / 'a.jsonl'} split=train field=text"


def test_a_jsonl_line_that_is_not_utf8_is_named_by_file_and_line(tmp_path):
    """Fault 8: a byte that is not UTF-8 in a .jsonl input said only `'utf-8' codec can't
    decode byte 0xff in position 34`. Now the error names file:line, like bad JSON."""
    path = tmp_path / "r.jsonl"
    path.write_bytes(b'{"text": "one"}\n\n{"text": "caf\xff"}\n{"text": "three"}\n')
    with pytest.raises(ValueError) as caught:
        list(corpus_lib.path_corpus([path]))
    assert str(caught.value) == (
        f"{path}:3: not valid UTF-8 (byte 0xff at column 14); a .jsonl file must be UTF-8 text: "
        f"fix the line, or convert the file (e.g. `iconv -f latin1 -t utf-8`)."
    )


def test_text_files_that_are_not_utf8_are_skipped_and_named(tmp_path):
    """Fault 14: text inputs that are not UTF-8 were dropped without a word, and with only such
    files the error said they "gave no non-empty documents". Now each read lists them
    (``corpus.skipped()``), prepare says so in one line, and the error names them."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "good.txt").write_text("plain words " * 30)
    for name in ("latin1.txt", "old.py"):
        (tmp_path / "d" / name).write_bytes("caf\xe9 ".encode("latin-1") * 30)
    corpus = corpus_lib.path_corpus([tmp_path / "d"])
    assert list(corpus) == ["plain words " * 30]
    latin1, old = (
        f"{tmp_path / 'd' / n} (not UTF-8: byte 0xe9 at offset 3)" for n in ("latin1.txt", "old.py")
    )
    assert corpus.skipped() == [latin1, old] and corpus.take(5).skipped() == [latin1, old]

    messages = []
    prepare(tmp_path / "out", corpus, PrepareConfig(vocab_size=300), log=messages.append)
    assert (
        f"prepare: skipped 2 input files that are not UTF-8 text or unreadable: {latin1}; {old}; "
        f"convert such files to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) to include them"
    ) in messages, messages

    only = corpus_lib.path_corpus([tmp_path / "d" / "latin1.txt"])
    with pytest.raises(ValueError) as caught:
        prepare(tmp_path / "none", only, PrepareConfig(vocab_size=300), log=None)
    assert str(caught.value) == (
        f"source {only.description} gave no non-empty documents: it skipped 1 input file that "
        f"is not UTF-8 text or unreadable: {latin1}; convert such files to UTF-8 (e.g. "
        f"`iconv -f latin1 -t utf-8`) to include them."
    )
