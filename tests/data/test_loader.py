"""Tests of seqshard.data.loader: TokenBatch batches sharded as their types say, exact resumption, the
prefetch thread, several processes."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest
from data_helpers import SEQ_LEN, VOCAB, _host, _loader
from jax.sharding import PartitionSpec as P

from seqshard.data.loader import unigram_entropy
from seqshard.data.packing import PackedStream
from seqshard.data.tokenfile import (
    open_split,
)
from seqshard.testing import fake_cpu_mesh


def test_loader_argument_errors(data_dir, mesh):
    max_id = open_split(data_dir, "train").max_id
    with pytest.raises(
        ValueError, match=rf"train-00000\.bin holds token id {max_id}.*model's vocab is 10"
    ):
        _loader(data_dir, mesh, vocab=10)
    with pytest.raises(ValueError, match=r"multiple of the mesh's d axis \(2\).*got 5"):
        _loader(data_dir, mesh, batch_size=5)
    with pytest.raises(ValueError, match="fewer than one row of seq_len"):
        _loader(data_dir, mesh, seq_len=10**7)
    with pytest.raises(ValueError, match="'d' axis"):
        _loader(data_dir, fake_cpu_mesh((2, 4), ("x", "t")))


def test_loader_batches_are_stream_rows_and_sharded(data_dir, mesh):
    with _loader(data_dir, mesh, batch_size=4, seed=3) as loader:
        stream = PackedStream(open_split(data_dir, "train"), SEQ_LEN, seed=3)
        R = stream.rows_per_epoch
        for step, batch in enumerate(loader):  # cross an epoch boundary
            assert loader.step == step + 1
            tokens, starts = _host(batch)
            want_t, want_s, _ = stream.rows(np.arange(step * 4, step * 4 + 4))
            assert np.array_equal(tokens, want_t) and np.array_equal(starts, want_s)
            if step * 4 > R + 8:
                break
    for arr, dtype in ((batch.tokens, np.int32), (batch.is_seq_start, np.bool_)):
        assert isinstance(arr, jax.Array) and arr.shape == (4, SEQ_LEN) and arr.dtype == dtype
        assert arr.sharding.spec == P(("d", "e"), "c") and arr.sharding.mesh.shape == mesh.shape
        assert len(arr.addressable_shards) == 8
        for shard in arr.addressable_shards:
            assert shard.data.shape == (2, SEQ_LEN)
            assert np.array_equal(np.asarray(shard.data), np.asarray(arr)[shard.index])


def test_loader_is_deterministic_and_random_access(data_dir, mesh):
    a = _loader(data_dir, mesh, seed=7, prefetch=0)
    b = _loader(data_dir, mesh, seed=7, prefetch=3)
    c = _loader(data_dir, mesh, seed=8, prefetch=0)
    with a, b, c:
        for step in (0, 1, 5, 123, 10**6):
            ta, sa = _host(a.batch_at(step))
            tb, sb = _host(b.batch_at(step))
            assert np.array_equal(ta, tb) and np.array_equal(sa, sb)
        assert not np.array_equal(_host(a.batch_at(1))[0], _host(c.batch_at(1))[0])
        first = [_host(x) for _, x in zip(range(3), b, strict=False)]
        assert all(np.array_equal(f[0], _host(a.batch_at(i))[0]) for i, f in enumerate(first))


def test_loader_exact_resume(data_dir, mesh):
    with _loader(data_dir, mesh, seed=1) as full:
        reference = [_host(x) for _, x in zip(range(12), full, strict=False)]
        assert full.state()["step"] == 12
    with _loader(data_dir, mesh, seed=1) as first:
        for _, _batch in zip(range(5), first, strict=False):
            pass
        state = first.state()
    assert state == {**state, "step": 5, "seed": 1, "split": "train", "batch_size": 4}
    with _loader(data_dir, mesh, seed=state["seed"], start_step=state["step"]) as resumed:
        resumed.check_state(state)
        assert resumed.step == 5
        for batch, want in zip(resumed, reference[5:], strict=False):
            assert all(np.array_equal(x, y) for x, y in zip(_host(batch), want, strict=True))
    with (
        _loader(data_dir, mesh, seed=2) as other,
        pytest.raises(ValueError, match="seed: saved 1, now 2"),
    ):
        other.check_state(state)


def test_eval_batches_are_fixed(data_dir, mesh):
    with _loader(data_dir, mesh, seed=1, prefetch=0) as a, _loader(data_dir, mesh, seed=2) as b:
        first = [_host(x) for x in a.eval_batches(2)]
        again = [_host(x) for x in a.eval_batches(2)]
        other = [_host(x) for x in b.eval_batches(2)]
    for x, y, z in zip(first, again, other, strict=True):
        assert np.array_equal(x[0], y[0]) and np.array_equal(x[0], z[0])
    val = open_split(data_dir, "val")
    val_tokens = set(np.unique(val.read(0, val.n_tokens)[0]))
    assert set(np.unique(first[0][0])) <= val_tokens


def test_prefetch_thread_reraises_errors_and_stops(data_dir, mesh):
    loader = _loader(data_dir, mesh, prefetch=2)
    real_rows = loader.stream.rows

    def rows(row_ids):
        if row_ids.min() >= 3 * 4:
            raise ValueError("disk on fire")
        return real_rows(row_ids)

    loader.stream.rows = rows
    steps = []
    with pytest.raises(ValueError, match="disk on fire"):
        for step, _batch in enumerate(loader):
            steps.append(step)
    assert steps == [0, 1, 2]
    assert loader._thread is None  # closed and joined
    with pytest.raises(ValueError, match="disk on fire"):
        next(loader)


def test_close_stops_a_blocked_prefetch_thread(data_dir, mesh):
    before = threading.active_count()
    loader = _loader(data_dir, mesh, prefetch=2)
    next(loader)
    thread = loader._thread
    time.sleep(0.3)  # the thread fills the queue and blocks in put()
    assert thread.is_alive()
    t0 = time.perf_counter()
    loader.close()
    assert not thread.is_alive() and time.perf_counter() - t0 < 2
    assert threading.active_count() == before
    with pytest.raises(StopIteration):
        next(loader)
    loader.close()  # idempotent


def test_unigram_entropy(data_dir):
    train = open_split(data_dir, "train")
    tokens = train.read(0, train.n_tokens)[0]
    p = np.bincount(tokens) / len(tokens)
    p = p[p > 0]
    h = unigram_entropy(data_dir, "train")
    assert h == pytest.approx(-(p * np.log(p)).sum()) and 0 < h < np.log(VOCAB)


_TWO_PROCESS_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, numpy as np
from jax.sharding import AxisType
jax.config.update("jax_cpu_collectives_implementation", "gloo")
pid, port, data_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=pid)
from seqshard.data.loader import Loader
from seqshard.data.packing import PackedStream
from seqshard.data.tokenfile import open_split
mesh = jax.make_mesh((4, 2), ("d", "t"), axis_types=(AxisType.Auto,) * 2)
loader = Loader(data_dir, "train", batch_size=8, seq_len=16, mesh=mesh, prefetch=0, seed=5)
batch = loader.batch_at(3)
want = PackedStream(open_split(data_dir, "train"), 16, 5).rows(np.arange(24, 32))[0]
rows = sorted({s.index[0].start for s in batch.tokens.addressable_shards})
assert all(np.array_equal(np.asarray(s.data), want[s.index]) for s in batch.tokens.addressable_shards)
total = int(jax.jit(lambda x: x.sum())(batch.tokens))
assert total == int(want.sum()), (total, int(want.sum()))
print("OK", pid, rows)
"""


@pytest.mark.slow
def test_two_processes_each_read_their_own_rows(tmp_path, data_dir):
    """Two JAX processes of 4 CPU devices each: each builds only its half of the batch, and the
    global array they make together is the whole batch. Both are killed on the test's own
    timeout (one process gone would leave the other waiting in its collective)."""
    import sys

    from process_helpers import ProcessGroup, cpu_env, free_port

    port = str(free_port())
    script = tmp_path / "two_process.py"
    script.write_text(_TWO_PROCESS_SCRIPT)
    cmds = [[sys.executable, str(script), str(pid), port, str(data_dir)] for pid in (0, 1)]
    with ProcessGroup(cmds, tmp_path / "logs", cpu_env()) as group:
        assert group.wait(timeout=120) == [0, 0], group.outputs()
        outs = [group.output(0), group.output(1)]
    assert "OK 0 [0, 2]" in outs[0] and "OK 1 [4, 6]" in outs[1]
