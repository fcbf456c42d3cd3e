"""Tests of seqshard/model/pipeline/schedule.py: every schedule runs each microbatch through every
layer block forward and backward exactly once, in an order the data allows (each hop one
tick or more, on the stage that holds the block), and its bubble and in-flight counts are the
closed forms its docstring states."""

from __future__ import annotations

import pytest

from seqshard.model.pipeline.schedule import make_schedule

CASES = [
    (name, p, m, v)
    for p in (1, 2, 4, 8)
    for m in sorted({1, p, 2 * p, 4 * p})
    for name, v in (("gpipe", 1), ("1f1b", 1), ("circular", 2), ("circular", 3))
    if not (name == "circular" and m < p)
]


def when(schedule):
    """(microbatch, block, forward) -> (tick, stage), checking each happens exactly once."""
    out = {}
    for t, tick in enumerate(schedule.ticks):
        assert len(tick) == schedule.p
        for s, tasks in enumerate(tick):
            assert sum(x.forward for x in tasks) <= 1 and sum(not x.forward for x in tasks) <= 1
            for x in tasks:
                key = (x.microbatch, x.block, x.forward)
                assert key not in out, f"{key} twice"
                out[key] = (t, s)
    return out


@pytest.mark.parametrize("name,p,m,v", CASES, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in CASES])
def test_every_task_once_in_an_order_the_data_allows(name, p, m, v):
    s = make_schedule(name, p, m, v)
    at = when(s)
    blocks = v * p
    assert len(at) == 2 * m * blocks
    for i in range(m):
        for k in range(blocks):
            (tf, sf), (tb, sb) = at[(i, k, True)], at[(i, k, False)]
            assert sf == sb == k % p  # block k lives on stage k mod p
            assert s.kinds[tf].count("F") and s.kinds[tb].count("B")
            if k + 1 < blocks:  # activations hop to the next block's stage: a later tick
                assert at[(i, k + 1, True)][0] > tf
                assert at[(i, k + 1, False)][0] < tb  # cotangents hop back
            else:  # the loss turns forward into backward: same tick at the earliest
                assert tb >= tf
            if name != "1f1b":
                assert tb > tf


@pytest.mark.parametrize("name,p,m,v", CASES, ids=[f"{n}-p{p}-m{m}-v{v}" for n, p, m, v in CASES])
def test_bubble_and_in_flight_are_the_closed_forms(name, p, m, v):
    s = make_schedule(name, p, m, v)
    assert s.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    for stage in range(p):
        want = min(m, 2 * (p - stage) - 1) if name == "1f1b" else v * m
        assert s.max_in_flight(stage) == want


def test_1f1b_keeps_fewer_inputs_than_gpipe_in_the_same_ticks():
    p, m = 4, 16
    gpipe, ofob = make_schedule("gpipe", p, m), make_schedule("1f1b", p, m)
    assert max(map(ofob.max_in_flight, range(p))) == 2 * p - 1 < m == gpipe.max_in_flight(0)
    # the same time: 1f1b's m + 2(p-1) ticks = gpipe's 2(m + p - 1) one-kind ticks
    assert sum(map(len, ofob.kinds)) == sum(map(len, gpipe.kinds)) == 2 * (m + p - 1)


def test_the_table_reads_tick_by_stage():
    assert make_schedule("1f1b", p=2, m=2).format_table() == (
        "tick  stage 0 stage 1\n"
        "   0       F0       .\n"
        "   1       F1   F0 B0\n"
        "   2       B0   F1 B1\n"
        "   3       B1       ."
    )
    assert "F1.1" in make_schedule("circular", p=2, m=2, v=2).format_table()


@pytest.mark.parametrize(
    "args,needle",
    [
        (("zigzag", 2, 2, 1), "train.pipeline_schedule must be one of"),
        (("gpipe", 2, 4, 2), "train.pipeline_repeats=2 needs train.pipeline_schedule=circular"),
        (("circular", 4, 2, 2), "needs train.microbatches >= mesh.p"),
        (("gpipe", 2, 0, 1), "must be >= 1"),
    ],
)
def test_impossible_schedules_name_the_config_key(args, needle):
    with pytest.raises(ValueError, match=needle):
        make_schedule(*args)
