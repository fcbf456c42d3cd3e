"""Tests of seqshard.data.mixture and the Loader over a mixture: the rows of each batch drawn
from the sources in proportion to the weights, located from (step, row) alone, each source's
stream continuing across stages, and the bad inputs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from data_helpers import SEQ_LEN, _host, _loader, reshard

from seqshard.data.mixture import PERIOD, Mixture, MixturePlan, Source, Stage
from seqshard.data.packing import PackedStream
from seqshard.data.tokenfile import open_split


def _drawn_by_walking(plan: MixturePlan, steps: int) -> np.ndarray:
    counts = np.zeros(len(plan.sources), np.int64)
    for step in range(steps):
        source, rows = plan.locate(step, np.arange(plan.batch_size))
        # Each source's rows continue its stream: exactly the next unread ones.
        for k in range(len(plan.sources)):
            got = np.sort(rows[source == k])
            assert np.array_equal(got, np.arange(counts[k], counts[k] + len(got)))
            counts[k] += len(got)
    return counts


def test_weights_met_per_batch_and_per_period():
    mixture = Mixture.of([("a/web", 0.7), ("b/code", 0.2), ("c/math", 0.1)])
    plan = MixturePlan(mixture, batch_size=32)
    for step in (0, 1, 77, 2047, 10**7):
        source, _ = plan.locate(step, np.arange(32))
        share = np.bincount(source, minlength=3)
        assert np.all(np.abs(share - 32 * np.array([0.7, 0.2, 0.1])) <= 1), share
    drawn = _drawn_by_walking(plan, 300)
    assert np.array_equal(drawn, plan.rows_drawn(300))
    per_period = plan.rows_drawn(PERIOD // 32)  # 2048 steps are one period
    assert per_period.sum() == PERIOD and np.all(
        np.abs(per_period - PERIOD * np.array([0.7, 0.2, 0.1])) < 1
    )


def test_stages_continue_each_source_stream():
    mixture = Mixture(
        (
            Stage(0, (Source("a/web", 1.0), Source("b/code", 1.0))),
            Stage(7, (Source("b/code", 1.0),)),
            Stage(12, (Source("a/web", 3.0), Source("b/code", 1.0))),
        )
    )
    plan = MixturePlan(mixture, batch_size=8)
    drawn = _drawn_by_walking(plan, 20)  # asserts no row is drawn twice or skipped
    assert np.array_equal(drawn, plan.rows_drawn(20))
    assert plan.rows_drawn(7).tolist() == [28, 28] and plan.rows_drawn(12).tolist() == [28, 68]
    assert mixture.weights_at(13) == {"web": 0.75, "code": 0.25}
    assert mixture.weights_at(8) == {"web": 0.0, "code": 1.0}


@pytest.mark.parametrize(
    "stages, message",
    [
        ((Stage(0, (Source("a", -1.0),)),), r"source a has weight -1.0; weights must be finite"),
        ((Stage(0, (Source("a", 0.0), Source("b", 0.0))),), r"every weight is 0 \(a, b\)"),
        ((Stage(0, (Source("a", 1.0), Source("b", 1e-9))),), r"below 1/65536"),
        ((Stage(2, (Source("a", 1.0),)),), r"first stage starts at step 2"),
        (
            (Stage(0, (Source("a", 1.0),)), Stage(0, (Source("a", 1.0),))),
            r"start steps must rise: 0 then 0",
        ),
        ((Stage(0, (Source("x/a", 1.0), Source("y/a", 1.0))),), r"two sources are named 'a'"),
        ((), r"at least one stage"),
    ],
)
def test_bad_mixtures(stages, message):
    with pytest.raises(ValueError, match=message):
        Mixture(stages)


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory, data_dir):
    """The test corpus and a 3-shard copy of it named differently: two sources, one tokenizer."""
    root = tmp_path_factory.mktemp("mix")
    web = shutil.copytree(data_dir, root / "web")
    return web, reshard(data_dir, root / "code", 3)


def test_loader_over_a_mixture(two_sources, mesh):
    """Each row of a batch is the next row of its source's own stream; batches are a function
    of the step (a resumed loader agrees); eval has a val set per source."""
    web, code = two_sources
    mixture = Mixture.of([(web, 3.0), (code, 1.0)])
    with _loader(mixture, mesh, batch_size=8, seed=2, prefetch=0) as loader:
        streams = [PackedStream(open_split(d, "train"), SEQ_LEN, 2) for d in (web, code)]
        for step in (0, 1, 5):
            tokens, starts = _host(loader.batch_at(step))
            source, rows = loader.plan.locate(step, np.arange(8))
            assert np.bincount(source, minlength=2).tolist() == [6, 2]
            for r in range(8):
                want = streams[source[r]].rows(rows[r : r + 1])
                assert np.array_equal(tokens[r], want[0][0]) and np.array_equal(
                    starts[r], want[1][0]
                )
        assert loader.tokens_drawn(5) == {"web": 30 * SEQ_LEN, "code": 10 * SEQ_LEN}
        sets = loader.eval_sets(1)
        assert list(sets) == ["web", "code"] and all(len(b) == 1 for b in sets.values())
        state = loader.state()
    with _loader(mixture, mesh, batch_size=8, seed=2, start_step=4) as resumed:
        resumed.check_state(state)
        again = _loader(mixture, mesh, batch_size=8, seed=2, prefetch=0)
        for got, step in zip(resumed, range(4, 7), strict=False):
            assert np.array_equal(_host(got)[0], _host(again.batch_at(step))[0])
    other = Mixture.of([(web, 1.0), (code, 1.0)])
    with (
        _loader(other, mesh, batch_size=8, seed=2) as changed,
        pytest.raises(ValueError, match="data_hash"),
    ):
        changed.check_state(state)


def test_mixture_sources_must_share_a_tokenizer_and_have_val(tmp_path, two_sources, mesh):
    web, code = two_sources
    odd = shutil.copytree(code, tmp_path / "odd")
    meta = json.loads((odd / "meta.json").read_text())
    (odd / "tokenizer.json").write_text((odd / "tokenizer.json").read_text() + " ")
    meta["tokenizer_sha256"] = (
        __import__("hashlib").sha256((odd / "tokenizer.json").read_bytes()).hexdigest()
    )
    (odd / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(
        ValueError,
        match=r"odd/meta\.json was tokenized with tokenizer sha256.*must share one tokenizer",
    ):
        _loader(Mixture.of([(web, 1.0), (odd, 1.0)]), mesh)
    no_val = shutil.copytree(code, tmp_path / "noval")
    meta = json.loads((no_val / "meta.json").read_text())
    del meta["splits"]["val"]
    (no_val / "meta.json").write_text(json.dumps(meta))
    with (
        _loader(Mixture.of([(web, 1.0), (no_val, 1.0)]), mesh) as loader,
        pytest.raises(ValueError, match=r"noval/meta\.json has no 'val' split"),
    ):
        loader.eval_sets(1)
