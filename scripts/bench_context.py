#!/usr/bin/env python
"""Long sequences on 8 fake CPU devices: the sequence split over c, all-gather vs ring attention.

    python scripts/bench_context.py                       # sequences 4096 and 8192
    python scripts/bench_context.py --seqs 8192 --cs 2,8 --steps 2

The model: tiny-cpu's (2 layers, d_model 128, 2 kv heads x 2 query heads of 32, d_ff 512,
vocab 4096), f32, einsum attention, packed documents of random lengths, remat ``saved``,
the default hand-written backward. Every variant trains on the same 8 rows with 8 devices:
mesh d = 8/c x c. For each sequence length: c = 1 (the sequence whole on each device), then
``allgather`` and ``ring`` at each c. Per variant: the median step time and tokens/s of the
timed steps (round-robin over the variants, after a warm-up step each), and XLA's compiled
temporary memory per device (``memory_analysis``). c = 1 runs only if its compiled memory
fits this machine (8 devices x (arguments + temporaries) under half the host's memory);
otherwise its row says so, with the figure.

The work balance of the zigzag layout is printed from the ring's own rule (a pair of chunks
is computed when its mask is not empty): chunk pairs per device per layer for a causal mask,
zigzag against the contiguous split it replaces.
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
from seqshard.config import Config, MeshConfig, TrainConfig
from seqshard.mesh import mesh_of_sizes
from seqshard.model.config import ModelConfig
from seqshard.shardlib.shardops import zigzag_chunks
from seqshard.shardlib.tables import format_bytes, format_table
from seqshard.train.optimizer import make_optimizer
from seqshard.train.state import init_train_state
from seqshard.train.step import make_train_step

MODEL = ModelConfig(
    vocab=4096, d_model=128, n_layers=2, n_q_per_kv=2, n_kv=2, d_head=32, d_ff=512,
    compute_dtype="float32", attention_impl="einsum", remat="saved",
)  # fmt: skip
ROWS = 8


@dataclasses.dataclass
class Variant:
    name: str
    seq_len: int
    c: int
    step: object = None
    state: object = None
    batch: object = None
    temp: int = 0
    args: int = 0
    times: list = dataclasses.field(default_factory=list)
    skipped: str = ""


def make_batch(seq_len: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """8 rows of random ids, packed documents of 1/16 to 1/2 of the row."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, MODEL.vocab, (ROWS, seq_len), dtype=np.int32)
    starts = np.zeros((ROWS, seq_len), bool)
    for row in starts:
        i = 0
        while i < seq_len:
            row[i] = True
            i += int(rng.integers(seq_len // 16, seq_len // 2))
    return tokens, starts


def build(v: Variant, impl: str, tokens, starts) -> None:
    model = dataclasses.replace(MODEL, context_impl=impl)
    train = TrainConfig(steps=10, batch_size=ROWS, seq_len=v.seq_len, warmup_steps=1)
    cfg = Config(
        model=model, mesh=MeshConfig(d=ROWS // v.c if v.c < ROWS else 1, c=v.c), train=train
    )
    mesh = mesh_of_sizes(cfg.mesh.sizes())
    opt = make_optimizer(cfg.train, cfg.model, mesh)
    v.state = init_train_state(cfg.model, mesh, opt, jax.random.key(0))
    v.batch = jax.device_put(
        TokenBatch(tokens=tokens, is_seq_start=starts, loss_mask=np.ones_like(starts))
    )
    step = make_train_step(cfg, mesh, opt)
    compiled = step.lower(v.state, v.batch).compile()
    mem = compiled.memory_analysis()
    v.temp, v.args = mem.temp_size_in_bytes, mem.argument_size_in_bytes
    v.step = compiled


def host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run_once(v: Variant) -> None:
    start = time.perf_counter()
    v.state, metrics = v.step(v.state, v.batch)
    jax.block_until_ready(metrics)
    v.times.append(time.perf_counter() - start)


def balance(c: int) -> tuple[list[int], list[int]]:
    """Chunk pairs each device computes per layer under a causal mask: zigzag, contiguous."""

    def pairs(chunks_of) -> list[int]:
        return [
            sum(kc <= qc for j in range(c) for qc in chunks_of(i) for kc in chunks_of(j))
            for i in range(c)
        ]

    zig = zigzag_chunks(c)
    return pairs(lambda i: zig[2 * i : 2 * i + 2]), pairs(lambda i: (2 * i, 2 * i + 1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", default="4096,8192")
    parser.add_argument("--cs", default="2,4,8")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    seqs = [int(s) for s in args.seqs.split(",")]
    cs = [int(c) for c in args.cs.split(",")]
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].platform}; {ROWS} rows a step")
    variants: list[Variant] = []
    for seq_len in seqs:
        tokens, starts = make_batch(seq_len)
        for c, impl in [(1, "allgather")] + [(c, i) for c in cs for i in ("allgather", "ring")]:
            name = "c=1" if c == 1 else f"{impl} c={c}"
            v = Variant(name=name, seq_len=seq_len, c=c)
            build(v, impl, tokens, starts)
            need = ROWS * (v.temp + v.args)
            if need > host_memory() // 2:
                v.skipped = f"needs {format_bytes(need)} on 8 devices, over half this host's"
                v.step = v.state = None
            variants.append(v)
            print(
                f"  compiled {seq_len} {name}: temp {format_bytes(v.temp)} per device", flush=True
            )
    live = [v for v in variants if not v.skipped]
    for r in range(args.steps):
        for v in live[r % len(live) :] + live[: r % len(live)]:
            run_once(v)
    header = ["seq", "variant", "mesh d x c", "step s", "tokens/s", "temp/device", "vs c=1 temp"]
    rows = []
    for v in variants:
        base = next(b for b in variants if b.seq_len == v.seq_len and b.c == 1)
        step = statistics.median(v.times) if v.times else None
        rows.append(
            [
                str(v.seq_len),
                v.name,
                f"{8 // v.c} x {v.c}",
                f"{step:.3f}" if step else "-",
                f"{ROWS * v.seq_len / step:,.0f}" if step else v.skipped,
                format_bytes(v.temp),
                f"{v.temp / base.temp:.3f}",
            ]
        )
    print(format_table(rows, header))
    print()
    print("ring work per device per layer, chunk pairs (each (L/2c)^2 scores), causal mask:")
    for c in cs:
        zig, contiguous = balance(c)
        print(
            f"  c={c}: zigzag {zig} (max/min {max(zig) / min(zig):.2f}); "
            f"contiguous would be {contiguous} (max/min {max(contiguous) / min(contiguous):.2f})"
        )


if __name__ == "__main__":
    main()
