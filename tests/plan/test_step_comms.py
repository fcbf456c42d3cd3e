"""seqshard.plan.step_comms: a training step's collectives predicted from the notation (nothing
compiled) equal the collectives of the step XLA compiles (seqshard.shardlib.comms), kind by kind.

Compared per (phase, inside a loop or not, kind, mesh axes, per-device result shape): calls
per step, hence bytes. f32 compute: XLA's CPU backend runs bf16 collectives in f32.

What XLA adds, merges or drops, named:
* adds: the optimizer's global gradient norm (optax.tree.norm in train/step.py, plain jit, no
  shardops): each weight's sum of squares all-reduced over the axes it is split over. XLA's
  all-reduce combiner merges them into one tuple-shaped all-reduce of f32 scalars per group
  of axes, in the 'update' phase. Not predicted; checked to be exactly that.
* hoists (modelled by step_comms): with microbatches, the gathers of the embedding,
  unembedding and final norm out of the accumulation loop.
* drops (modelled by recomputed()): what remat would recompute but nothing reads (the FFN
  output's reduce-scatter under 'full').
* merges (modelled by step_comms._as_compiled): in a stack of one layer, a loop XLA inlines,
  what the backward re-runs on the forward's own values (CSE), and the routing statistics'
  re-run psum with the forward's (one call of two arrays).
"""

from __future__ import annotations

import collections
import math
from pathlib import Path

import pytest
from model_weights import TINY

from seqshard.batch import batch_structs
from seqshard.config import load_config
from seqshard.mesh import training_mesh
from seqshard.plan.step_comms import collectives_per_step, format_planned_table, logged_step
from seqshard.shardlib.collective_order import unordered_after_loops
from seqshard.shardlib.comms import collectives
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import train_state_structs
from seqshard.train.step import make_train_step


def _config(
    mesh: str,
    backward: str,
    remat: str,
    microbatches: int,
    residual: str = "M/t",
    extra: tuple[str, ...] = (),
):
    """``mesh`` is d x t, or e x d x t."""
    *e, d, t = mesh.split("x")
    return load_config(
        None,
        [
            *(f"model.{k}={v}" for k, v in TINY.items()),
            f"mesh.e={e[0] if e else 1}",
            f"mesh.d={d}",
            f"mesh.t={t}",
            f"model.backward={backward}",
            f"model.remat={remat}",
            f"model.residual={residual}",
            "data.vocab_size=64",
            "train.batch_size=8",
            "train.seq_len=32",
            f"train.microbatches={microbatches}",
            *extra,
        ],
    )


# Four layers, the first two dense (two stacks of two: XLA inlines a loop of one trip and
# then merges its recomputed gathers with the forward's), every balancing term on.
MOE = (
    "model.n_layers=4",
    "model.moe.n_experts=4",
    "model.moe.top_k=2",
    "model.moe.d_ff=32",
    "model.moe.n_shared=1",
    "model.moe.n_dense_layers=2",
    "model.moe.balance=bias",
    "model.moe.z_loss_weight=1e-3",
)


def _elements(shape) -> int:
    if shape and isinstance(shape[0], tuple):
        return sum(math.prod(s) for s in shape)
    return math.prod(shape)


def _key(kind: str, shape):
    """An all-to-all by its elements: XLA splits one over an axis of size n into a tuple
    all-to-all of the n blocks (the same bytes); other kinds by their result shape."""
    return ("elements", _elements(shape)) if kind == "all-to-all" else shape


def _predicted(cfg) -> collections.Counter:
    out = collections.Counter()
    for c in collectives_per_step(cfg):
        shape = c.result_shape if c.arrays == 1 else (c.result_shape,) * c.arrays
        out[(c.phase, c.in_loop, c.kind, c.axis_key, _key(c.kind, shape))] += c.calls
    return out


def _compiled(cfg):
    mesh = training_mesh(cfg.mesh.sizes())
    opt = make_optimizer(cfg.train, cfg.model, mesh)
    step = make_train_step(cfg, mesh, opt).lower(
        train_state_structs(cfg.model, mesh, opt),
        batch_structs(cfg.train.batch_size, cfg.train.seq_len, mesh),
    )
    text = step.compile().as_text()
    assert unordered_after_loops(text) == []  # one order of collectives on every device
    return collectives(text, mesh)


def _scalars_pooled(calls: collections.Counter) -> collections.Counter:
    """``calls`` with the scalar all-reduces counted by their scalars per (loop, axes): model.fp8's
    amaxes, which XLA's all-reduce combiner groups into tuples as it likes, a tuple taking
    one member's phase (the count of scalars is what the program moves)."""
    out = collections.Counter()
    for (phase, in_loop, kind, axes, shape), n in calls.items():
        if kind == "all-reduce" and isinstance(shape, tuple) and all(s == () for s in shape):
            out[("scalars", in_loop, kind, axes)] += n * max(len(shape), 1)
        else:
            out[(phase, in_loop, kind, axes, shape)] += n
    return out


def _update_pooled(calls: collections.Counter) -> collections.Counter:
    """``calls`` with the optimizer's all-reduces (Muon's Gram and norm sums of far-wide
    matrices: independent of each other across weights) counted by their elements per axes:
    XLA's combiner merges independent ones into tuples as it likes."""
    out = collections.Counter()
    for (phase, in_loop, kind, axes, shape), n in calls.items():
        if phase == "update" and kind == "all-reduce":
            shapes = shape if shape and isinstance(shape[0], tuple) else (shape,)
            out[(phase, in_loop, kind, axes, "elements")] += n * _elements(shapes)
        else:
            out[(phase, in_loop, kind, axes, shape)] += n
    return out


def _check(cfg) -> None:
    predicted = _predicted(cfg)
    compiled = collections.Counter()
    update = []
    for c in _compiled(cfg):
        if c.phase == "update" and c.kind == "all-reduce" and set(c.result_shapes) == {()}:
            update.append(c)  # the global norm's (below)
            continue
        shape = c.result_shapes[0] if len(c.result_shapes) == 1 else tuple(c.result_shapes)
        key = (c.phase, c.in_loop, c.kind, "/".join(c.axes), _key(c.kind, shape))
        compiled[key] += c.calls_per_step
    if cfg.model.fp8 != "none":
        predicted, compiled = _scalars_pooled(predicted), _scalars_pooled(compiled)
    if cfg.train.optimizer == "muon":
        predicted, compiled = _update_pooled(predicted), _update_pooled(compiled)
    assert predicted == compiled, (predicted - compiled, compiled - predicted)
    # XLA's addition: the global norm's scalar all-reduces, combined, once per step.
    assert update and all(
        c.kind == "all-reduce" and c.calls_per_step == 1 and set(c.result_shapes) == {()}
        for c in update
    ), update
    assert any(phase == "update" for phase, *_ in predicted) == (cfg.train.optimizer == "muon")


CASES = [
    ("2x4", "autodiff", "saved", 1),
    ("4x2", "explicit", "full", 2),
]
MORE = [
    ("2x4", "explicit", "saved", 1),
    ("4x2", "autodiff", "full", 2),
    ("4x2", "autodiff", "none", 1),
    ("4x2", "explicit", "none", 1),
    ("2x4", "autodiff", "full", 2),
    ("2x4", "explicit", "saved", 2),
    ("8x1", "explicit", "saved", 1),
    ("1x8", "autodiff", "saved", 1),
]


@pytest.mark.parametrize("mesh,backward,remat,microbatches", CASES)
def test_predicted_collectives_are_the_compiled_ones(mesh, backward, remat, microbatches):
    _check(_config(mesh, backward, remat, microbatches))


@pytest.mark.parametrize(
    "mesh,extra",
    [
        ("2x4", ()),  # 2 layers over d x t = 8: stacks padded with zero matrices
        pytest.param("2x2x2", MOE, marks=pytest.mark.slow),  # experts' stacks split over e
        # FFN matrices 32 x 2048 over t = 8: far wider than tall, their Grams all-reduced
        pytest.param("1x8", ("model.d_ff=2048",), marks=pytest.mark.slow),
    ],
)
def test_predicted_collectives_with_muon(mesh, extra):
    """train.optimizer=muon: the optimizer's all_to_alls (phase update) as predicted, beside
    the step's own."""
    _check(_config(mesh, "explicit", "saved", 1, extra=("train.optimizer=muon", *extra)))


FP8 = [
    ("2x4", "autodiff", "saved", 1, "M/t"),
    pytest.param("4x2", "explicit", "full", 2, "M/t", marks=pytest.mark.slow),
    pytest.param("2x4", "explicit", "saved", 1, "L/t", marks=pytest.mark.slow),
    pytest.param("4x2", "autodiff", "full", 2, "L/t", marks=pytest.mark.slow),
    pytest.param("4x2", "autodiff", "none", 1, "M/t", marks=pytest.mark.slow),
    pytest.param("2x4", "explicit", "none", 1, "L/t", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("mesh,backward,remat,microbatches,residual", FP8)
def test_predicted_collectives_with_fp8(mesh, backward, remat, microbatches, residual):
    """model.fp8=current: each amax's pmax (the weights' re-run wherever their gathers are,
    the cotangents' in the backward), the weights gathered as e4m3 bits."""
    cfg = _config(mesh, backward, remat, microbatches, residual, extra=("model.fp8=current",))
    _check(cfg)
    gathers = [c for c in collectives_per_step(cfg) if c.weights and c.kind == "all-gather"]
    matrices = {c.dtype for c in gathers if c.in_layers and len(c.result_shape) > 1}
    assert matrices == {"float8_e4m3fn"}  # the norms' gains stay f32


@pytest.mark.parametrize("backward", ["autodiff", "explicit"])
def test_predicted_collectives_with_the_sequence_split_residual(backward):
    """model.residual=L/t: the residual gathered and scattered along L instead of M."""
    cfg = _config("2x4", backward, "saved", 1, residual="L/t")
    _check(cfg)
    gathers = {c.what for c in collectives_per_step(cfg) if c.kind == "all-gather"}
    assert "attn_norm: all_gather('B/dp L@zigzag/c/t M -> B/dp L@zigzag/c M')" in gathers


@pytest.mark.slow
@pytest.mark.parametrize("mesh,backward,remat,microbatches", MORE)
def test_predicted_collectives_on_more_configs(mesh, backward, remat, microbatches):
    _check(_config(mesh, backward, remat, microbatches))


@pytest.mark.parametrize(
    "mesh,backward,remat,microbatches",
    [
        ("2x2x2", "autodiff", "saved", 1),
        pytest.param("2x2x2", "explicit", "full", 2, marks=pytest.mark.slow),
    ],
)
def test_predicted_collectives_with_experts(mesh, backward, remat, microbatches):
    """MoE layers: the exchanges over e (all_to_all) and the router statistics' psum are
    predicted and compiled as written, under autodiff and the hand-written backward (which
    differentiates the MoE FFN by jax.vjp: its transposes logged as the backward's)."""
    cfg = _config(mesh, backward, remat, microbatches, extra=MOE)
    _check(cfg)
    kinds = collections.Counter(c.kind for c in collectives_per_step(cfg) if c.axis_key == "e")
    assert kinds["all-to-all"] > 0, kinds


# MLA (both latents) and two multi-token prediction modules (an MoE layer each) on MOE's
# stacks: the modules' loop, its gathers of the shared tables (XLA's CSE merges them with the
# model's), and under the hand-written backward their jax.vjp re-run.
MLA_MTP = (
    *MOE,
    "model.attention=mla",
    "model.n_q_per_kv=1",
    "model.n_kv=4",
    "model.d_head=12",
    "model.mla.q_lora_rank=16",
    "model.mla.kv_lora_rank=16",
    "model.mla.qk_nope_head_dim=8",
    "model.mla.qk_rope_head_dim=4",
    "model.mla.v_head_dim=6",
    "model.mtp.depth=2",
)


@pytest.mark.parametrize(
    "backward,remat,microbatches,residual",
    [
        # By default tiny-cpu-mla.yaml covers the explicit backward (the shipped configs' test).
        pytest.param("explicit", "saved", 1, "L/t", marks=pytest.mark.slow),
        pytest.param("autodiff", "saved", 1, "M/t", marks=pytest.mark.slow),
        pytest.param("explicit", "full", 2, "M/t", marks=pytest.mark.slow),
    ],
)
def test_predicted_collectives_with_latent_attention_and_multi_token_prediction(
    backward, remat, microbatches, residual
):
    cfg = _config("2x2x2", backward, remat, microbatches, residual, extra=MLA_MTP)
    _check(cfg)
    parts = {c.what.split(":")[0] for c in collectives_per_step(cfg)}
    assert {"kv_a", "kv_b", "eh_proj", "mtp_head"} <= parts, parts


CPU_CONFIGS = sorted((Path(__file__).parents[2] / "configs").glob("*cpu*.yaml"))


@pytest.mark.parametrize("path", CPU_CONFIGS, ids=lambda path: path.stem)
def test_the_shipped_cpu_configs_compile_as_predicted(path):
    """Every shipped CPU config at its defaults, as `seqshard show --chip cpu` compares them
    (issue 42: tiny-cpu-moe's two stacks of one layer each, which XLA inlines and merges)."""
    _check(load_config(path))


# Stacks of one layer, loops XLA inlines: a dense model of one layer, and tiny-cpu-moe's
# shape (a dense layer, then one MoE layer; a later override wins). The hand-written backward's
# MoE cases keep tiny-cpu-moe's residual L/t: with M/t, the MoE FFN's jax.vjp gathers h as the
# forward kept it, merged by XLA, which the log cannot see (step_comms' docstring).
DENSE_ONE_LAYER = ("model.n_layers=1",)
MOE_ONE_LAYER = (*MOE, "model.n_layers=2", "model.moe.n_dense_layers=1")
ONE_LAYER = [
    ("4x2", "autodiff", "saved", 1, "L/t", DENSE_ONE_LAYER),
    ("4x2", "explicit", "full", 2, "M/t", DENSE_ONE_LAYER),
    ("4x2", "autodiff", "saved", 2, "M/t", DENSE_ONE_LAYER),
    ("2x2x2", "autodiff", "full", 1, "M/t", MOE_ONE_LAYER),
    ("2x2x2", "explicit", "none", 1, "L/t", MOE_ONE_LAYER),
    ("2x2x2", "explicit", "saved", 2, "L/t", MOE_ONE_LAYER),
]


@pytest.mark.slow
@pytest.mark.parametrize("mesh,backward,remat,microbatches,residual,extra", ONE_LAYER)
def test_predicted_collectives_of_stacks_of_one_layer(
    mesh, backward, remat, microbatches, residual, extra
):
    """What the backward re-runs on the forward's values is merged with the forward's, the
    routing statistics' psum re-run combined with the forward's, as step_comms predicts."""
    _check(_config(mesh, backward, remat, microbatches, residual, extra))


def test_phases_and_layers():
    """Autodiff: each forward collective has its transpose in the backward pass, the
    layers' weight gathers are recomputed under 'saved'; explicit: backward.py's own."""
    auto = collectives_per_step(_config("2x4", "autodiff", "saved", 1))
    by = collections.Counter((c.phase, c.kind) for c in auto)
    assert by[("forward", "all-gather")] == by[("backward", "reduce-scatter")]
    assert by[("forward", "reduce-scatter")] == by[("backward", "all-gather")]
    recomputed = {c.what for c in auto if c.phase == "recompute"}
    assert "q: all_gather('M/fsdp Q K/t D -> M Q K/t D')" in recomputed
    assert not any("psum_scatter" in w for w in recomputed)  # h is kept; the FFN output unread
    assert all(c.in_layers and c.calls == 2 for c in auto if c.phase == "recompute")
    explicit = _config("2x4", "explicit", "saved", 1)
    logged = logged_step(explicit)
    assert {c.phase for c in logged} == {"forward", "recompute", "backward"}
    # backward.py writes every transfer of the backward pass: no transposes derived
    assert not any(c.autodiff for c in logged if c.phase == "forward")
    table = format_planned_table(collectives_per_step(explicit), n_layers=2)
    assert "backward   per layer  down: psum_scatter('M F/t{U_fsdp} -> M/fsdp F/t')" in table
    assert table.splitlines()[-1].startswith("sent per device per step: forward ")


def test_a_single_device_predicts_nothing():
    assert collectives_per_step(_config("1x1", "autodiff", "saved", 1)) == []
