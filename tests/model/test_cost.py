"""Tests for seqshard/model/cost.py: closed forms (seed 004), the table of operations (its sums,
seed 004's standard layer built from its rows, attention's causal half, remat's recompute,
per-device splits), parameter counts, the matmuls of the traced loss and gradient, XLA's own
FLOP count of the compiled forward and train step, MFU arithmetic and the memory estimate."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.extend.core
import pytest
from model_weights import packed_batch, random_weights, tiny_model

from seqshard.batch import batch_structs
from seqshard.config import Config, DataConfig, MeshConfig, TrainConfig, check_config
from seqshard.model import attention_block, init_weights, loss_fn, swiglu, weight_structs
from seqshard.model.config import ModelConfig
from seqshard.model.cost import (
    OPTIMIZER_FLOPS_PER_PARAM,
    PHASES,
    StepFlops,
    flops_per_token,
    hardware_flops_per_token,
    layer_bytes,
    matmul_flops_per_token,
    memory_per_device,
    mfu,
    param_bytes,
    param_count,
    recomputes,
    step_flops,
)
from seqshard.shardlib.tables import format_bytes
from seqshard.testing import fake_cpu_mesh
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import train_state_structs
from seqshard.train.step import make_train_step


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab=256, d_model=128, n_layers=2, n_q_per_kv=2, n_kv=2, d_head=32, d_ff=512)
    return ModelConfig(**{**base, **kw})


# ---------------------------------------------------------------------------------------------
# Closed forms


def test_gpt_layer_closed_form_seed_004():
    """Multi-head attention (n_q_per_kv=1, n_heads*d_head = h) and a SwiGLU FFN with
    d_ff = 8h/3, whose three h x d_ff matmuls cost exactly a 4h MLP's two h x 4h: the layer
    is seed 004's GPT layer, forward 24bsh^2 + 4bs^2h, backward 48bsh^2 + 8bs^2h."""
    h, n_heads, b, s, vocab = 96, 4, 3, 64, 1000
    cfg = _cfg(
        vocab=vocab, d_model=h, n_layers=5, n_q_per_kv=1, n_kv=n_heads, d_head=h // n_heads,
        d_ff=8 * h // 3,
    )  # fmt: skip
    assert 3 * cfg.d_ff == 8 * h  # the identity is exact for these numbers
    parts = matmul_flops_per_token(cfg, s)
    fwd_layer = 24 * b * s * h**2 + 4 * b * s**2 * h
    bwd_layer = 48 * b * s * h**2 + 8 * b * s**2 * h
    assert b * s * parts.layer == fwd_layer
    # LM head apart: forward 2bshV, backward 4bshV (seed 004's lm_head row).
    assert b * s * parts.lm_head == 2 * b * s * h * vocab
    flops = flops_per_token(cfg, s)
    assert b * s * flops.forward == cfg.n_layers * fwd_layer + 2 * b * s * h * vocab
    # Seed 004's final tally, matmul terms only: n_layer(48bsh^2 + 8 b n_h s^2 d) + 4bshV.
    assert b * s * flops.backward == cfg.n_layers * bwd_layer + 4 * b * s * h * vocab
    assert flops.recompute == 0
    assert flops.total == 3 * flops.forward


@pytest.mark.parametrize("n_heads", [1, 4, 8])
def test_attention_and_ffn_parts_mha(n_heads):
    """Attention parts against 8bsh^2 + 4bs^2h, FFN against SwiGLU's 6 b s h d_ff."""
    h, b, s, d_ff = 128, 2, 40, 352
    cfg = _cfg(d_model=h, n_q_per_kv=1, n_kv=n_heads, d_head=h // n_heads, d_ff=d_ff)
    parts = matmul_flops_per_token(cfg, s)
    assert b * s * parts.attention == 8 * b * s * h**2 + 4 * b * s**2 * h
    assert b * s * (parts.attn_scores + parts.attn_values) == 4 * b * s**2 * h
    assert b * s * parts.ffn == 6 * b * s * h * d_ff


def test_gqa_qkv_projection():
    """qkv = 2 b s h (n_heads + 2 n_kv) d_head, also when n_heads * d_head != d_model."""
    h, b, s = 96, 2, 16
    for q, k, d in [(4, 2, 16), (1, 8, 8), (8, 1, 64), (3, 3, 10)]:
        cfg = _cfg(d_model=h, n_q_per_kv=q, n_kv=k, d_head=d)
        parts = matmul_flops_per_token(cfg, s)
        n_heads = q * k
        assert b * s * parts.qkv == 2 * b * s * h * (n_heads + 2 * k) * d
        assert b * s * parts.out_proj == 2 * b * s * h * n_heads * d
        assert parts.attn_scores == parts.attn_values == 2 * s * n_heads * d


def test_six_n_plus_attention_identity():
    """Model FLOPs per token = 6 N + 12 n_layers L n_heads d_head, N = matmul weights."""
    cfg = _cfg(vocab=1000, d_model=192, n_layers=3, n_q_per_kv=3, n_kv=2, d_head=24, d_ff=500)
    seq_len = 77
    n_matmul = param_count(cfg) - cfg.vocab * cfg.d_model - (2 * cfg.n_layers + 1) * cfg.d_model
    expect = 6 * n_matmul + 12 * cfg.n_layers * seq_len * cfg.n_heads * cfg.d_head
    assert flops_per_token(cfg, seq_len).total == expect


def test_attention_grows_with_seq_len_only():
    cfg = _cfg()
    a, b = matmul_flops_per_token(cfg, 100), matmul_flops_per_token(cfg, 300)
    assert b.attn_scores == 3 * a.attn_scores and b.attn_values == 3 * a.attn_values
    for part in ("qkv", "out_proj", "ffn", "lm_head", "n_layers"):
        assert getattr(a, part) == getattr(b, part)
    with pytest.raises(ValueError, match="seq_len"):
        matmul_flops_per_token(cfg, 0)


def test_hardware_flops_by_remat():
    """Per token of _cfg(n_layers=4) (M 128, 4 heads of D 32 over K 2, F 512, V 256) at
    L 256, by hand. Per layer: q, o 2*128*4*32 = 32_768 each; k, v 2*128*2*32 = 16_384 each;
    q . k^T and probs . v 2 * 256 keys * 4 heads * 32 = 65_536 each; gate, up, down
    2*128*512 = 131_072 each: 622_592 in all. Forward 4 * 622_592 + logits 2*128*256 =
    2_555_904; 'saved' re-runs q . k^T, 'full' the layer but the down projection."""
    base = _cfg(n_layers=4)
    hw = {r: hardware_flops_per_token(dataclasses.replace(base, remat=r), 256) for r in
          ("none", "saved", "full")}  # fmt: skip
    model = flops_per_token(base, 256)
    assert (model.forward, model.backward) == (2_555_904, 2 * 2_555_904)
    for r, f in hw.items():
        assert (f.forward, f.backward) == (model.forward, model.backward), r
        # Model FLOPs do not depend on the remat policy.
        assert flops_per_token(dataclasses.replace(base, remat=r), 256) == model
    assert hw["none"].recompute == 0
    assert hw["saved"].recompute == 4 * 65_536 == 262_144
    # 32_768 + 2 * 16_384 + 2 * 65_536 + 32_768 + 2 * 131_072 = 491_520 per layer
    assert hw["full"].recompute == 4 * 491_520 == 1_966_080


# ---------------------------------------------------------------------------------------------
# Parameters


def test_param_count_by_hand():
    cfg = _cfg(vocab=10, d_model=4, n_layers=2, n_q_per_kv=2, n_kv=1, d_head=2, d_ff=6)
    embed = unembed = 10 * 4
    final_norm = 4
    w_q = w_o = 4 * 2 * 1 * 2
    w_kv = 2 * 4 * 1 * 2
    ffn = 3 * 4 * 6
    norms = 2 * 4
    per_layer = w_q + w_kv + w_o + ffn + norms
    assert per_layer == 128
    assert param_count(cfg) == embed + unembed + final_norm + 2 * per_layer == 340
    assert param_bytes(cfg) == 4 * 340
    assert param_bytes(cfg, "bfloat16") == 2 * 340
    with pytest.raises(ValueError, match="unknown dtype"):
        param_bytes(cfg, "float8")


def _closed_form_param_count(cfg: ModelConfig) -> int:
    """The count written out by hand, independent of the weight types."""
    m, v = cfg.d_model, cfg.vocab
    qkd = cfg.n_heads * cfg.d_head
    per_layer = (
        m * qkd  # w_q    'd_model n_q_per_kv n_kv d_head'
        + 2 * m * cfg.n_kv * cfg.d_head  # w_kv   '2 d_model n_kv d_head'
        + m * qkd  # w_o    'd_model n_q_per_kv n_kv d_head'
        + 3 * m * cfg.d_ff  # w_gate, w_up, w_down 'd_model d_ff'
        + 2 * m  # ln1, ln2
    )
    return 2 * v * m + cfg.n_layers * per_layer + m  # untied embed, unembed; final norm


@pytest.mark.parametrize(
    "sizes",
    [
        dict(vocab=10, d_model=4, n_layers=1, n_q_per_kv=1, n_kv=1, d_head=2, d_ff=6),
        dict(vocab=48, d_model=32, n_layers=3, n_q_per_kv=2, n_kv=2, d_head=8, d_ff=40),
        dict(vocab=1000, d_model=96, n_layers=5, n_q_per_kv=3, n_kv=4, d_head=10, d_ff=250),
        dict(vocab=50304, d_model=768, n_layers=12, n_q_per_kv=1, n_kv=12, d_head=64, d_ff=2048),
    ],
)
def test_param_count_from_the_types_matches_the_closed_form(sizes):
    """param_count reads the weight types; the closed form, kept only here, is the check."""
    cfg = ModelConfig(**sizes)
    assert param_count(cfg) == _closed_form_param_count(cfg)
    assert param_bytes(cfg) == 4 * _closed_form_param_count(cfg)  # f32 master weights


def test_param_bytes_are_the_bytes_of_init_weights():
    """The shapes and dtypes init_weights makes (on a 2x2 mesh, traced, not run)."""
    cfg = _cfg(vocab=48, d_model=32, n_layers=3, n_q_per_kv=2, n_kv=2, d_head=8, d_ff=40)
    mesh = fake_cpu_mesh((2, 2), ("d", "t"))
    leaves = jax.tree.leaves(jax.eval_shape(lambda: init_weights(cfg, mesh, jax.random.key(0))))
    # embed, unembed, final_norm and 8 per-layer weights (no q_norm, k_norm: model.qk_norm off)
    assert len(leaves) == 11
    # 2 * 48 * 32 (embed, unembed) + 32 (final norm) + 3 layers * (3 * 32 * 4 * 8 (w_q, w_kv,
    # w_o) + 3 * 32 * 40 (FFN) + 2 * 32 (norms)).
    assert sum(math.prod(x.shape) for x in leaves) == param_count(cfg) == 24_032
    assert sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves) == param_bytes(cfg)
    assert param_bytes(cfg, "bfloat16") == 2 * param_count(cfg)
    # model.qk_norm adds two gains of d_head per layer.
    assert param_count(dataclasses.replace(cfg, qk_norm=True)) == 24_032 + 3 * 2 * 8


# ---------------------------------------------------------------------------------------------
# The table of operations

SEED_004_LAYER = ("q", "k", "v", "scores", "values", "o", "up", "down")
"""Seed 004's standard layer as rows of the table: GPT-2's multi-head attention (its fused
qkv projection is our q, k and v) and its MLP, ``h -> 4h -> h`` through GELU: two matmuls,
no gate, so SwiGLU's gate row is left out. Norms, softmax and the activation are elementwise
and apart from the closed forms."""

ATTENTION = ("scores", "mask", "softmax", "values")  # the rows over (query, key) pairs


def _layer_names(table: StepFlops) -> list[str]:
    return [op.name for op in table.ops if op.in_layer]


def test_seed_004_closed_forms_from_the_table():
    """An MHA layer with d_ff = 4h, its gate left out: seed 004's standard layer, whose
    matmuls are forward 24bsh^2 + 4bs^2h and backward 48bsh^2 + 8bs^2h, exactly."""
    h, n_heads, b, s, vocab, n_layers = 96, 4, 3, 64, 1000, 5
    d = h // n_heads
    cfg = _cfg(vocab=vocab, d_model=h, n_layers=n_layers, n_q_per_kv=1, n_kv=n_heads, d_head=d,
               d_ff=4 * h, remat="none")  # fmt: skip
    table = step_flops(cfg, batch=b, seq_len=s)
    layer = table.per_run()  # one layer's rows
    assert all(layer[n].kind == "matmul" for n in SEED_004_LAYER)
    assert layer.sum("forward", names=SEED_004_LAYER) == 24 * b * s * h**2 + 4 * b * s**2 * h
    assert layer.sum("backward", names=SEED_004_LAYER) == 48 * b * s * h**2 + 8 * b * s**2 * h
    # Seed 004's final tally, matmul terms: n_layer (48bsh^2 + 8 b n_h s^2 d) + 4bshV.
    network = table.sum("backward", names=(*SEED_004_LAYER, "logits"))
    assert (
        network
        == n_layers * (48 * b * s * h**2 + 8 * b * n_heads * s**2 * d) + 4 * b * s * h * vocab
    )
    assert table.sum("forward", names=(*SEED_004_LAYER, "logits")) == (
        n_layers * (24 * b * s * h**2 + 4 * b * s**2 * h) + 2 * b * s * h * vocab
    )
    # Its elementwise rows where the seed has them: softmax's backward 4 b n_h s^2; scaling
    # b n_h s^2, which our mask row does with the masked select (2 b n_h s^2); the residual
    # adds' backward free but for summing the two paths' cotangents (b s h each).
    assert layer["softmax"].backward == 4 * b * n_heads * s**2
    assert layer["mask"].backward == 2 * b * n_heads * s**2
    assert layer["attn_residual"].backward == layer["ffn_residual"].backward == b * s * h
    # Every matmul is seed 004's 2mnp forward, one matmul per operand backward.
    assert all(op.backward == 2 * op.forward for op in table.ops if op.kind == "matmul")


def test_table_sums_are_the_per_token_figures():
    """flops_per_token, hardware_flops_per_token and MatmulFlops are the table's matmul rows
    over the tokens of the step (the MFU figure counts attention over all pairs)."""
    for cfg, seq_len in [
        (_cfg(), 128),
        (_cfg(vocab=1000, d_model=96, n_layers=3, n_q_per_kv=3, n_kv=4, d_head=10, d_ff=250), 77),
    ]:
        for remat in ("none", "saved", "full"):
            cfg = dataclasses.replace(cfg, remat=remat)
            for batch in (1, 6):
                table = step_flops(cfg, batch=batch, seq_len=seq_len)
                tokens = batch * seq_len
                model, hw = flops_per_token(cfg, seq_len), hardware_flops_per_token(cfg, seq_len)
                assert table.sum("forward", "matmul") == tokens * model.forward
                assert table.sum("backward", "matmul") == tokens * model.backward
                assert table.sum("recompute", "matmul") == tokens * hw.recompute
                parts = matmul_flops_per_token(cfg, seq_len)
                assert (
                    table.sum("forward", names=("q", "k", "v")) == tokens * cfg.n_layers * parts.qkv
                )
                assert table["down"].forward == tokens * cfg.n_layers * parts.ffn_down
                assert table["logits"].forward == tokens * parts.lm_head
                assert table.sum("forward", "matmul") == tokens * parts.total
    table = step_flops(_cfg(), batch=2, seq_len=16)
    assert table.total == sum(table.sum(p) for p in PHASES)
    assert table.total == table.sum(kind="matmul") + table.sum(kind="elementwise")
    assert (
        table.sum("update")
        == table["optimizer"].update
        == (OPTIMIZER_FLOPS_PER_PARAM * param_count(_cfg()))
    )
    two = step_flops(_cfg(), batch=2, seq_len=16, microbatches=2)
    assert two["optimizer"].update == (OPTIMIZER_FLOPS_PER_PARAM + 2) * param_count(_cfg())
    assert two.sum("forward") == table.sum("forward")
    with pytest.raises(KeyError, match="no operation 'ffn'"):
        table["ffn"]
    with pytest.raises(ValueError, match="batch"):
        step_flops(_cfg(), batch=0, seq_len=16)


def test_causal_counts_the_useful_half_of_attention():
    """causal=True: scores, mask, softmax and values over the L (L+1) / 2 pairs a causal mask
    keeps per row; every other row as computed."""
    cfg, b, s = _cfg(n_layers=3), 3, 40
    computed = step_flops(cfg, batch=b, seq_len=s)
    causal = step_flops(cfg, batch=b, seq_len=s, causal=True)
    assert causal.causal and not computed.causal
    assert [op.name for op in computed.ops if op.per == "pair"] == list(ATTENTION)
    for c, op in zip(causal.ops, computed.ops, strict=True):
        for phase in PHASES:
            if op.name in ATTENTION:
                assert 2 * s * getattr(c, phase) == (s + 1) * getattr(op, phase), op.name
            else:
                assert getattr(c, phase) == getattr(op, phase), op.name
    assert causal.total < computed.total


# The layer's rows of _cfg(n_layers=3) (M 128, Q 2 x K 2 = 4 heads, D 32, F 512) in a step of
# batch 2 x seq_len 32, forward FLOPs by hand: 3 layers x 64 tokens = 192 token-runs and
# 3 x 2 rows x 32 queries x 32 keys x 4 heads = 24_576 pair-runs.
LAYER_FORWARD = {
    "attn_norm": 192 * (4 * 128 + 3),  # x*x, sum, / M, + eps, rsqrt, x * r, * gain: 98_880
    "q": 192 * 2 * 128 * 4 * 32,  # 6_291_456
    "k": 192 * 2 * 128 * 2 * 32,  # 3_145_728
    "v": 192 * 2 * 128 * 2 * 32,
    "rope": 192 * 3 * (4 + 2) * 32,  # 6 per pair of elements of q's 4 and k's 2 heads
    "scores": 24_576 * 2 * 32,  # 1_572_864
    "mask": 24_576 * 2,  # scale, select
    "softmax": 24_576 * 5,  # max, subtract, exp, sum, divide
    "values": 24_576 * 2 * 32,
    "o": 192 * 2 * 4 * 32 * 128,
    "attn_residual": 192 * 128,
    "ffn_norm": 192 * (4 * 128 + 3),
    "gate": 192 * 2 * 128 * 512,  # 25_165_824
    "up": 192 * 2 * 128 * 512,
    "swiglu": 192 * 3 * 512,  # sigmoid, gate * s, * up
    "down": 192 * 2 * 512 * 128,
    "ffn_residual": 192 * 128,
}
SAVED_RECOMPUTES = {"attn_norm", "scores", "mask", "softmax", "ffn_norm", "swiglu"}


@pytest.mark.parametrize(
    "remat, recomputed",
    [
        ("none", set()),
        # the norms (the projections' weight-gradient operands), the probabilities, SwiGLU's
        # product (the down projection's operand): what the backward needs and nothing marks
        ("saved", SAVED_RECOMPUTES),
        # only the layer input kept: all but the down projection and the residual add after
        # it, whose outputs no backward reads
        ("full", set(LAYER_FORWARD) - {"down", "ffn_residual"}),
    ],
)
def test_recompute_per_policy(remat, recomputed):
    """The policy names the layer operations it re-runs (seqshard.shardlib.remat); each re-runs its
    whole forward, as counted by hand above. The operations outside the layer scan are never
    recomputed."""
    cfg = _cfg(remat=remat, n_layers=3)
    table = step_flops(cfg, batch=2, seq_len=32)
    assert _layer_names(table) == list(LAYER_FORWARD)
    assert {name: table[name].forward for name in LAYER_FORWARD} == LAYER_FORWARD
    expect = {op.name: LAYER_FORWARD[op.name] if op.name in recomputed else 0 for op in table.ops}
    assert {op.name: op.recompute for op in table.ops} == expect
    # The blocks' operations as they declare them, the table's rows and the two it has no row
    # for: model.qk_norm's (off here) and the transfer of k and v over c (computes nothing).
    declared = {op.name for block in (attention_block.ATTENTION, swiglu.SWIGLU) for op in block.ops}
    assert declared == set(LAYER_FORWARD) | {"qk_norm", "context"}
    extra = {"none": set(), "saved": {"context"}, "full": {"context", "qk_norm"}}[remat]
    assert {name for name in declared if recomputes(remat, name)} == recomputed | extra


def test_qk_norm_rows_count_one_norm_per_q_and_k_head():
    """model.qk_norm adds one row: RMSNorm's 4 D + 3 forward and 8 D backward per head of q
    and of k, per token and layer, re-run only under remat=full (q and k before the norm are
    kept); without it the table has no such row."""
    b, s = 2, 16
    for remat in ("saved", "full"):
        row = step_flops(_cfg(qk_norm=True, remat=remat), batch=b, seq_len=s)["qk_norm"]
        # 2 layers x 32 tokens x 6 heads (4 query, 2 kv) = 384 head-runs of d_head 32:
        # forward 384 * (4*32 + 3), backward 384 * 8*32.
        assert row.forward == 50_304
        assert row.backward == 98_304
        assert row.recompute == {"saved": 0, "full": 50_304}[remat]
    with pytest.raises(KeyError, match="no operation 'qk_norm'"):
        step_flops(_cfg(), batch=b, seq_len=s)["qk_norm"]


def test_per_device_and_per_run():
    """Each row is split over the mesh axes of its spec: the norms of the gathered 'B/d/e L M'
    run whole on every t shard; the matmuls split over d and t."""
    cfg = _cfg(n_kv=4, n_layers=3)
    table = step_flops(cfg, batch=4, seq_len=16)
    dev = table.per_device({"d": 2, "t": 4})
    assert table["attn_norm"].split_axes == ("d", "e")
    assert dev["attn_norm"].forward * 2 == table["attn_norm"].forward
    assert table["q"].split_axes == ("d", "e", "t") and table["scores"].split_axes == (
        "d",
        "e",
        "t",
    )
    assert dev["q"].backward * 8 == table["q"].backward
    assert dev["attn_residual"].forward * 8 == table["attn_residual"].forward  # 'B/d/e L M/t'
    assert dev["optimizer"].update * 8 == table["optimizer"].update
    assert table.per_device({"d": 1, "t": 1}) == table
    one = table.per_run()
    assert one["q"].forward * 3 == table["q"].forward and one["q"].runs == 1
    assert one["logits"] == table["logits"]
    with pytest.raises(ValueError, match="do not split evenly"):
        step_flops(cfg, batch=3, seq_len=15).per_device({"d": 2})  # 45 rows of tokens over d=2


# ---------------------------------------------------------------------------------------------
# The matmuls jax traces


def _dot_flops(jaxpr: jax.extend.core.Jaxpr, runs: int = 1) -> int:
    """2 x output elements x contracted size of every dot_general in ``jaxpr``: per device
    inside a shard_map, a scan's body once per iteration, other inner jaxprs (pjit, remat,
    custom_vjp) once."""
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contracted, _), _ = eqn.params["dimension_numbers"]
            lhs, out = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
            total += runs * 2 * math.prod(out) * math.prod(lhs[i] for i in contracted)
        inner = runs * eqn.params["length"] if eqn.primitive.name == "scan" else runs
        total += sum(_dot_flops(j, inner) for j in jax.extend.core.jaxprs_in_params(eqn.params))
    return total


# tiny_model(n_layers=3): V 64, M 32, Q 2 x K 8 = 16 heads, D 8, F 64; 4 rows of 16 tokens on
# d=2 x t=2 (every matmul splits over both: a quarter per device). Forward per token, per
# layer: q, o 2*32*16*8 = 8192 each; k, v 2*32*8*8 = 4096 each; gate, up, down 2*32*64 = 4096
# each; q . k^T and probs . v 2*8 per (key, head) = 2 * 16*16*16 = 8192 together: 45_056;
# and the logits 2*32*64 = 4096 once. Per device 64 * (3 * 45_056 + 4096) / 4 = 2_228_224.
TRACED_FORWARD = 2_228_224


@pytest.mark.parametrize("backward", ["explicit", "autodiff"])
@pytest.mark.parametrize(
    "remat, recompute",
    [
        ("none", 0),
        ("saved", 64 * 3 * 4096 // 4),  # q . k^T: 196_608
        ("full", 64 * 3 * (45_056 - 4096) // 4),  # the layer but down: 1_966_080
    ],
)
def test_matmul_rows_are_the_dot_generals_jax_traces(backward, remat, recompute):
    """The matmul FLOPs of the loss's jaxpr and of its gradient's (the hand-written backward
    and jax.checkpoint's), counted from the dot_generals' shapes: the table's forward, and
    its backward plus recompute (the forward again, as the hand count above says), per
    device. Traced, not compiled; XLA's count below checks the rest of the step."""
    cfg = tiny_model(n_layers=3, remat=remat, backward=backward)
    mesh = fake_cpu_mesh((2, 2), ("d", "t"))
    tokens, starts = packed_batch(cfg.vocab, 4, 16)
    w = random_weights(cfg, mesh)

    def loss(w):
        return loss_fn(w, tokens, starts, cfg, mesh)

    forward = _dot_flops(jax.make_jaxpr(loss)(w).jaxpr)
    step = _dot_flops(jax.make_jaxpr(jax.grad(loss))(w).jaxpr)
    assert forward == TRACED_FORWARD
    # The backward is one matmul per operand of each (2 x forward); the rest is recompute.
    assert step == 3 * TRACED_FORWARD + recompute
    table = step_flops(cfg, batch=4, seq_len=16).per_device({"d": 2, "t": 2})
    assert table.sum("forward", "matmul") == forward
    assert table.sum("backward", "matmul") + table.sum("recompute", "matmul") == step - forward
    assert table.sum("recompute", "matmul") == recompute
    parts = matmul_flops_per_token(cfg, 16)  # per token, per layer
    assert 64 * 3 * parts.recomputed(lambda op: recomputes(remat, op)) // 4 == recompute


# ---------------------------------------------------------------------------------------------
# XLA's count of the compiled model
#
# XLA's cost_analysis of the forward (loss) and of the whole train step (make_train_step:
# forward, backward, remat's recompute, clipping and AdamW), f32, einsum attention, on fake CPU
# devices, against the table. How XLA counts, and so how we compare:
#
# * per device: the table's per_device, each row over its spec's mesh axes;
# * a while loop's body once, not once per iteration: the layers run in lax.scan, so XLA sees
#   one layer (checked below: 2 and 3 layers give the same count) and we compare the table's
#   per_run. Unrolling the scan would let XLA's CSE merge remat's recompute back into the
#   forward pass, so the model's scan stays rolled (n_layers >= 2);
# * exp, rsqrt, log, sin, cos apart, as 'transcendentals': we add them back (the table
#   counts them as FLOPs).
#
# Measured (JAX 0.10.2, CPU; four configs, three policies), XLA / table: forward 1.005 to
# 1.009, train step 1.017 to 1.032. The difference is all elementwise: XLA counts 1.27x to
# 1.34x the table's elementwise forward and about 2x its backward. The table counts each op's
# analytic minimum, seed 004's way; XLA counts what runs. Measured apart: RMSNorm's forward is
# the table's (XLA 4M + 2 per token), but its backward as autodiff writes it costs XLA 13 M
# per token against the fused 8 M; sigmoid is 3 FLOPs and a transcendental (the table: 1);
# the update costs XLA 35 FLOPs per parameter against the table's 25 (clipping, AdamW and the
# apply alone count 21, and 9 appear only once the non-finite guard's selects also consume the
# new weights and moments: XLA fuses cheap producers into each consumer and counts each copy).
# And the table leaves out positions and masks, the select of the embedding's vocab block and
# the loss's per-position scalars.

XLA_MODEL = dict(vocab=256, d_model=64, n_layers=2, n_q_per_kv=2, n_kv=2, d_head=32, d_ff=256,
                 compute_dtype="float32", attention_impl="einsum")  # fmt: skip
XLA_MESH, XLA_BATCH, XLA_LEN = (2, 2), 4, 64


def _xla_flops(compiled) -> float:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per computation
        cost = cost[0]
    return float(cost.get("flops", 0.0) + cost.get("transcendentals", 0.0))


def _train_config(model: ModelConfig, mesh: tuple[int, int], batch: int, seq_len: int) -> Config:
    cfg = Config(
        model=model,
        mesh=MeshConfig(d=mesh[0], t=mesh[1]),
        data=DataConfig(vocab_size=model.vocab),
        train=TrainConfig(batch_size=batch, seq_len=seq_len, warmup_steps=0),
    )
    check_config(cfg)
    return cfg


@functools.cache
def _xla_forward(model: ModelConfig, mesh: tuple[int, int], batch: int, seq_len: int) -> float:
    devices = fake_cpu_mesh(mesh, ("d", "t"))
    structs = (weight_structs(model, devices), batch_structs(batch, seq_len, devices))
    fn = jax.jit(lambda w, b: loss_fn(w, b.tokens, b.is_seq_start, model, devices))
    return _xla_flops(fn.lower(*structs).compile())


@functools.cache
def _xla_train_step(model: ModelConfig, mesh: tuple[int, int], batch: int, seq_len: int) -> float:
    cfg = _train_config(model, mesh, batch, seq_len)
    devices = fake_cpu_mesh(mesh, ("d", "t"))
    opt = make_optimizer(cfg.train)
    step = make_train_step(cfg, devices, opt)
    structs = (train_state_structs(model, devices, opt), batch_structs(batch, seq_len, devices))
    return _xla_flops(step.lower(*structs).compile())


def _ours(model: ModelConfig, mesh: tuple[int, int], batch: int, seq_len: int) -> StepFlops:
    """The table as XLA sees the step: per device, one run of the layer."""
    table = step_flops(model, batch=batch, seq_len=seq_len)
    return table.per_device({"d": mesh[0], "t": mesh[1]}).per_run()


def _check_forward(model, mesh, batch, seq_len) -> float:
    ratio = _xla_forward(model, mesh, batch, seq_len) / _ours(model, mesh, batch, seq_len).sum(
        "forward"
    )
    assert 1.0 <= ratio < 1.10, ratio
    return ratio


def _check_train_step(model, mesh, batch, seq_len) -> float:
    ratio = _xla_train_step(model, mesh, batch, seq_len) / _ours(model, mesh, batch, seq_len).total
    assert 1.0 <= ratio < 1.10, ratio
    return ratio


def test_forward_matches_xla():
    """The compiled loss on a 2x2 mesh. Measured XLA / table 1.008 (all of it elementwise;
    see above); and XLA counts the scanned layer once: 3 layers cost what 2 do."""
    model = ModelConfig(**XLA_MODEL)
    _check_forward(model, XLA_MESH, XLA_BATCH, XLA_LEN)
    deeper = dataclasses.replace(model, n_layers=3)
    assert _xla_forward(deeper, XLA_MESH, XLA_BATCH, XLA_LEN) == _xla_forward(
        model, XLA_MESH, XLA_BATCH, XLA_LEN
    )


@pytest.mark.parametrize("remat", ["none", "saved", "full"])
def test_train_step_matches_xla(remat):
    """The whole compiled train step on a 2x2 mesh, under each remat policy. Measured XLA /
    table: none 1.025, saved 1.028, full 1.021."""
    _check_train_step(ModelConfig(**XLA_MODEL, remat=remat), XLA_MESH, XLA_BATCH, XLA_LEN)


@pytest.mark.slow
def test_remat_recompute_matches_xla():
    """What a policy adds to XLA's count of the train step over 'none' is the table's
    recompute. Measured XLA / table: saved 1.12, full 1.005. 'saved' re-runs q . k^T (82% of
    its recompute here) and the norms, mask, softmax and SwiGLU product; leaving out q . k^T
    would put the ratio near 6, leaving out the softmax and mask near 1.3. (XLA counts the
    recomputed elementwise work at 1.5x to 2.5x the table's, so the ratio for 'saved' grows
    where that work is a larger share: 1.63 with d_ff=512 and d_head=16.)

    Autodiff's backward. The hand-written one (the default) matches the table over the whole
    step (the tests above run it; measured XLA / table: none 1.022, saved 1.018, full 1.016),
    but it rebuilds swish(gate) * up in its backward under every policy ('none' keeps no
    SwiGLU product, backward.ACTIVATIONS), so what 'saved' adds over its own 'none' leaves
    that op out: measured 0.877 of the table's recompute for 'saved', 0.990 for 'full'."""
    autodiff = dict(XLA_MODEL, backward="autodiff")
    none = _xla_train_step(ModelConfig(**autodiff, remat="none"), XLA_MESH, XLA_BATCH, XLA_LEN)
    for remat, (low, high) in (("saved", (1.0, 1.2)), ("full", (1.0, 1.05))):
        model = ModelConfig(**autodiff, remat=remat)
        added = _xla_train_step(model, XLA_MESH, XLA_BATCH, XLA_LEN) - none
        ratio = added / _ours(model, XLA_MESH, XLA_BATCH, XLA_LEN).sum("recompute")
        assert low <= ratio < high, (remat, ratio)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["none", "saved", "full"])
@pytest.mark.parametrize(
    "mesh, batch, seq_len, sizes",
    [
        # Measured XLA / table, forward; train step under none, saved, full.
        # MHA, long heads, one device: 1.005; 1.020, 1.023, 1.017.
        ((1, 1), 2, 128, dict(n_q_per_kv=1, n_kv=2, d_head=64)),
        # GQA 4:1 over d=4, a wide FFN and vocabulary: 1.007; 1.022, 1.027, 1.021.
        ((4, 1), 8, 32, dict(n_q_per_kv=4, n_kv=1, d_head=16, d_ff=512, vocab=512)),
        # t=4, each device one kv head and a quarter of F and V: 1.009; 1.030, 1.032, 1.025.
        ((2, 4), 4, 48, dict(n_kv=4, d_ff=384)),
    ],
)
def test_more_configs_match_xla(mesh, batch, seq_len, sizes, remat):
    model = ModelConfig(**{**XLA_MODEL, **sizes, "remat": remat})
    if remat == "saved":
        _check_forward(model, mesh, batch, seq_len)
    _check_train_step(model, mesh, batch, seq_len)


# ---------------------------------------------------------------------------------------------
# MFU


def test_mfu_arithmetic():
    cfg = _cfg()
    seq_len = 1024
    per_token = flops_per_token(cfg, seq_len).total
    peak = 989e12
    assert mfu(peak / per_token, cfg, peak, seq_len=seq_len) == pytest.approx(1.0)
    assert mfu(0.0, cfg, peak, seq_len=seq_len) == 0.0
    one = mfu(1000.0, cfg, peak, seq_len=seq_len)
    assert one == pytest.approx(1000.0 * per_token / peak)
    assert mfu(2000.0, cfg, peak, seq_len=seq_len) == pytest.approx(2 * one)
    assert mfu(1000.0, cfg, 2 * peak, seq_len=seq_len) == pytest.approx(one / 2)
    # Model FLOPs: the remat policy does not change MFU.
    full = dataclasses.replace(cfg, remat="full")
    assert mfu(1000.0, full, peak, seq_len=seq_len) == one
    with pytest.raises(ValueError, match="peak_flops"):
        mfu(1000.0, cfg, 0.0, seq_len=seq_len)
    with pytest.raises(ValueError, match="tokens_per_s"):
        mfu(-1.0, cfg, peak, seq_len=seq_len)


# ---------------------------------------------------------------------------------------------
# Memory


def test_memory_ordering_full_saved_none():
    base = _cfg(vocab=512, d_model=256, n_layers=4, n_kv=4, d_head=64, d_ff=1024)
    est = {
        r: memory_per_device(dataclasses.replace(base, remat=r), d=2, t=2, batch=8, seq_len=256)
        for r in ("full", "saved", "none")
    }
    assert est["full"].activations < est["saved"].activations < est["none"].activations
    assert est["full"].total < est["saved"].total < est["none"].total
    # The states and logits do not depend on remat.
    for r in ("saved", "none"):
        for part in ("weights", "grads", "optimizer", "logits"):
            assert getattr(est[r], part) == getattr(est["full"], part)


def test_memory_states_and_saved_activations_by_hand():
    cfg = _cfg(vocab=512, d_model=256, n_layers=3, n_q_per_kv=2, n_kv=4, d_head=32, d_ff=768)
    d, t, batch, seq_len = 2, 4, 8, 64
    est = memory_per_device(cfg, d=d, t=t, batch=batch, seq_len=seq_len)
    assert est.weights * d * t == param_bytes(cfg) == 4 * param_count(cfg)
    assert est.grads == est.weights and est.optimizer == 2 * est.weights
    b = batch // d
    x = b * seq_len * (256 // t)
    q = b * seq_len * 2 * (4 // t) * 32
    kv = b * seq_len * (4 // t) * 32
    ff = b * seq_len * (768 // t)
    # x, q, k, v, attention output, h, gate, up in bf16.
    assert est.activations_per_layer == 2 * (x + q + kv + kv + q + x + ff + ff)
    assert est.activations == 3 * est.activations_per_layer
    assert est.logits == 4 * b * seq_len * (512 // t)
    assert est.total == sum(
        getattr(est, p) for p in ("weights", "grads", "optimizer", "activations", "logits")
    )
    full = memory_per_device(
        dataclasses.replace(cfg, remat="full"), d=d, t=t, batch=batch, seq_len=seq_len
    )
    assert full.activations_per_layer == 2 * x
    f32 = memory_per_device(
        dataclasses.replace(cfg, compute_dtype="float32"), d=d, t=t, batch=batch, seq_len=seq_len
    )
    assert f32.activations == 2 * est.activations and f32.weights == est.weights
    assert "per device" in est.summary()


def test_memory_none_by_hand():
    """Without remat: every activation the backward reads, as the blocks declare them (what
    the hand-written backward keeps): the saved arrays, the gathered weights (ln1 and ln2 in
    f32), the blocks' gathered and normalized inputs, the f32 probabilities and the SwiGLU
    product ``silu(gate) * up``."""
    cfg = _cfg(vocab=512, d_model=256, n_layers=3, n_q_per_kv=2, n_kv=4, d_head=32, d_ff=768,
               attention_impl="einsum")  # fmt: skip
    d, t, batch, seq_len = 2, 4, 8, 64
    b, m, q, k, dh, f = batch // d, 256, 2, 4 // t, 32, 768 // t
    x, qs, kv, ff = (b * seq_len * n for n in (m // t, q * k * dh, k * dh, f))
    probs = b * seq_len * seq_len * q * k
    weights = 2 * m * q * k * dh + 2 * m * k * dh + 3 * m * f  # w_q, w_o; w_kv; FFN
    for dtype, c in (("bfloat16", 2), ("float32", 4)):
        kept = c * (2 * x + 2 * qs + 2 * kv + 2 * ff)  # what 'saved' keeps
        extra = (
            c * weights + 4 * 2 * m  # gathered weights; ln1, ln2 in f32
            + c * 4 * b * seq_len * m  # gathered and normalized x and h
            + 4 * probs
            + c * ff  # silu(gate) * up
        )  # fmt: skip
        none = dataclasses.replace(cfg, remat="none", compute_dtype=dtype)
        est = memory_per_device(none, d=d, t=t, batch=batch, seq_len=seq_len)
        assert est.activations_per_layer == kept + extra, dtype


# Measured with the string-matching flops.py that remat policy objects replaced: model d=256,
# n_q_per_kv=2, n_kv=4, d_head=32, d_ff=768, vocab=512, 3 layers; seq_len 128; memory on a
# 2x4 mesh with batch 8. (recompute per token, total per token, activations per layer, total)
# The `none` memory re-pinned when it became the blocks' declared activations (what the
# hand-written backward keeps: q and k before RoPE and the bf16 copy of the probabilities, an
# estimate of autodiff's, dropped; silu(gate) * up counted once).
PINNED = {
    ("bfloat16", "saved"): (196_608, 16_318_464, 720_896, 7_671_296),
    ("bfloat16", "full"): (3_932_160, 20_054_016, 65_536, 5_705_216),
    ("bfloat16", "none"): (0, 16_121_856, 2_885_632, 14_165_504),
    ("float32", "saved"): (196_608, 16_318_464, 1_441_792, 9_833_984),
    ("float32", "full"): (3_932_160, 20_054_016, 131_072, 5_901_824),
    ("float32", "none"): (0, 16_121_856, 5_244_928, 21_243_392),
}


@pytest.mark.parametrize("dtype, remat", list(PINNED))
def test_numbers_are_unchanged_for_every_policy(dtype, remat):
    cfg = _cfg(vocab=512, d_model=256, n_layers=3, n_q_per_kv=2, n_kv=4, d_head=32, d_ff=768,
               compute_dtype=dtype, remat=remat)  # fmt: skip
    hw = hardware_flops_per_token(cfg, 128)
    mem = memory_per_device(cfg, d=2, t=4, batch=8, seq_len=128)
    got = (hw.recompute, hw.total, mem.activations_per_layer, mem.total)
    assert got == PINNED[dtype, remat]


def test_layer_bytes_per_array():
    """Each activation's per-device size, read off its declared spec (b = batch/d, t splits
    heads, d_ff and the residual's M), in its declared dtype (bf16 but the f32 probabilities
    and norm gains)."""
    cfg = _cfg(vocab=512, d_model=256, n_q_per_kv=2, n_kv=4, d_head=32, d_ff=768,
               attention_impl="einsum")  # fmt: skip
    lb = layer_bytes(cfg, d=2, t=4, batch=8, seq_len=64)
    b, L = 4, 64
    assert lb["x"] == lb["h"] == 2 * b * L * 256 // 4
    assert lb["q"] == lb["attn"] == 2 * b * L * 2 * 1 * 32
    assert lb["k"] == lb["v"] == 2 * b * L * 1 * 32
    assert lb["gate"] == lb["up"] == lb["y"] == 2 * b * L * 768 // 4
    assert lb["probs"] == 4 * b * L * L * 2 * 1
    assert lb["ln1"] == 4 * 256 and lb["w_q"] == 2 * 256 * 2 * 1 * 32
    assert "keys" not in lb and "lse" not in lb  # c = 1: k itself; no ring
    with pytest.raises(ValueError, match=r"batch=6 is not divisible by mesh axes d x e = 4 x 1"):
        layer_bytes(cfg, d=4, t=1, batch=6, seq_len=64)


def test_memory_none_scales_quadratically_in_seq_len():
    """Without remat the f32 'b L L Q K/t' probabilities dominate at long L."""
    cfg = _cfg(remat="none")
    a = memory_per_device(cfg, d=1, t=1, batch=2, seq_len=2048).activations_per_layer
    b = memory_per_device(cfg, d=1, t=1, batch=2, seq_len=4096).activations_per_layer
    assert 3.5 < b / a <= 4.0


def test_memory_rejects_bad_meshes():
    cfg = _cfg()
    with pytest.raises(ValueError, match="batch=3 is not divisible"):
        memory_per_device(cfg, d=2, t=1, batch=3, seq_len=16)
    with pytest.raises(ValueError, match="n_kv"):
        memory_per_device(cfg, d=1, t=4, batch=4, seq_len=16)  # n_kv=2 over t=4
    with pytest.raises(ValueError, match="seq_len"):
        memory_per_device(cfg, d=1, t=1, batch=4, seq_len=0)


def test_format_bytes():
    assert format_bytes(0) == "0 B"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(1023 * 2**20) == "1023.00 MiB"
    assert format_bytes(2**60) == "1024.00 PiB"
    assert format_bytes(-2048) == "-2.00 KiB"
