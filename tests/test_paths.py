"""Tests of seqshard.paths: a config's relative path is relative to its file; a Hugging Face
Hub name is told from a path (a path that exists wins)."""

from __future__ import annotations

import pytest

from seqshard.paths import is_hub_name, rebase


def test_rebase_joins_a_relative_path_to_the_files_directory():
    assert rebase("../data/stdlib", "/repo/configs") == "/repo/data/stdlib"
    assert rebase("sft/chat.jinja", "/repo/configs") == "/repo/configs/sft/chat.jinja"
    assert rebase("/abs/./runs/", "/repo/configs") == "/abs/runs"  # absolute: as written


@pytest.mark.parametrize(
    ("name", "hub"),
    [
        ("meta-llama/Llama-3.2-1B", True),
        ("Qwen/Qwen2.5-0.5B", True),
        ("org/name_v1.5", True),
        ("data/tokenizer.json", False),  # a tokenizer file is a path, found or not
        ("data/stdlib/tokenizer.json", False),
        ("a/b/c", False),  # more than ORG/NAME
        ("./org/name", False),
        ("../org/name", False),
        ("/org/name", False),
        ("tokenizer", False),  # no ORG
    ],
)
def test_a_hub_name_is_org_slash_name(tmp_path, name, hub):
    assert is_hub_name(name, tmp_path) is hub


def test_a_path_that_exists_wins_over_a_hub_name(tmp_path, monkeypatch):
    (tmp_path / "meta-llama" / "Llama-3.2-1B").mkdir(parents=True)
    assert not is_hub_name("meta-llama/Llama-3.2-1B", tmp_path)
    assert is_hub_name("meta-llama/Llama-3.2-1B", tmp_path / "meta-llama")
    monkeypatch.chdir(tmp_path)  # the default base: the working directory
    assert not is_hub_name("meta-llama/Llama-3.2-1B")
