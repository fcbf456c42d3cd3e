"""Tests of seqshard/model/backward.py: the hand-written backward pass (model.backward=explicit).

    layer       one layer's backward equals jax.vjp of its forward (layers.layer_forward, mesh 2x4), and
                what the forward keeps under remat='saved' is exactly what _layer marks with
                save_for_backward
    model       jax.grad of loss_fn equals the gradient of reference_loss_fn on meshes 1x1,
                8x1, 4x2, 2x4, 1x8 (remat saved), under remat full and none (2x4), and with
                xla attention (its own VJP); it equals autodiff's (f32 tightly, bf16 loosely);
                not differentiated, the explicit loss is the forward pass itself
    step        gradient accumulation (train.microbatches=2): explicit equals autodiff
    training    20 steps of seqshard.train.loop.train with model.backward=explicit track the
                autodiff run's losses
    compiled    the explicit loss-and-gradient and train step hold no more collectives of
                each kind, in each place, than autodiff's, and no more temp memory
    config      model.backward is a checked choice

The model is the tests' tiny one (tests/model_weights.py: n_kv=8, n_q_per_kv=2, f32, einsum
attention), on a batch of 8 x 16 packed documents of uneven lengths (row 0 starting
mid-document). The default run takes about a minute on 2 idle cores; ``-m slow`` (about two
more) adds: explicit vs autodiff directly, bf16, the 20-step training runs, the compiled train
step's collectives, the full and none policies' compiled collectives and memory, and splash
attention.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_weights import packed_batch, random_weights, tiny_model

from seqshard.batch import token_batch
from seqshard.config import Config, ConfigError, DataConfig, MeshConfig, TrainConfig, load_config
from seqshard.model import (
    ModelConfig,
    block,
    loss_fn,
    reference_loss_fn,
    weight_structs,
)
from seqshard.model import backward as bw
from seqshard.model.block import Activations
from seqshard.model.config import Backward
from seqshard.model.context import sequence_rows
from seqshard.model.layers import layer_forward, layer_inputs, stacks
from seqshard.shardlib.comms import collectives
from seqshard.shardlib.shapecheck import shape_scope
from seqshard.shardlib.shardtypes import bool_, f32, typed_shard_map
from seqshard.testing import fake_cpu_mesh
from seqshard.train.loop import train
from seqshard.train.metrics import read_metrics
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import train_state_structs
from seqshard.train.step import grads_and_loss, make_train_step

CFG = tiny_model(backward="explicit")
AUTODIFF = dataclasses.replace(CFG, backward="autodiff")
MESHES = [(1, 1), (8, 1), (4, 2), (2, 4), (1, 8)]
BATCH, LENGTH = 8, 16
TOKENS, IS_SEQ_START = packed_batch(CFG.vocab, BATCH, LENGTH, seed=0)
WEIGHTS = random_weights(CFG, seed=0)
QK_NORM = dataclasses.replace(CFG, qk_norm=True)  # Qwen3's per-head q and k norms
QK_WEIGHTS = random_weights(QK_NORM, seed=0)  # the gains too: 1 + N(0, 0.25)


def weights_of(cfg: ModelConfig):
    return QK_WEIGHTS if cfg.qk_norm else WEIGHTS


# f32. The explicit backward sums in another order than the single-device reference (partial
# sums over t and d, reduce-scatters), as autodiff of the sharded model does. Measured on the
# five meshes and three policies: loss within 4.8e-7 of 4.87; gradients within 1.53e-6 of
# each leaf's largest entry (1x8; 1.16e-6 to 1.25e-6 elsewhere), autodiff's own error being
# the same (1.15e-6 to 1.45e-6). Against autodiff of the same sharded model: identical
# losses, gradients within 4.8e-7.
LOSS_RTOL = 1e-6
GRAD_TOL = 5e-6  # max |g - ref| <= GRAD_TOL * max |ref|, per leaf


def assert_grads_close(grads, ref, tol: float) -> float:
    """Each leaf within ``tol`` of the reference leaf's largest entry; returns the worst ratio."""
    worst = 0.0
    for (path, r), g in zip(
        jax.tree_util.tree_leaves_with_path(ref), jax.tree.leaves(grads), strict=True
    ):
        r, g = np.asarray(r), np.asarray(g)
        assert g.shape == r.shape and g.dtype == r.dtype, jax.tree_util.keystr(path)
        if not r.size:  # a weight the config has not (q_norm, k_norm without model.qk_norm)
            continue
        err = float(np.max(np.abs(g - r)) / np.max(np.abs(r)))
        assert err <= tol, f"{jax.tree_util.keystr(path)}: {err:.2e} of its largest entry"
        worst = max(worst, err)
    return worst


@functools.cache
def mesh_of(shape: tuple[int, int]) -> jax.sharding.Mesh:
    return fake_cpu_mesh(shape, ("d", "t"))


@functools.cache
def sharded_loss_and_grads(cfg: ModelConfig, shape: tuple[int, int]):
    """(loss, grads) of loss_fn on a d x t mesh, numpy."""
    mesh = mesh_of(shape)
    fn = jax.jit(jax.value_and_grad(lambda w, t, s: loss_fn(w, t, s, cfg, mesh)))
    return jax.tree.map(np.asarray, fn(weights_of(cfg), TOKENS, IS_SEQ_START))


@functools.cache
def reference_loss_and_grads(cfg: ModelConfig):
    fn = jax.jit(jax.value_and_grad(reference_loss_fn), static_argnums=3)
    return jax.tree.map(np.asarray, fn(weights_of(cfg), TOKENS, IS_SEQ_START, cfg))


# ---------------------------------------------------------------------------------------------
# One layer

# The layer-level tests declare the residual 'B/d/e L M/t' in their types; the default 'B/d/e L/t M'
# (model.residual=L/t) is checked through the whole model below.
LAYER_CFG = dataclasses.replace(CFG, residual="M/t")
(STACK,) = stacks(LAYER_CFG)  # the dense layers: attention, SwiGLU
BLOCKS = STACK.blocks
Layer = STACK.layer_type

LayerOut = tuple[
    f32[b"B/d/e L@zigzag/c M/t"], f32[b"B/d/e L@zigzag/c M/t"], Layer
]  # output, dL/dx, dL/dweights
Marked = tuple[  # what _layer marks with save_for_backward: q, k, v, attn, h, gate, up
    f32[b"B/d/e L@zigzag/c Q K/t D"],
    f32[b"B/d/e L@zigzag/c K/t D"],
    f32[b"B/d/e L@zigzag/c K/t D"],
    f32[b"B/d/e L@zigzag/c Q K/t D"],
    f32[b"B/d/e L@zigzag/c M/t"],
    f32[b"B/d/e L@zigzag/c F/t"],
    f32[b"B/d/e L@zigzag/c F/t"],
]


def test_layer_backward_equals_vjp_of_the_layer():
    """layer_backward from the kept activations == jax.vjp of the layer's forward, on 2x4 (each
    in its own shard_map). Measured: the outputs identical; dL/dx and the weight gradients
    within 3.2e-7 of their largest entries."""
    mesh = mesh_of((2, 4))
    layer_w = jax.tree.map(lambda a: a[0], WEIGHTS.layers)
    rng = np.random.default_rng(1)
    x, d_out = rng.standard_normal((2, BATCH, LENGTH, LAYER_CFG.d_model), np.float32)

    @functools.partial(typed_shard_map, mesh=mesh)
    def by_autodiff(
        w: Layer,
        x: f32[b"B/d/e L@zigzag/c M/t"],
        d_out: f32[b"B/d/e L@zigzag/c M/t"],
        is_seq_start: bool_[b"B/d/e L/c"],
    ) -> LayerOut:
        rows = sequence_rows(jnp.zeros(is_seq_start.shape, jnp.int32), is_seq_start)
        inputs = layer_inputs(LAYER_CFG, rows)

        def layer(x, w):
            a = Activations(BLOCKS, {"x": x}, mark=True)
            return layer_forward(LAYER_CFG, BLOCKS, inputs, w, a)[0]

        out, pullback = jax.vjp(layer, x, w)
        return (out, *pullback(d_out))

    @functools.partial(typed_shard_map, mesh=mesh)
    def by_hand(
        w: Layer,
        x: f32[b"B/d/e L@zigzag/c M/t"],
        d_out: f32[b"B/d/e L@zigzag/c M/t"],
        is_seq_start: bool_[b"B/d/e L/c"],
    ) -> LayerOut:
        rows = sequence_rows(jnp.zeros(is_seq_start.shape, jnp.int32), is_seq_start)
        inputs = layer_inputs(LAYER_CFG, rows)
        a = Activations(BLOCKS, {"x": x}, explicit=True)
        out, _ = layer_forward(LAYER_CFG, BLOCKS, inputs, w, a)
        kept = {name: a[name] for name in bw.kept_activations(LAYER_CFG, BLOCKS)}
        with shape_scope():  # as in the model: the backward is traced in a scope of its own
            rebuilt, pullbacks = bw.layer_activations(LAYER_CFG, BLOCKS, inputs, w, kept)
            d_x, d_w = bw.layer_backward(
                LAYER_CFG, BLOCKS, inputs, w, rebuilt, pullbacks, d_out, {}
            )
        return out, d_x, d_w

    args = (layer_w, x, d_out, IS_SEQ_START)
    out, d_x, d_w = jax.tree.map(np.asarray, jax.jit(by_hand)(*args))
    ref_out, ref_d_x, ref_d_w = jax.tree.map(np.asarray, jax.jit(by_autodiff)(*args))
    np.testing.assert_array_equal(out, ref_out)
    assert_grads_close((d_x, d_w), (ref_d_x, ref_d_w), GRAD_TOL)


def test_saved_keeps_exactly_what_the_forward_marks(monkeypatch):
    """Under remat='saved' autodiff keeps what the forward marks with save_for_backward, and
    the hand-written backward keeps what the blocks declare ``saved``: the same values, in the
    same order (a declaration the forward did not mark, or a mark it did not declare, fails)."""
    marked = []

    def record(x):
        marked.append(x)
        return x

    monkeypatch.setattr(block, "save_for_backward", record)
    mesh = mesh_of((2, 4))
    layer_w = jax.tree.map(lambda a: a[0], WEIGHTS.layers)
    x = np.random.default_rng(2).standard_normal((BATCH, LENGTH, LAYER_CFG.d_model), np.float32)
    names = bw.kept_activations(LAYER_CFG, BLOCKS)[1:]  # after the input x (c = 1: no ring's lse)

    @functools.partial(typed_shard_map, mesh=mesh)
    def both(
        w: Layer, x: f32[b"B/d/e L@zigzag/c M/t"], is_seq_start: bool_[b"B/d/e L/c"]
    ) -> tuple[Marked, Marked]:
        rows = sequence_rows(jnp.zeros(is_seq_start.shape, jnp.int32), is_seq_start)
        inputs = layer_inputs(LAYER_CFG, rows)
        layer_forward(LAYER_CFG, BLOCKS, inputs, w, Activations(BLOCKS, {"x": x}, mark=True))
        with shape_scope():
            a, _ = bw.layer_activations(LAYER_CFG, BLOCKS, inputs, w, {"x": x})
        return tuple(marked), tuple(a[n] for n in names)

    from_marks, kept = jax.jit(both)(layer_w, x, IS_SEQ_START)
    assert len(marked) == len(names) == 7, (len(marked), names)
    for name, m, k in zip(names, from_marks, kept, strict=True):
        np.testing.assert_array_equal(np.asarray(k), np.asarray(m), err_msg=name)


# ---------------------------------------------------------------------------------------------
# The model: jax.grad through the custom VJP


CASES = [("saved", shape) for shape in MESHES] + [("full", (2, 4)), ("none", (2, 4))]
SLOW_CASES = {("saved", (4, 2)), ("saved", (1, 8))}  # 2x4 splits both, 8x1 d alone


@pytest.mark.parametrize(
    "remat, shape",
    [pytest.param(*c, marks=pytest.mark.slow) if c in SLOW_CASES else c for c in CASES],
    ids=[f"{r}-{d}x{t}" for r, (d, t) in CASES],
)
def test_explicit_gradients_equal_the_reference(remat, shape):
    cfg = dataclasses.replace(CFG, remat=remat)
    loss, grads = sharded_loss_and_grads(cfg, shape)
    ref_loss, ref_grads = reference_loss_and_grads(AUTODIFF)
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads, GRAD_TOL)


@pytest.mark.parametrize("shape", [(2, 4), (4, 2)], ids=["2x4", "4x2"])
def test_explicit_gradients_with_the_residual_split_over_d_model(shape):
    """model.residual=M/t: the norms' backward before the gather's transpose."""
    loss, grads = sharded_loss_and_grads(dataclasses.replace(CFG, residual="M/t"), shape)
    ref_loss, ref_grads = reference_loss_and_grads(AUTODIFF)
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads, GRAD_TOL)


QK_CASES = [
    ("explicit", "saved", (2, 4)),
    ("explicit", "saved", (4, 2)),
    ("explicit", "full", (2, 4)),
    ("explicit", "none", (2, 4)),
    ("autodiff", "saved", (2, 4)),
]
QK_SLOW = {("explicit", "saved", (4, 2)), ("explicit", "none", (2, 4))}  # -m slow


@pytest.mark.parametrize(
    "backward, remat, shape",
    [pytest.param(*c, marks=pytest.mark.slow) if c in QK_SLOW else c for c in QK_CASES],
    ids=[f"{b}-{r}-{d}x{t}" for b, r, (d, t) in QK_CASES],
)
def test_qk_norm_gradients_equal_the_reference(backward, remat, shape):
    """model.qk_norm: the loss and every gradient, the gains q_norm and k_norm among them
    (their all-reduce over t and d), equal the reference's, to the f32 tolerances above."""
    cfg = dataclasses.replace(QK_NORM, backward=backward, remat=remat)
    loss, grads = sharded_loss_and_grads(cfg, shape)
    ref_loss, ref_grads = reference_loss_and_grads(
        dataclasses.replace(QK_NORM, backward="autodiff")
    )
    assert ref_grads.layers.q_norm.shape == (CFG.n_layers, CFG.d_head)
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads, GRAD_TOL)


def test_qk_norm_explicit_equals_autodiff():
    """The hand-written qk-norm backward against autodiff of the same sharded model, on 2x4:
    the same loss, gradients within 2e-6 of each leaf's largest entry."""
    loss, grads = sharded_loss_and_grads(QK_NORM, (2, 4))
    ref_loss, ref_grads = sharded_loss_and_grads(
        dataclasses.replace(QK_NORM, backward="autodiff"), (2, 4)
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-7)
    assert_grads_close(grads, ref_grads, 2e-6)


@pytest.mark.slow
def test_explicit_equals_autodiff():
    """The same sharded model's two backward passes, on 2x4: the loss of the forward kept for
    differentiation is the forward's (measured: identical), the gradients equal to f32
    rounding (measured: within 4.8e-7 of each leaf's largest entry)."""
    loss, grads = sharded_loss_and_grads(CFG, (2, 4))
    ref_loss, ref_grads = sharded_loss_and_grads(AUTODIFF, (2, 4))
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-7)
    assert_grads_close(grads, ref_grads, 2e-6)


def test_undifferentiated_loss_is_the_forward_pass():
    """Without jax.grad (eval) the custom VJP's value is transformer.py's forward: bit for bit."""
    mesh = mesh_of((2, 4))
    values = [
        np.asarray(
            jax.jit(functools.partial(loss_fn, cfg=c, mesh=mesh))(WEIGHTS, TOKENS, IS_SEQ_START)
        )
        for c in (CFG, AUTODIFF)
    ]
    np.testing.assert_array_equal(values[0], values[1])


def test_fused_attention_backward_is_its_own_vjp():
    """attention_impl='xla' (jax.nn.dot_product_attention): the core's backward is the
    implementation's jax.vjp, the rest hand-written; on 2x4, against the reference. Measured:
    within 1.2e-6 of each leaf's largest entry."""
    cfg = dataclasses.replace(CFG, attention_impl="xla")
    loss, grads = sharded_loss_and_grads(cfg, (2, 4))
    ref_loss, ref_grads = reference_loss_and_grads(AUTODIFF)
    np.testing.assert_allclose(loss, ref_loss, rtol=LOSS_RTOL)
    assert_grads_close(grads, ref_grads, GRAD_TOL)


@pytest.mark.slow
def test_bf16_gradients_equal_autodiff_loosely():
    """bf16 matmul inputs: the two backward passes round differently (e.g. the softmax's
    gradient is cast to bf16 before its matmuls here). Gradients measured on 2x4 within 1.25%
    of each leaf's largest entry (each within 2.5% and 3.1% of the f32 reference, autodiff's
    the larger). The losses are the same math, but XLA may keep f32 where the program casts to
    bf16 (its allow_excess_precision), and each program fuses differently: identical with the
    residual 'B/d/e L M/t', 1.8e-4 apart with 'B/d/e L/t M' (the default), within bf16 rounding."""
    cfg = dataclasses.replace(CFG, compute_dtype="bfloat16")
    loss, grads = sharded_loss_and_grads(cfg, (2, 4))
    ref_loss, ref_grads = sharded_loss_and_grads(
        dataclasses.replace(cfg, backward="autodiff"), (2, 4)
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-3)
    assert_grads_close(grads, ref_grads, 0.04)


@pytest.mark.slow
def test_splash_attention_backward_is_its_own_vjp():
    """Splash (Pallas, interpret mode on CPU: slow) hosts its kernel in a custom VJP of its own;
    the explicit backward calls it through jax.vjp. On 2x2, L=128, against autodiff."""
    cfg = dataclasses.replace(CFG, attention_impl="splash", n_kv=2)
    mesh = mesh_of((2, 2))
    tokens, starts = packed_batch(cfg.vocab, 4, 128, seed=0)
    weights = random_weights(cfg, seed=0)
    out = {}
    for c in (cfg, dataclasses.replace(cfg, backward="autodiff")):
        fn = jax.jit(jax.value_and_grad(lambda w, t, s, c=c: loss_fn(w, t, s, c, mesh)))
        out[c.backward] = jax.tree.map(np.asarray, fn(weights, tokens, starts))
    np.testing.assert_allclose(out["explicit"][0], out["autodiff"][0], rtol=LOSS_RTOL)
    assert_grads_close(out["explicit"][1], out["autodiff"][1], GRAD_TOL)


# ---------------------------------------------------------------------------------------------
# The train step: gradient accumulation


def step_config(backward: str, microbatches: int = 2) -> Config:
    return Config(
        model=dataclasses.replace(CFG, backward=backward),
        mesh=MeshConfig(d=2, t=4),
        data=DataConfig(vocab_size=CFG.vocab),
        train=TrainConfig(
            batch_size=BATCH, seq_len=LENGTH, microbatches=microbatches, warmup_steps=0
        ),
    )


def test_gradient_accumulation_equals_autodiff():
    """grads_and_loss over 2 microbatches (rows of uneven document lengths, so the two count
    different numbers of positions), explicit vs autodiff on 2x4. Measured: equal losses and
    counts, gradients within 6.9e-7 of each leaf's largest entry."""
    mesh = mesh_of((2, 4))
    batch = token_batch(TOKENS, IS_SEQ_START)
    counted = [int((~IS_SEQ_START[m::2, 1:]).sum()) for m in range(2)]
    assert counted[0] != counted[1]
    fn = jax.jit(grads_and_loss, static_argnums=(2, 3))
    out = {b: fn(WEIGHTS, batch, step_config(b), mesh) for b in ("explicit", "autodiff")}
    (grads, loss, count), (ref_grads, ref_loss, ref_count) = (
        jax.tree.map(np.asarray, out[b][:3]) for b in ("explicit", "autodiff")
    )
    assert count == ref_count == sum(counted)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-7)
    assert_grads_close(grads, ref_grads, 2e-6)


@pytest.mark.slow
def test_training_tracks_autodiff(tmp_path, tiny_overrides):
    """20 steps of `seqshard train` (in process: seqshard.train.loop.train) of the tests' tiny
    run on 4x2, model.backward=explicit against autodiff: the same losses step by step
    (measured: within 4.8e-7), the same validation loss (eval is the forward: identical)."""
    records = {}
    for backward in ("autodiff", "explicit"):
        overrides = tiny_overrides(tmp_path, backward, steps=20, eval_every=20)
        result = train(
            load_config(None, [*overrides, f"model.backward={backward}"]),
            log=lambda _: None,
            tty=False,
        )
        assert result.step == 20
        records[backward] = {r["step"]: r for r in read_metrics(tmp_path / backward)}
    autodiff, explicit = records["autodiff"], records["explicit"]
    assert sorted(explicit) == sorted(autodiff) == list(range(1, 21))
    losses = np.array([[explicit[s]["loss"], autodiff[s]["loss"]] for s in range(1, 21)])
    np.testing.assert_allclose(losses[:, 0], losses[:, 1], rtol=0, atol=1e-5)
    assert losses[-1, 0] < losses[0, 0] - 1.0  # it trains
    assert explicit[20]["val_loss"] == autodiff[20]["val_loss"]


# ---------------------------------------------------------------------------------------------
# Compiled: collectives and temporary memory


@functools.cache
def compiled_loss_and_grad(cfg: ModelConfig, shape: tuple[int, int], batch: int, length: int):
    mesh = mesh_of(shape)
    fn = jax.jit(jax.value_and_grad(lambda w, t, s: loss_fn(w, t, s, cfg, mesh)))
    tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    starts = jax.ShapeDtypeStruct((batch, length), jnp.bool_)
    return fn.lower(weight_structs(cfg, mesh), tokens, starts).compile()


def places(compiled, mesh) -> collections.Counter:
    """Collectives of a compiled program by (kind, phase, in the layer loop, mesh axes); the
    explicit backward's recomputation is named as remat's, so its phase is 'recompute' too."""
    return collections.Counter(
        (c.kind, c.phase, c.in_loop, c.axes) for c in collectives(compiled.as_text(), mesh)
    )


def assert_no_more_collectives(explicit, autodiff) -> None:
    """Per kind, and per (kind, phase, place, axes): explicit's count <= autodiff's."""
    by_kind = collections.Counter()
    for (kind, *_), n in explicit.items():
        by_kind[kind] += n
    ref_by_kind = collections.Counter()
    for (kind, *_), n in autodiff.items():
        ref_by_kind[kind] += n
    assert all(n <= ref_by_kind[k] for k, n in by_kind.items()), (by_kind, ref_by_kind)
    assert all(n <= autodiff[key] for key, n in explicit.items()), (explicit, autodiff)


# Temp memory depends on XLA:CPU's scheduling and heap packing as much as on what is kept, so
# it is compared where activations dominate: the tiny model on 16 rows of the main job's 128
# tokens, mesh 2x4. Measured (explicit / autodiff temp_size_in_bytes, attention probabilities
# 'B/d/e K/t Q Qlen Klen' in both): saved 0.787, full 0.764, none 0.817. At 64 tokens saved is
# 1.003 and full 1.071, at 32 tokens 1.029 and 1.114 (none 0.78-0.81 throughout): where the
# activations are smaller than the weights' and heap's share, XLA packs the hand-written
# backward's working set slightly worse. On the benchmark's model (scripts/bench_step.py,
# 32 x 128 tokens) explicit is 10-15% smaller on every mesh.
MEMORY_BATCH, MEMORY_LENGTH = 16, 128


@pytest.mark.parametrize(
    "remat",
    [
        "saved",
        pytest.param("full", marks=pytest.mark.slow),
        pytest.param("none", marks=pytest.mark.slow),
    ],
)
def test_compiled_collectives_and_memory_are_no_more_than_autodiffs(remat):
    """value_and_grad(loss_fn) on 2x4: per kind of collective and per (kind, phase, place,
    axes), no more than autodiff (measured: exactly autodiff's, phase by phase: saved AG 27,
    RS 17, AR 3; full AG 27, RS 18, AR 3; none AG 17, RS 17, AR 3), and no more temp memory."""
    cfg = dataclasses.replace(CFG, remat=remat)
    shape, mesh = (2, 4), mesh_of((2, 4))
    explicit = compiled_loss_and_grad(cfg, shape, MEMORY_BATCH, MEMORY_LENGTH)
    autodiff = compiled_loss_and_grad(
        dataclasses.replace(cfg, backward="autodiff"), shape, MEMORY_BATCH, MEMORY_LENGTH
    )
    assert_no_more_collectives(places(explicit, mesh), places(autodiff, mesh))
    temp = explicit.memory_analysis().temp_size_in_bytes
    ref_temp = autodiff.memory_analysis().temp_size_in_bytes
    assert temp <= ref_temp, f"explicit {temp} B > autodiff {ref_temp} B"


@pytest.mark.slow
def test_compiled_train_step_has_no_more_collectives():
    """The whole jitted train step (2 microbatches, optimizer update) on 2x4 (measured:
    exactly autodiff's collectives)."""
    mesh = mesh_of((2, 4))
    counts = {}
    for backward in ("explicit", "autodiff"):
        cfg = step_config(backward)
        opt = make_optimizer(cfg.train)
        step = make_train_step(cfg, mesh, opt)
        state = train_state_structs(cfg.model, mesh, opt)
        batch = jax.eval_shape(lambda: token_batch(TOKENS, IS_SEQ_START))
        compiled = step.lower(state, batch).compile()
        counts[backward] = places(compiled, mesh)
    assert_no_more_collectives(counts["explicit"], counts["autodiff"])


# ---------------------------------------------------------------------------------------------
# Config


def test_backward_is_a_checked_choice():
    assert typing.get_args(Backward) == ("autodiff", "explicit")
    assert ModelConfig().backward == "explicit"
    with pytest.raises(ValueError, match=r"model\.backward must be one of .*'explicit'.*'manual'"):
        ModelConfig(backward="manual")
    assert load_config(None, ["model.backward=explicit"]).model.backward == "explicit"
    with pytest.raises(ConfigError, match=r"model\.backward"):
        load_config(None, ["model.backward=manual"])
