"""A block kind defined here, in a test, through the public API only: nothing under seqshard/
names it. GEGLU3, a gated FFN variant ``(gelu(gate) * (up_a + up_b)) . down`` with its own
weights (one stacked ``g_in`` of three projections, ``g_out``, its norm gain), one auxiliary
output (the mean squared gate, replicated, logged as a metric) and no hand-written backward
(the explicit backward takes ``jax.vjp`` of its forward). ``register_ffn`` makes it a choice
of ``model.ffn``; a config choosing it gets:

    loss, grads   equal to a plain single-device reference of the same model (f32: loss to
                  1e-6 relative, each gradient leaf to 2e-5 of its largest entry) on two meshes
                  (d4 x t2, d2 x c2 x t2), under both backwards
    cost          its operations' rows in the FLOP table, counted by hand
    planner       its weights' gathers among the step's predicted collectives
    optimizer     weight decay from its declarations (none on its norm gain)
    pipeline      trains on p2 x d2 x t2 (gpipe): loss down over 4 steps, its metric logged
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_weights import packed_batch, random_weights, tiny_model

from seqshard.batch import token_batch
from seqshard.config import load_config
from seqshard.mesh import mesh_of_sizes
from seqshard.model import loss_fn
from seqshard.model.block import Activation, Aux, Block, elementwise, gain, matmul, weight
from seqshard.model.config import ModelConfig
from seqshard.model.cost import step_flops
from seqshard.model.layers import register_ffn
from seqshard.model.norm import norm_input, norm_op, normed
from seqshard.model.reference import (
    reference_attention_half,
    reference_embed,
    reference_loss_terms,
    reference_mask,
    reference_norm,
    reference_positions,
    reference_unembed,
)
from seqshard.model.weights import weight_structs
from seqshard.plan.step_comms import collectives_per_step
from seqshard.shardlib import shardops
from seqshard.shardlib.collective_log import part
from seqshard.shardlib.shardtypes import f32, pytree_dataclass
from seqshard.train.optimizer import decay_mask, make_optimizer
from seqshard.train.state import init_train_state
from seqshard.train.step import make_train_step

# -- the block kind ---------------------------------------------------------------------------


def _fan_in(cfg: ModelConfig) -> float:
    return 1 / math.sqrt(cfg.d_model)


@pytree_dataclass
class Geglu3Weights:
    """GEGLU3's weights (one layer's)."""

    ln2: f32["d_model/t/d/e/c"] = gain("model.layers.{i}.post_attention_layernorm.weight")
    g_in: f32["3 d_model/d/e/c d_ff/t"] = weight(_fan_in)  # gate, up_a, up_b
    g_out: f32["d_model/d/e/c d_ff/t"] = weight(_fan_in)


def geglu3_forward(cfg: ModelConfig, inputs, w, a):
    """The block on the residual ``a['h']``: (the residual, {'gate_sq': mean gate^2})."""
    dt = jnp.dtype(cfg.compute_dtype)
    h = a["h"]
    ln2 = a("ln2", lambda: shardops.all_gather("M/t/d/e/c -> M", w.ln2))
    gh = a("gh", lambda: norm_input(cfg, h))
    nh = a("nh", lambda: normed(cfg, gh, ln2))
    with part("geglu_in"):
        w_in = shardops.all_gather("3 M/d/e/c F/t -> 3 M F/t", w.g_in.astype(dt))
        gate, up_a, up_b = shardops.einsum_unreduced(
            "B/d/e L@zigzag/c M, 3 M F/t -> 3 B/d/e L@zigzag/c F/t", nh, w_in
        )
    y = jax.nn.gelu(gate) * (up_a + up_b)
    with part("geglu_out"):
        w_out = shardops.all_gather("M/d/e/c F/t -> M F/t", w.g_out.astype(dt))
        out = shardops.einsum_unreduced(
            "B/d/e L@zigzag/c F/t, M F/t -> B/d/e L@zigzag/c M", y, w_out
        )
        out = shardops.psum_scatter(f"B/d/e L@zigzag/c M -> {cfg.residual_spec}", out)
    # Each device summed its rows and its F/t slice: one psum over every axis that splits them.
    local = jnp.stack([jnp.sum(jnp.square(gate.astype(jnp.float32))), jnp.float32(gate.size)])
    total = shardops.psum("2{U_d,e,c,t} -> 2", local)
    return a("out", lambda: (h + out).astype(dt)), {"gate_sq": total[0] / total[1]}


def geglu3_metrics(cfg, aux, names, w) -> dict:
    return {f"geglu_gate_sq/{layer}": aux["gate_sq"][i] for i, layer in enumerate(names)}


_RERUN = ("saved", "full")

GEGLU3 = register_ffn(
    Block(
        name="geglu3",
        activations=(
            Activation("ln2", "M", "f32", "ffn_norm", needed=False),
            Activation("gh", "B/d/e L/c M", "compute", "ffn_norm", needed=False),
            Activation("nh", "B/d/e L/c M", "compute", "ffn_norm", needed=False),
            Activation("out", "B/d/e L/c M/t", "compute", "ffn_residual", needed=False),
        ),
        ops=(
            norm_op("ffn_norm", consumers=1, recomputed_by=_RERUN),
            matmul(
                "geglu_in",
                "token",
                "B/d/e L M, 3 M F/t -> 3 B/d/e L F/t",
                lambda m: 3 * 2 * m.d_model * m.d_ff,
                _RERUN,
            ),
            # gelu (tanh form, about 8), the add and the product
            elementwise(
                "geglu",
                "token",
                "B/d/e L F/t",
                lambda m: 10 * m.d_ff,
                lambda m: 14 * m.d_ff,
                _RERUN,
            ),  # fmt: skip
            matmul(
                "geglu_out",
                "token",
                "B/d/e L F/t, M F/t -> B/d/e L M",
                lambda m: 2 * m.d_ff * m.d_model,
                _RERUN,
            ),
            elementwise(
                "ffn_residual", "token", "B/d/e L M/t", lambda m: m.d_model, lambda m: m.d_model
            ),
        ),
        weights=Geglu3Weights,
        forward=geglu3_forward,
        aux=Aux(fields={"gate_sq": ""}, mean=("gate_sq",), metrics=geglu3_metrics),
    )
)


# -- its reference ----------------------------------------------------------------------------

CFG = tiny_model(n_layers=2, ffn="geglu3")
BATCH, LENGTH = 8, 16
TOKENS, STARTS = packed_batch(CFG.vocab, BATCH, LENGTH, seed=3)


def reference_loss(weights, tokens, starts, cfg: ModelConfig = CFG):
    """The mean loss on one device: reference.py's attention, this file's FFN."""
    dt = jnp.dtype(cfg.compute_dtype)
    positions, mask = reference_positions(starts), reference_mask(starts, cfg.attention_mask)
    x = reference_embed(cfg, weights, tokens)
    for i in range(cfg.n_layers):
        w = jax.tree.map(lambda a, i=i: a[i], weights.layers)
        x = reference_attention_half(cfg, w, x, positions, mask)
        nx = reference_norm(x, w.ln2, cfg.norm_eps).astype(dt)
        gate, up_a, up_b = (jnp.einsum("blm,mf->blf", nx, w.g_in[j].astype(dt)) for j in range(3))
        y = jax.nn.gelu(gate) * (up_a + up_b)
        x = (x + jnp.einsum("blf,mf->blm", y, w.g_out.astype(dt))).astype(dt)
    total, count = reference_loss_terms(reference_unembed(cfg, weights, x), tokens, starts)
    return total / jnp.maximum(count, 1.0)


@functools.cache
def _reference():
    weights = random_weights(CFG, seed=1)
    value, grads = jax.jit(jax.value_and_grad(reference_loss))(weights, TOKENS, STARTS)
    return weights, jax.tree.map(np.asarray, (value, grads))


def test_its_weights_are_its_declarations_and_nothing_else():
    fields = [f.name for f in dataclasses.fields(type(weight_structs(CFG).layers))]
    assert fields == ["ln1", "w_q", "w_kv", "w_o", "ln2", "g_in", "g_out"]  # no q_norm, k_norm
    assert weight_structs(CFG).layers.g_in.shape == (2, 3, CFG.d_model, CFG.d_ff)


@pytest.mark.parametrize(
    "sizes", [{"d": 4, "t": 2}, {"d": 2, "c": 2, "t": 2}], ids=["d4t2", "d2c2t2"]
)
@pytest.mark.parametrize("backward", ["explicit", "autodiff"])
def test_sharded_loss_and_gradients_equal_the_reference(sizes, backward):
    weights, (ref_loss, ref_grads) = _reference()
    cfg = dataclasses.replace(CFG, backward=backward)
    mesh = mesh_of_sizes(sizes)
    placed = jax.device_put(weights, jax.tree.map(lambda s: s.sharding, weight_structs(cfg, mesh)))
    fn = jax.jit(jax.value_and_grad(lambda w: loss_fn(w, TOKENS, STARTS, cfg, mesh)))
    loss, grads = jax.tree.map(np.asarray, fn(placed))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for (path, r), g in zip(
        jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads), strict=True
    ):
        worst = np.max(np.abs(g - r)) / max(np.max(np.abs(r)), 1e-30)
        assert worst <= 2e-5, (jax.tree_util.keystr(path), worst)


def test_the_cost_table_counts_its_operations():
    table = step_flops(CFG, batch=2, seq_len=32)
    tokens = 2 * 32 * CFG.n_layers  # 128 token-runs of each layer operation
    m, f = CFG.d_model, CFG.d_ff  # 64, 128 (tiny_model)
    assert table["geglu_in"].forward == tokens * 3 * 2 * m * f  # 6,291,456
    assert table["geglu_in"].backward == 2 * tokens * 3 * 2 * m * f
    assert table["geglu"].forward == tokens * 10 * f
    assert table["geglu_out"].forward == tokens * 2 * f * m
    # remat=saved re-runs the whole block (nothing of it is kept): its matmuls again.
    assert table["geglu_in"].recompute == table["geglu_in"].forward
    names = {op.name for op in table.ops}
    assert {"gate", "up", "down", "swiglu"}.isdisjoint(names)


def test_the_planner_predicts_its_gathers():
    cfg = load_config(
        None,
        [
            *(f"model.{k}={v}" for k, v in dataclasses.asdict(CFG).items() if k != "moe"),
            f"data.vocab_size={CFG.vocab}",
            "mesh.d=4",
            "mesh.t=2",
            "train.batch_size=8",
            "train.seq_len=16",
        ],
    )
    gathers = {
        c.what.split(":")[0]: c
        for c in collectives_per_step(cfg)
        if c.kind == "all-gather" and c.phase == "forward" and c.what.startswith("geglu")
    }
    assert set(gathers) == {"geglu_in", "geglu_out"}
    bf = jnp.dtype(CFG.compute_dtype).itemsize
    # Each layer gathers its 3 x d_model x d_ff/t block over d: 3 * 64 * 64 values.
    assert gathers["geglu_in"].result_bytes == 3 * CFG.d_model * CFG.d_ff // 2 * bf
    assert gathers["geglu_in"].calls == CFG.n_layers


def test_the_optimizer_decays_its_matrices_not_its_gain():
    mask = decay_mask(weight_structs(CFG))
    assert mask.layers.g_in is True and mask.layers.g_out is True
    assert mask.layers.ln2 is False and mask.layers.ln1 is False


def test_it_trains_pipelined_and_logs_its_metric():
    overrides = [
        *(f"model.{k}={v}" for k, v in dataclasses.asdict(CFG).items() if k != "moe"),
        "model.compute_dtype=float32",
        f"data.vocab_size={CFG.vocab}",
        "mesh.p=2",
        "mesh.d=2",
        "mesh.t=2",
        "train.batch_size=8",
        "train.seq_len=16",
        "train.microbatches=2",
        "train.lr=3e-3",
        "train.warmup_steps=0",
    ]
    cfg = load_config(None, overrides)
    mesh = mesh_of_sizes(cfg.mesh.sizes())
    opt = make_optimizer(cfg.train)
    state = init_train_state(cfg.model, mesh, opt, jax.random.key(0))
    step = make_train_step(cfg, mesh, opt)
    batch = token_batch(TOKENS, STARTS)
    losses = []
    for _ in range(4):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0], losses
    assert {"geglu_gate_sq/0", "geglu_gate_sq/1"} <= set(metrics)
    assert all(np.isfinite(float(metrics[k])) for k in ("geglu_gate_sq/0", "geglu_gate_sq/1"))
