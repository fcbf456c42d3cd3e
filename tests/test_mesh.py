"""Tests of seqshard.mesh: the mesh axes p d e c t, sizes for any subset, meshes with Auto axes."""

from __future__ import annotations

import dataclasses

import jax
import pytest
from jax.sharding import AxisType

from seqshard import f32, shardops, typed_shard_map
from seqshard.config import ConfigError, MeshConfig, load_config, resolve_mesh
from seqshard.mesh import axis_sizes, mesh_from_devices, mesh_of_sizes, training_mesh


def test_the_config_mesh_section_has_a_size_per_axis():
    """MeshConfig has one field per mesh axis, p d e c t (outermost first), each 1 unless set;
    the sizes come in that order whatever the order given; a config's sizes build a mesh of
    those axes; a name that is no axis is refused."""
    fields = [(f.name, f.default) for f in dataclasses.fields(MeshConfig)]
    assert fields == [("p", 1), ("d", 1), ("e", 1), ("c", 1), ("t", 1)]
    assert MeshConfig() == MeshConfig(p=1, d=1, e=1, c=1, t=1)
    assert load_config(None, []).mesh.sizes() == {"p": 1, "d": 1, "e": 1, "c": 1, "t": 1}
    every = load_config(None, [f"mesh.{axis}=1" for axis in "tcedp"])
    assert list(every.mesh.sizes()) == ["p", "d", "e", "c", "t"]
    cfg = load_config(None, ["mesh.t=2", "mesh.c=2", "model.d_model=64"])
    assert cfg.mesh == MeshConfig(c=2, t=2)
    assert list(cfg.mesh.sizes().items()) == [("p", 1), ("d", 1), ("e", 1), ("c", 2), ("t", 2)]
    mesh = mesh_of_sizes(MeshConfig(**{"t": 2, "d": 2}).sizes())
    assert mesh.axis_names == ("p", "d", "e", "c", "t")
    assert mesh.devices.shape == (1, 2, 1, 1, 2)
    with pytest.raises(ConfigError, match="'x' not in 'MeshConfig'"):
        load_config(None, ["mesh.x=2"])


@pytest.mark.parametrize(
    "given, full",
    [
        ({}, {"p": 1, "d": 1, "e": 1, "c": 1, "t": 1}),
        ({"t": 2}, {"p": 1, "d": 1, "e": 1, "c": 1, "t": 2}),
        ({"d": 4, "t": 2}, {"p": 1, "d": 4, "e": 1, "c": 1, "t": 2}),
        (
            {"t": 2, "c": 2, "d": 4},
            {"p": 1, "d": 4, "e": 1, "c": 2, "t": 2},
        ),  # table order, whatever the given order
    ],
)
def test_missing_axes_have_size_one(given, full):
    assert axis_sizes(given) == full
    assert list(axis_sizes(given)) == ["p", "d", "e", "c", "t"]


def test_unknown_axis_and_bad_sizes_are_errors_that_name_them():
    with pytest.raises(ValueError, match=r"unknown mesh axes \['x'\].*d \(data / FSDP"):
        axis_sizes({"x": 2})
    for bad in (0, -1, 1.5, True):
        with pytest.raises(
            ValueError, match=rf"mesh axis t must have an integer size >= 1, got {bad!r}"
        ):
            axis_sizes({"t": bad})


def test_mesh_of_sizes_has_every_axis_with_auto_types():
    mesh = mesh_of_sizes({"t": 4})
    assert dict(mesh.shape) == {"p": 1, "d": 1, "e": 1, "c": 1, "t": 4}
    assert mesh.axis_types == (AxisType.Auto,) * 5
    assert list(mesh.devices.flat) == jax.devices()[:4]


def test_a_mesh_larger_than_the_devices_says_how_to_get_more():
    with pytest.raises(
        RuntimeError, match=r"needs 16 CPU devices but this process has 8.*XLA_FLAGS"
    ):
        mesh_of_sizes({"d": 8, "t": 2})
    with pytest.raises(RuntimeError, match="needs 2"):
        mesh_from_devices((2,), ("d",), jax.devices()[:1])


def test_config_mesh_sizes_and_description():
    cfg = load_config(None, ["mesh.t=2", "data.vocab_size=64", "model.vocab=64"])
    assert cfg.mesh.sizes() == {"p": 1, "d": 1, "e": 1, "c": 1, "t": 2}
    assert cfg.mesh.n_devices == 2 and cfg.mesh.describe() == "d=1 x c=1 x t=2"
    with pytest.raises(ConfigError, match="mesh sizes must be >= 1, or -1 .*; got mesh.d=0"):
        load_config(None, ["mesh.d=0"])


def test_a_minus_one_size_takes_the_remaining_devices():
    cfg = load_config(None, ["mesh.d=-1", "mesh.t=2", "data.vocab_size=64", "model.vocab=64"])
    assert not cfg.mesh.is_resolved and cfg.mesh.describe() == "d=-1 x c=1 x t=2"
    with pytest.raises(ConfigError, match="resolve it with seqshard.config.resolve_mesh"):
        cfg.mesh.sizes()
    resolved = resolve_mesh(cfg, 8)
    assert (
        resolved.mesh.sizes() == {"p": 1, "d": 4, "e": 1, "c": 1, "t": 2}
        and resolve_mesh(resolved, 8) is resolved
    )
    with pytest.raises(ConfigError, match="7 devices do not divide by c=1 x t=2 = 2"):
        resolve_mesh(cfg, 7)
    # The checks that need the mesh run once it is resolved: batch 32 over d=64 does not split.
    with pytest.raises(ConfigError, match="mesh axis d=64 does not divide"):
        resolve_mesh(cfg, 128)
    with pytest.raises(ConfigError, match="at most one mesh axis may be -1"):
        load_config(None, ["mesh.d=-1", "mesh.t=-1"])


def test_the_training_mesh_must_use_every_device_of_an_accelerator_or_multi_process_run():
    """One CPU process may use a prefix of its fake devices; fake devices standing in for two
    processes (or accelerators) must all be used, and the error names both counts."""
    assert training_mesh({"d": 2, "t": 2}).devices.size == 4  # 4 of this process's 8

    class Device:
        def __init__(self, i, process):
            self.id, self.process_index, self.platform = i, process, "cpu"

    two_hosts = [Device(i, i // 4) for i in range(8)]
    with pytest.raises(
        RuntimeError,
        match=r"mesh d=2 x c=1 x t=2 needs 4 devices, but the run has 8 CPU devices \(2 processes, 4 each\)",
    ):
        training_mesh({"d": 2, "t": 2}, devices=two_hosts)
    # Only d crosses the slower links between hosts: 2 hosts of 3 devices cannot hold d=3.
    with pytest.raises(
        RuntimeError, match="d=3 is not a multiple of 2. Choose mesh.d divisible by 2"
    ):
        training_mesh({"d": 3, "t": 2}, devices=[Device(i, i // 3) for i in range(6)])
    with pytest.raises(RuntimeError, match="needs 16 devices, but the run has 8 CPU devices"):
        training_mesh({"d": 16})


# -- a mesh built by hand -----------------------------------------------------------------------


def test_a_mesh_built_by_hand_behaves_as_if_its_missing_axes_had_size_one():
    """``jax.make_mesh((2, 2), ('d', 't'))`` lacks p and c: init_weights, logits_fn, the train
    step (its loss: loss_fn's) and typed_shard_map run on it as on seqshard's own d=2 x t=2
    mesh (equal values); a mesh axis seqshard does not know is an error naming the known ones."""
    import functools

    import numpy as np
    from model_weights import packed_batch, tiny_model

    from seqshard.batch import TokenBatch
    from seqshard.config import Config, TrainConfig
    from seqshard.model import init_weights, logits_fn
    from seqshard.train.optimizer import make_optimizer
    from seqshard.train.state import init_train_state
    from seqshard.train.step import make_train_step

    auto = (AxisType.Auto,) * 2
    by_hand = jax.make_mesh((2, 2), ("d", "t"), axis_types=auto, devices=jax.devices()[:4])
    ours = mesh_of_sizes({"d": 2, "t": 2})
    cfg = tiny_model()
    tokens, starts = packed_batch(cfg.vocab, 4, 16)
    results = []
    for mesh in (by_hand, ours):
        w = init_weights(cfg, mesh, jax.random.key(0))
        run = Config(model=cfg, mesh=MeshConfig(d=2, t=2), train=TrainConfig(batch_size=4))
        opt = make_optimizer(run.train)
        state = init_train_state(cfg, mesh, opt, jax.random.key(0))
        _, metrics = make_train_step(run, mesh, opt)(
            state, TokenBatch(tokens, starts, np.ones_like(starts))
        )

        @functools.partial(typed_shard_map, mesh=mesh)
        def gathered(x: f32[b"B/d/c M/t"]) -> f32[b"B/d/c M"]:
            return shardops.all_gather("B/d/c M/t -> B/d/c M", x, to="invarying")

        results.append(
            [
                # Jitted: called eagerly, the shard_map runs op by op (about 7 s a call here).
                jax.jit(logits_fn, static_argnums=(3, 4))(w, tokens, starts, cfg, mesh),
                metrics["loss"],
                gathered(np.arange(32, dtype=np.float32).reshape(4, 8)),
            ]
        )
    for a, b in zip(*results, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    unknown = jax.make_mesh((2, 2), ("data", "t"), axis_types=auto, devices=jax.devices()[:4])
    with pytest.raises(ValueError, match=r"unknown mesh axes \['data'\].*p \(pipeline"):
        init_weights(cfg, unknown, jax.random.key(0))
