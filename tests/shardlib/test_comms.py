"""seqshard.shardlib.comms reads the communication of compiled programs: axes, phases, calls, bytes."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from model_weights import tiny_model

from seqshard import f32, typed_shard_map
from seqshard.model import init_weights, loss_fn
from seqshard.shardlib import shardops
from seqshard.shardlib.comms import Collective, collectives, format_comm_table
from seqshard.testing import compiled_hlo, fake_cpu_mesh


@pytest.fixture(scope="module")
def mesh():
    return fake_cpu_mesh((2, 4), ("d", "t"))


@pytest.mark.parametrize(
    "groups, axes",
    [
        ("{{0,1,2,3},{4,5,6,7}}", ("t",)),  # devices d*4 + t: consecutive ids differ in t
        ("{{0,4},{1,5},{2,6},{3,7}}", ("d",)),
        ("{{0,4,1,5,2,6,3,7}}", ("t", "d")),  # d changes fastest: t major, d minor
        ("{{0,1,2,3,4,5,6,7}}", ("d", "t")),
        ("[2,4]<=[8]", ("t",)),  # iota form: reshape 0..7 into 2 groups of 4
        ("[4,2]<=[2,4]T(1,0)", ("d",)),
        ("mesh['axis_0'=8]", ("d", "t")),  # every device
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", ("t",)),  # grouped over one mesh axis
        ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", ("d",)),
        ("mesh['axis_0'=8], device_ids=([2,4]T(1,0)) {'axis_0'}", ("t", "d")),
        ("mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}", ("t",)),
    ],
)
def test_replica_groups_name_mesh_axes(mesh, groups, axes):
    line = f"  %x = f32[4]{{0}} all-reduce(f32[4]{{0}} %p), replica_groups={groups}, to_apply=%add"
    hlo = f"ENTRY %main (p: f32[4]) -> f32[4] {{\n{line}\n}}\n"
    (c,) = collectives(hlo, mesh)
    assert c.axes == axes
    assert c.group_size == int(np.prod([mesh.shape[a] for a in axes]))


def test_bytes_sent_follow_ring_algorithms():
    gather = Collective("all-gather", "f32[8,4]{1,0}", "", group_size=4)
    assert gather.result_bytes == 128 and gather.bytes_sent == 96  # (n-1)/n of the result
    scatter = Collective("reduce-scatter", "bf16[2,4]{1,0}", "", group_size=4)
    assert scatter.bytes_sent == 3 * 16  # (n-1) x the shard
    reduce = Collective("all-reduce", "(f32[], f32[3]{0})", "", group_size=2)
    assert reduce.result_shapes == [(), (3,)] and reduce.bytes_sent == 16


@pytest.mark.slow
def test_model_step_phases_places_and_layer_counts(mesh):
    """The layer body's collectives run once per layer; phases follow the autodiff structure."""
    tokens, starts = np.zeros((8, 16), np.int32), np.zeros((8, 16), bool)
    per_layers = {}
    for n_layers in (2, 3):
        cfg = tiny_model(n_layers=n_layers, n_kv=4, remat="saved")
        w = init_weights(cfg, mesh, jax.random.key(0))
        grad = jax.jit(jax.grad(lambda w, cfg=cfg: loss_fn(w, tokens, starts, cfg, mesh)))
        calls = collectives(compiled_hlo(grad, w), mesh)
        per_layers[n_layers] = calls
        looped = [c for c in calls if c.in_loop]
        assert looped and all(c.calls_per_step == n_layers for c in looped)
        assert all(c.calls_per_step == 1 for c in calls if not c.in_loop)
        # Weight gathers over d happen in the forward pass and again in the recompute.
        fwd = [
            c
            for c in looped
            if c.phase == "forward" and c.kind == "all-gather" and c.axes == ("d",)
        ]
        rec = [
            c
            for c in looped
            if c.phase == "recompute" and c.kind == "all-gather" and c.axes == ("d",)
        ]
        assert len(fwd) == len(rec) == 6  # w_q, w_kv, w_o, w_gate, w_up, w_down
        # Their transposes: one reduce-scatter over d per weight, in the backward pass.
        bwd = [
            c
            for c in looped
            if c.phase == "backward" and c.kind == "reduce-scatter" and c.axes == ("d",)
        ]
        assert len(bwd) == 6
        # The norm gains are 'd_model/t/d': gathered over t then d, in that order.
        assert any(c.axes == ("t", "d") and c.kind == "all-gather" for c in looped)
    sent = {
        n: sum(c.calls_per_step * c.bytes_sent for c in calls if c.in_loop)
        for n, calls in per_layers.items()
    }
    assert sent[3] == pytest.approx(sent[2] * 3 / 2)
    table = format_comm_table(per_layers[2])
    assert "recompute" in table and "total sent per device per step" in table


def test_gather_of_known_size(mesh):
    @functools.partial(typed_shard_map, mesh=mesh)
    def gather(w: f32["M/d F/t"]) -> f32["M F/t"]:
        return shardops.all_gather("M/d F/t -> M F/t", w, to="invarying")

    (c,) = collectives(compiled_hlo(jax.jit(gather), jnp.zeros((16, 8))), mesh)
    assert (c.kind, c.axes, c.result_shapes, c.phase) == ("all-gather", ("d",), [(16, 2)], "update")
    assert c.bytes_sent == 16 * 2 * 4 / 2
