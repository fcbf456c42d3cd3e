"""Tests of seqshard.plan.show: what `seqshard show` reads off the types and the compiled step."""

from __future__ import annotations

import re

import pytest

from seqshard.config import load_config
from seqshard.model.cost import PHASES, flops_per_token, hardware_flops_per_token, step_flops
from seqshard.model.weights import param_count
from seqshard.plan.show import context_report, describe, flops_table, weight_table
from seqshard.shardlib.tables import format_bytes

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
        "f32['vocab/t d_model/d/e/c']",  # a type prints spelled out
        "[64, 32]",
        "[32, 8]",
        "P('t', ('d', 'e', 'c'))",
    )
    assert rows["layers.ln1"][2:] == ("[2, 32]", "[2, 4]", "P('p', ('t', 'd', 'e', 'c'))")
    assert len(rows) == 11  # embed, 8 layer weights, final_norm, unembed


def test_describe_without_compiling(cfg):
    text = describe(cfg, compile_step=False)
    assert f"parameters: {param_count(cfg.model):,}" in text
    assert "weights on mesh d=4 x c=1 x t=2" in text
    assert "from the step compiled" not in text
    # Every collective of the step, predicted from the notation without compiling.
    assert "communication per train step, predicted from the notation (nothing compiled" in text
    assert re.search(
        r"^backward +per layer +down: psum_scatter\('M F/t\{U_fsdp\} -> M/fsdp F/t'\) +reduce-scatter +d ",
        text,
        re.M,
    )
    assert re.search(r"^recompute +per layer +q: all_gather", text, re.M)
    for part in ("weights", "grads", "optimizer", "activations", "logits", "total"):
        assert re.search(rf"^  {part}\s+\d", text, re.M), part


def test_describe_with_the_compiled_step(cfg):
    text = describe(cfg, compile_step=True)
    assert "communication per train step, from the step compiled for mesh d=4 x c=1 x t=2" in text
    # The prediction from the notation is the compiled program's communication, exactly (f32).
    m = re.search(
        r"predicted from the notation vs compiled, .*: (\d+) vs (\d+) calls, .*\(compiled / predicted ([\d.]+);",
        text,
    )
    assert m and m[1] == m[2] and m[3] == "1.000", m and m.group(0)
    assert re.search(
        r"the update adds \d+ all-reduce\(s\), .*: the optimizer's global gradient norm", text
    )
    assert re.search(r"all-gather", text) and "temporaries" in text
    # XLA's peak beside the planner's, for the attention this machine runs.
    assert re.search(
        r"arguments \+ temporaries .*; the planner's peak for attention as einsum", text
    )


def test_describe_with_a_chip_shows_its_plan(cfg):
    """One memory figure: with a chip, the plan's (its attention kernel); without, einsum's."""
    text = describe(cfg, compile_step=False, chip="h100")
    assert "plan for 8 H100 GPUs (one node), mesh d=4 x c=1 x t=2" in text
    assert "attention_impl=einsum runs as einsum" in text
    assert re.search(r"^verdict: fits: ", text, re.M)
    assert "estimated memory per device at the peak" not in text
    assert text.count("  total ") == 1
    plain = describe(cfg, compile_step=False)
    assert "estimated memory per device at the peak of a step" in plain and "verdict" not in plain


def test_flops_table_is_the_step_table(cfg):
    """One line per operation of seqshard.model.cost.step_flops (kind, runs, each phase; exact below a
    million FLOPs), the matmul, elementwise and total sums, and the per-token figures."""
    text = flops_table(cfg)
    step = step_flops(cfg.model, batch=8, seq_len=16)
    lines = {line.split()[0]: line for line in text.splitlines() if line and line[0] != " "}
    for op in step.ops:
        cells = lines[op.name].split()
        assert cells[1:3] == [op.kind, str(op.runs)], op.name
    # 8 x 16 tokens of d_model 32: the embedding's backward scatter-adds 128 x 32; on mesh
    # d=4 x c=1 x t=2 its 'B/dp L M' runs whole on each t shard, so 1/4 of it per device.
    assert lines["embed"].split()[2:] == ["1", "-", "4,096", "-", "-", "4,096", "1,024"]
    assert step["embed"].backward == 8 * 16 * 32
    assert re.search(
        r"^operation +kind +runs +" + " +".join(PHASES) + " +sum +per device$", text, re.M
    )
    for name in ("matmul", "elementwise"):
        assert re.search(rf"^all +{name} ", text, re.M), name
    assert re.search(r"^total  ", text, re.M)
    assert "attention's causal half only (the useful work: 136 of 256 pairs per row)" in text
    model, hw = flops_per_token(cfg.model, 16), hardware_flops_per_token(cfg.model, 16)
    assert f"for MFU): {model.total:,}; with remat=saved's recompute {hw.total:,}" in text
    # describe prints it, with the words the CLI's test looks for.
    plain = describe(cfg, compile_step=False)
    assert text in plain and "FLOPs per token" in plain


def test_context_report_compares_the_strategies_for_the_split_sequence():
    """With c > 1, show prints for allgather and ring the collectives and bytes each moves per
    layer (from the notation) and the planner's activation and peak memory per device."""
    split = load_config(
        None, [*OVERRIDES, "mesh.d=2", "mesh.c=4", "mesh.t=1", "model.context_impl=ring"]
    )
    text = context_report(split)
    assert text.startswith("context: the sequence split over c = 4 ('B/dp L@zigzag/c'")
    rows = {line.split()[0]: line.split() for line in text.splitlines()[3:]}
    assert set(rows) == {"allgather", "ring"} and rows["ring"][1] == "*"
    # Per layer: allgather gathers k and v once each; the ring shifts each c - 1 = 3 times
    # forward and k, v 3 times and dk, dv 4 times backward (recompute: the gathers again).
    assert rows["allgather"][1] == "6" and rows["ring"][2] == str(2 * 3 + 2 * 3 + 2 * 4)
    assert "c = 1, the sequence is not split" in context_report(load_config(None, OVERRIDES))


def test_moe_report_reads_the_exchange_off_the_config_and_the_notation():
    """tiny-cpu-moe on e=2 x d=2 x t=2: T = 32/(2 x 2) rows x 128 tokens = 1024 per device,
    dropless C = T x min(3, 8/2) = 3072 rows, f32 buffers [2, 3072, 128]; the all-to-alls per
    step and their bytes are the predicted collectives' over e; the weight table lists the
    MoE stack; the parameter line gives total and active."""
    from pathlib import Path

    from seqshard.model.cost import param_counts
    from seqshard.plan.show import moe_report, parameters_line
    from seqshard.plan.step_comms import collectives_per_step

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu-moe.yaml")
    text = moe_report(cfg)
    assert "E/e = 4 experts per device (mesh.e=2)" in text
    buffer = 2 * 3072 * 128 * 4
    assert f"2 x 2 x 3,072 x 128 x 4 B = {format_bytes(2 * buffer)}" in text
    exchanges = [c for c in collectives_per_step(cfg) if c.kind == "all-to-all"]
    sent = format_bytes(sum(c.bytes_per_step for c in exchanges))
    assert re.search(
        rf"all-to-all over e: {sum(c.calls for c in exchanges)} per step .* {re.escape(sent)} sent",
        text,
    )
    assert "moe_layers.w_gate" in {row[0] for row in weight_table(cfg)}
    n = param_counts(cfg.model)
    assert n.total == param_count(cfg.model) and n.active < n.total
    assert f"active per token {n.active:,}" in parameters_line(cfg)


def test_the_plan_header_counts_a_small_moes_parameters_in_millions():
    """Issue 41, item 14: tiny-cpu-moe's header said "parameters 0.00 B total, 0.00 B active"."""
    from pathlib import Path

    from seqshard.model.cost import param_counts
    from seqshard.plan.planner import plan
    from seqshard.plan.show import format_plan

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu-moe.yaml")
    n = param_counts(cfg.model)
    text = format_plan(plan(cfg, cfg.mesh.n_devices, "cpu"))
    assert f"parameters {n.total / 1e6:.2f} M total, {n.active / 1e6:.2f} M active" in text, text


def test_the_pipeline_report_counts_the_rows_of_every_batch_axis():
    """The residual block ring_shift moves over p holds a microbatch's rows per device,
    'B/dp': split over d and e (it was counted over d alone, twice too large with e = 2)."""
    from seqshard.plan.show import pipeline_report, pipeline_shifts

    cfg = load_config(
        None,
        [
            *OVERRIDES,
            "model.n_layers=2",
            "model.moe.n_experts=4",
            "model.moe.top_k=2",
            "model.moe.d_ff=16",
            "mesh.p=2",
            "mesh.e=2",
            "mesh.d=2",
            "mesh.t=1",
            "train.microbatches=2",
        ],
    )
    batch, seq, width = cfg.train.batch_size, cfg.train.seq_len, cfg.model.d_model
    rows = batch // (2 * 2 * 2)  # d x e x microbatches
    _, block = pipeline_shifts(cfg)
    assert block == rows * seq * width * 4  # f32, L and M whole (c = t = 1)
    assert f"2 microbatch(es) of {rows} rows" in pipeline_report(cfg)
