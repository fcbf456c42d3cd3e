#!/usr/bin/env python
"""Pipelining over p on 8 fake CPU devices: gpipe and 1f1b beside the unpipelined step.

    python scripts/bench_pipeline.py                          # meshes 2x2x2, 4x2x1, 8x1x1
    python scripts/bench_pipeline.py --meshes 2x4x1 --m-per-p 1,4 --steps 4

The model: tiny-cpu's shapes with 8 layers (d_model 128, 2 kv heads x 2 query heads of 32,
d_ff 512, vocab 4096), f32, einsum attention, remat ``saved``, autodiff backward, 32 rows of
128 tokens. Meshes are written p x d x t. For each mesh and microbatch count m (a multiple of
p), the p = 1 baseline runs on the same 8 devices as d x t = (p·d) x t, the same batch in
m / p accumulated passes (each device then holds p times the rows of a pipeline stage). Per variant: the schedule's bubble fraction, XLA's
compiled temp memory per device (``memory_analysis``), the bytes ``ring_shift`` over p moves
per step per device (``seqshard.plan.show.pipeline_shifts``, held to the compiled HLO by
tests/model/pipeline/test_pipelined.py), and the median step time of the timed steps (round-robin over the
variants after a warm-up step each) with its ratio to the p = 1 step of the same run. Fake
CPU devices share two cores: the times say little about accelerators, where the bubble and
the links decide.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import argparse
import dataclasses
import statistics
import time

import jax
import numpy as np

from seqshard.batch import TokenBatch
from seqshard.config import Config, MeshConfig, TrainConfig, check_config
from seqshard.mesh import mesh_of_sizes
from seqshard.model.config import ModelConfig
from seqshard.plan.show import pipeline_shifts
from seqshard.shardlib.tables import format_bytes, format_table
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import init_train_state
from seqshard.train.step import make_train_step

MODEL = ModelConfig(
    vocab=4096, d_model=128, n_layers=8, n_q_per_kv=2, n_kv=2, d_head=32, d_ff=512,
    compute_dtype="float32", attention_impl="einsum", remat="saved", backward="autodiff",
)  # fmt: skip
ROWS, LENGTH = 32, 128


@dataclasses.dataclass
class Variant:
    name: str
    cfg: Config
    step: object = None
    state: object = None
    times: list = dataclasses.field(default_factory=list)
    temp: int = 0


def _config(p: int, d: int, t: int, m: int, schedule: str) -> Config:
    cfg = Config(
        model=MODEL,
        mesh=MeshConfig(p=p, d=d, t=t),
        train=TrainConfig(
            batch_size=ROWS, seq_len=LENGTH, microbatches=m, pipeline_schedule=schedule,
            warmup_steps=0,
        ),
    )  # fmt: skip
    check_config(cfg)
    return cfg


def _batch(mesh) -> TokenBatch:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, MODEL.vocab, (ROWS, LENGTH)).astype(np.int32)
    starts = rng.random((ROWS, LENGTH)) < 0.01
    starts[:, 0] = True
    from seqshard.batch import token_batch
    from seqshard.shardlib.shardtypes import shardings

    return jax.device_put(token_batch(tokens, starts), shardings(TokenBatch, mesh))


def _prepare(v: Variant) -> None:
    mesh = mesh_of_sizes(v.cfg.mesh.sizes())
    opt = make_optimizer(v.cfg.train, v.cfg.model, mesh)
    v.state = init_train_state(v.cfg.model, mesh, opt, jax.random.key(0))
    batch = _batch(mesh)
    v.step = make_train_step(v.cfg, mesh, opt)
    v.temp = v.step.lower(v.state, batch).compile().memory_analysis().temp_size_in_bytes
    v.batch = batch
    v.state, metrics = v.step(v.state, batch)  # warm-up (compiles)
    jax.block_until_ready(metrics)


def _time(v: Variant) -> None:
    start = time.perf_counter()
    v.state, metrics = v.step(v.state, v.batch)
    jax.block_until_ready(metrics)
    v.times.append(time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--meshes", default="2x2x2,4x2x1,8x1x1", help="p x d x t, comma-separated")
    ap.add_argument("--m-per-p", default="1,2", help="microbatches as multiples of p")
    ap.add_argument("--schedules", default="gpipe,1f1b")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for mesh_text in args.meshes.split(","):
        p, d, t = (int(x) for x in mesh_text.split("x"))
        for k in (int(x) for x in args.m_per_p.split(",")):
            m = k * p
            # p = 1 on the same devices: d·p rows each, so m / p passes of the same batch.
            base = Variant(f"p=1 ({p * d}x{t}, {k} accumulated)", _config(1, p * d, t, k, "gpipe"))
            variants = [base]
            variants += [
                Variant(f"{s} {mesh_text} m={m}", _config(p, d, t, m, s))
                for s in args.schedules.split(",")
            ]
            for v in variants:
                _prepare(v)
            for _ in range(args.steps):
                for v in variants:
                    _time(v)
            base = statistics.median(variants[0].times)
            for v in variants:
                sizes = v.cfg.mesh.sizes()
                if sizes["p"] > 1:
                    schedule = v.cfg.train.pipeline().on(sizes["p"])
                    shifts, block = pipeline_shifts(v.cfg)
                    bubble, moved = f"{schedule.bubble_fraction:.3f}", format_bytes(shifts * block)
                else:
                    bubble, moved = "-", "-"
                median = statistics.median(v.times)
                rows.append(
                    (v.name, bubble, format_bytes(v.temp), moved, f"{median * 1e3:.0f} ms",
                     f"{median / base:.2f}")
                )  # fmt: skip
                print(" | ".join(rows[-1]), flush=True)
    print()
    print(
        format_table(rows, ("variant", "bubble", "temp/device", "shifted/step", "step", "vs p=1"))
    )


if __name__ == "__main__":
    main()
