"""Tests of seqshard/train/profile.py: a real 3-step profile of the tiny model (train.profile),
read back by op kind and program, and scripts/profile_summary.py on it."""

import gzip
import importlib.util
import json
from pathlib import Path

import pytest
from run_helpers import run

from seqshard.config import ConfigError, load_config
from seqshard.train.profile import (
    COLLECTIVES,
    OP_KINDS,
    _self_times,
    hlo_kinds,
    summarize,
    trace_files,
)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, tiny_overrides) -> Path:
    """The tiny model (4x2 mesh: FSDP over d, tensor over t) trained 6 steps, steps 2-4
    traced; no evaluation inside the window. Its run directory."""
    root = tmp_path_factory.mktemp("profiled")
    overrides = tiny_overrides(root, "prof", eval_every=0)
    result = run([*overrides, "train.profile.start_step=2", "train.profile.steps=3"])
    assert result.step == 6
    return result.run_dir


def test_the_trace_is_written_for_tensorboard_and_perfetto(profiled):
    (trace,) = trace_files(profiled)
    session = trace.parent
    assert session.parent == profiled / "profile" / "plugins" / "profile"
    assert trace.name.endswith(".trace.json.gz")
    assert len(list(session.glob("*.xplane.pb"))) == 1  # TensorBoard's profile plugin
    with gzip.open(session / "perfetto_trace.json.gz", "rt") as f:  # ui.perfetto.dev
        assert json.load(f)["traceEvents"]


def test_the_summary_lists_the_op_kinds_of_the_step(profiled):
    summary = summarize(profiled)
    assert summary.steps == 3 and summary.devices == 8
    assert list(summary.programs) == ["jit_step"]  # the train step alone: no eval in the window
    assert set(summary.kinds) == set(OP_KINDS)
    # FSDP over d gathers weights and reduce-scatters gradients; t sums partial products
    # (all-reduce). No expert or context axis: no all-to-all, no collective-permute.
    for kind in ("fusion", "all-gather", "reduce-scatter", "all-reduce", "copy"):
        assert summary.kinds[kind] > 0, (kind, summary.kinds)
    assert summary.kinds["all-to-all"] == summary.kinds["collective-permute"] == 0
    assert sum(summary.kinds.values()) == pytest.approx(summary.programs["jit_step"])

    table = summary.table()
    assert "3 steps on 8 devices" in table
    for kind in OP_KINDS:
        assert any(line.startswith(kind + " ") for line in table.splitlines()), kind


def test_every_traced_op_has_its_kind_from_the_hlo(profiled):
    """The trace names ops as JAX does (``psum_invariant.14`` is an all-reduce): each op event
    finds its instruction in the HLO the .xplane.pb holds; the collectives' names alone would
    miss some."""
    (trace,) = trace_files(profiled)
    kinds = hlo_kinds(next(trace.parent.glob("*.xplane.pb")))
    with gzip.open(trace, "rt") as f:
        ops = [e for e in json.load(f)["traceEvents"] if "hlo_op" in (e.get("args") or {})]
    keys = {(e["args"]["hlo_module"], e["args"]["hlo_op"]) for e in ops}
    assert keys and keys <= set(kinds)
    renamed = {op for (_, op) in keys if kinds["jit_step", op] in COLLECTIVES}
    assert any(not any(c in op.replace("_", "-") for c in COLLECTIVES) for op in renamed)


def test_self_times_count_each_moment_of_a_thread_once(profiled):
    """Ops nest (a ``while`` runs the layers' ops): the self times of one thread's ops add up
    to the time covered by any op, not to the sum of their durations."""
    (trace,) = trace_files(profiled)
    with gzip.open(trace, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if "hlo_op" in (e.get("args") or {})]
    threads: dict = {}
    for e in events:
        threads.setdefault((e["pid"], e["tid"]), []).append(e)
    nested = False
    for line in threads.values():
        covered, end = 0.0, float("-inf")
        for e in sorted(line, key=lambda e: e["ts"]):
            start, stop = max(e["ts"], end), e["ts"] + e["dur"]
            nested |= stop <= end
            covered += max(0.0, stop - start)
            end = max(end, stop)
        assert sum(s for _, s in _self_times(line)) == pytest.approx(covered, rel=1e-6)
    assert nested  # the check above saw ops inside others


def test_profile_summary_script(profiled, capsys):
    spec = importlib.util.spec_from_file_location(
        "profile_summary", REPO / "scripts/profile_summary.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(profiled)]) == 0
    out = capsys.readouterr().out
    assert out.strip() == summarize(profiled).table()
    assert script.main([str(profiled / "checkpoints")]) == 2
    err = capsys.readouterr().err
    assert "no profile in" in err and "train.profile.steps" in err


def test_profile_steps_are_checked():
    with pytest.raises(ConfigError, match=r"traces steps 5-7, past train.steps=6.*start_step <= 4"):
        load_config(None, ["train.steps=6", "train.profile.start_step=5", "train.profile.steps=3"])
    with pytest.raises(ConfigError, match="start_step >= 1"):
        load_config(None, ["train.profile.start_step=0", "train.profile.steps=1"])
