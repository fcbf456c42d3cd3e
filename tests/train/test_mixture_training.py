"""A run on a staged mixture of two token sets: tokens logged per source, the val loss per
source and the mixture's, and a resume inside the second stage that continues bit for bit."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from run_helpers import FLAT, by_step, run

from seqshard.cli import main
from seqshard.config import ConfigError


@pytest.fixture(scope="module")
def mixture_overrides(tmp_path_factory, data_dir, tiny_overrides):
    root = tmp_path_factory.mktemp("mixture")
    other = shutil.copytree(data_dir, root / "other")  # the same tokenizer, another name

    def make(name: str) -> list[str]:
        return [
            *tiny_overrides(root / "runs", name, steps=4, checkpoint_every=2, eval_every=2, **FLAT),
            f"data.mixture=[{{path: {data_dir}, weight: 3}}, {{path: {other}, weight: 1}}]",
            f"data.stages=[{{start_step: 3, mixture: [{{path: {other}, weight: 1}}]}}]",
        ]

    return root, make


def test_staged_mixture_run_logs_per_source_and_resumes_exactly(
    mixture_overrides, data_dir, capsys
):
    root, make = mixture_overrides
    straight = run(make("straight"))
    records = by_step(straight.run_dir)
    seq, batch = 32, 8
    # Steps 1-3 draw 6:2 rows a batch (weights 3:1); the stage at start_step 3 (after 3
    # steps: logged step 4 on) draws only from "other".
    assert records[2]["tokens/tokens"] == 2 * 6 * seq and records[2]["tokens/other"] == 2 * 2 * seq
    assert (
        records[4]["tokens/tokens"] == 18 * seq and records[4]["tokens/other"] == (6 + batch) * seq
    )
    at2, at4 = records[2], records[4]
    assert at2["val_loss"] == pytest.approx(
        0.75 * at2["val_loss/tokens"] + 0.25 * at2["val_loss/other"]
    )
    assert at4["val_loss"] == pytest.approx(at4["val_loss/other"])
    # The two sources hold the same text: their val losses agree (the val sets are equal).
    assert at4["val_loss/tokens"] == pytest.approx(at4["val_loss/other"])

    # Resume inside stage 2 from the step-2 checkpoint: the same batches, the same losses.
    resumed_dir = root / "runs" / "resumed"
    shutil.copytree(straight.run_dir, resumed_dir)
    shutil.rmtree(resumed_dir / "checkpoints" / "4")
    resumed = run(make("resumed"))
    assert resumed.step == 4
    again = by_step(resumed_dir)
    for step in (3, 4):
        assert again[step]["loss"] == records[step]["loss"], step
    assert np.isfinite(again[4]["val_loss"])

    # seqshard eval: the mixture's val loss and each source's, as the run logged them.
    capsys.readouterr()
    assert main(["eval", str(straight.run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"val loss {at4['val_loss']:.4f}" in out, out
    assert f"tokens: val loss {at4['val_loss/tokens']:.4f}" in out
    assert f"other: val loss {at4['val_loss/other']:.4f}" in out


def test_mixture_bad_sources_fail_before_compiling(mixture_overrides, tmp_path):
    root, make = mixture_overrides
    other = root / "other"
    missing = [*make("bad"), f"data.mixture=[{{path: {tmp_path / 'nowhere'}, weight: 1}}]"]
    with pytest.raises(
        ConfigError, match=r"nowhere holds no prepared data.*seqshard prepare --out"
    ):
        run(missing)
    with pytest.raises(ConfigError, match=r"data\.mixture and data\.stages\[0\]"):
        run([*make("bad"), "data.stages=[{start_step: 0, mixture: [{path: x}]}]"])
    with pytest.raises(ConfigError, match=r"source .*other has weight -1.0"):
        run(
            [
                *make("bad"),
                f"data.stages=[{{start_step: 2, mixture: [{{path: {other}, weight: -1}}]}}]",
            ]
        )
