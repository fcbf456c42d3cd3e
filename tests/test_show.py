"""Tests of seqshard.show: what `seqshard show` reads off the types and the compiled step."""

from __future__ import annotations

import re

import pytest

from seqshard.config import load_config
from seqshard.model.weights import param_count
from seqshard.show import describe, weight_table

OVERRIDES = [
    "model.vocab=64",
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_kv=4",
    "model.d_head=8",
    "model.d_ff=64",
    "model.compute_dtype=float32",
    "model.attention_impl=einsum",
    "data.vocab_size=64",
    "train.batch_size=8",
    "train.seq_len=16",
    "mesh.d=4",
    "mesh.t=2",
]


@pytest.fixture(scope="module")
def cfg():
    return load_config(None, OVERRIDES)


def test_weight_table_rows_come_from_the_types(cfg):
    rows = {r[0]: r for r in weight_table(cfg)}
    assert rows["embed"] == (
        "embed",
        "f32['vocab/t d_model/d']",
        "[64, 32]",
        "[32, 8]",
        "P('t', 'd')",
    )
    assert rows["layers.ln1"][2:] == ("[2, 32]", "[2, 4]", "P(None, ('t', 'd'))")
    assert len(rows) == 11  # embed, 8 layer weights, final_norm, unembed


def test_describe_without_compiling(cfg):
    text = describe(cfg, compile_step=False)
    assert f"parameters: {param_count(cfg.model):,}" in text
    assert "weights on mesh d=4 x t=2" in text
    assert "communication per train step" not in text
    for part in ("weights", "grads", "optimizer", "activations", "logits", "total"):
        assert re.search(rf"^  {part}\s+\d", text, re.M), part


def test_describe_with_the_compiled_step(cfg):
    text = describe(cfg, compile_step=True)
    assert "communication per train step, from the step compiled for mesh d=4 x t=2" in text
    assert re.search(r"all-gather", text) and "temporaries" in text
    # XLA's peak beside the planner's, for the attention this machine runs.
    assert re.search(
        r"arguments \+ temporaries .*; the planner's peak for attention as einsum", text
    )


def test_describe_with_a_chip_shows_its_plan(cfg):
    """One memory figure: with a chip, the plan's (its attention kernel); without, einsum's."""
    text = describe(cfg, compile_step=False, chip="h100")
    assert "plan for 8 H100 GPUs (one node), mesh d=4 x t=2" in text
    assert "attention_impl=einsum runs as einsum" in text
    assert re.search(r"^verdict: fits: ", text, re.M)
    assert "estimated memory per device at the peak" not in text
    assert text.count("  total ") == 1
    plain = describe(cfg, compile_step=False)
    assert "estimated memory per device at the peak of a step" in plain and "verdict" not in plain
