"""Fixtures of the data-pipeline tests: a corpus of documents of very different lengths,
prepared with a 400-token BPE (``data_dir``, shadowing the run tests' tiny one), a private copy
to damage, and a 2x4 mesh."""

import shutil
from pathlib import Path

import pytest
from data_helpers import VOCAB, _documents

from seqshard.data.corpus import path_corpus
from seqshard.data.prepare import PrepareConfig, prepare
from seqshard.testing import fake_cpu_mesh


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("texts")
    for i, doc in enumerate(_documents()):
        (root / f"sub{i % 3}").mkdir(exist_ok=True)
        (root / f"sub{i % 3}" / f"doc{i:03d}.txt").write_text(doc, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, text_dir) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "tokens"
    config = PrepareConfig(vocab_size=VOCAB, val_fraction=0.2)
    return prepare(out, path_corpus([text_dir]), config, log=None)


@pytest.fixture
def data_copy(tmp_path, data_dir) -> Path:
    """A private copy of the prepared directory, for tests that damage it."""
    return Path(shutil.copytree(data_dir, tmp_path / "tokens"))


@pytest.fixture(scope="module")
def mesh():
    return fake_cpu_mesh((2, 4), ("d", "t"))
