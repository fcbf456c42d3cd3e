"""scripts/bench_step.py's ``--attention mla``: the MLA model it benches splits on every mesh the
script runs by default, unchanged (no '*' model), and a mesh it cannot split is refused by
name; end to end (slow), seqshard and the steered GSPMD baseline start from the same MLA
model: their first-step losses agree.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from seqshard.model.config import ModelConfig

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_step.py"


@functools.cache
def bench():
    """scripts/bench_step.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("bench_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("q_lora_rank", [128, 0])
def test_mla_model_splits_on_the_default_meshes(q_lora_rank):
    """8x1, 4x2 and 2x4 run the MLA model as specified (GQA's 2x4 has to regroup its heads;
    MLA's 4 heads split over t=4 and its latents over t x d = 8); 1x8 cannot split 4 heads,
    and MLA cannot regroup them (n_q_per_kv stays 1): refused, naming MLA."""
    b = bench()
    model = ModelConfig(**b.model_fields("mla", q_lora_rank))
    assert (model.attention, model.n_q_per_kv, model.mla.q_lora_rank) == ("mla", 1, q_lora_rank)
    for d, t in [(8, 1), (4, 2), (2, 4)]:
        assert b.model_for_mesh(model, d, t) == (model, ""), (d, t)
    with pytest.raises(SystemExit, match="MLA keeps n_q_per_kv=1"):
        b.model_for_mesh(model, 1, 8)
    gqa = ModelConfig(**b.model_fields("gqa", 128))
    assert b.model_for_mesh(gqa, 2, 4)[1], "GQA's n_kv=2 should need the '*' change on t=4"


def test_q_lora_rank_needs_mla():
    with pytest.raises(SystemExit):
        bench().main(["--q-lora-rank", "64"])


@pytest.mark.slow
def test_mla_losses_agree_end_to_end(capsys):
    """One warm-up and one timed step of seqshard and gspmd-act on 2x2, tiny peak matmul: the
    ratio line comes out and the two first-step losses agree (same weights, same math)."""
    bench().main(
        ["--attention", "mla", "--meshes", "2x2", "--impls", "seqshard,gspmd-act"]
        + ["--steps", "1", "--warmup", "1", "--peak-n", "64"]
    )
    out = capsys.readouterr().out
    losses = dict(re.findall(r"compiled (\S+)@2x2/f32 .* first-step loss (\S+)", out))
    assert set(losses) == {"seqshard", "gspmd-act"}, out
    assert float(losses["seqshard"]) == pytest.approx(float(losses["gspmd-act"]), rel=1e-5)
    assert re.search(r"^ratio_vs_gspmd_act=\d", out, re.M), out
