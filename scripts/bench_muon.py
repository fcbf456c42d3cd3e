#!/usr/bin/env python
"""Muon's cost in a train step, measured side by side with AdamW's on 8 fake CPU devices.

    python scripts/bench_muon.py                                  # tiny-cpu and tiny-cpu-moe
    python scripts/bench_muon.py configs/tiny-cpu.yaml --rounds 20 mesh.d=8 mesh.t=1

Per config: the train step of ``train.optimizer=adamw`` and of ``muon`` (the same model, mesh,
initial weights and batch), compiled, then timed in alternation (``--rounds`` rounds of one
step each, so both see the same machine load): the median step time of each and their
ratio. Beside it, what the plan says Muon adds: its Newton-Schulz FLOPs (per device) and the
update's all_to_alls (bytes each device sends), from :mod:`seqshard.plan.step_comms` and
:func:`seqshard.model.matrices.newton_schulz_flops`, against the step's model FLOPs and its
other collectives.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from seqshard.batch import TokenBatch, token_batch  # noqa: E402
from seqshard.config import load_config  # noqa: E402
from seqshard.mesh import training_mesh  # noqa: E402
from seqshard.model.cost import flops_per_token  # noqa: E402
from seqshard.model.matrices import newton_schulz_flops  # noqa: E402
from seqshard.plan.step_comms import collectives_per_step  # noqa: E402
from seqshard.shardlib.shardtypes import shardings  # noqa: E402
from seqshard.train.optimizer import make_optimizer  # noqa: E402
from seqshard.train.state import init_train_state  # noqa: E402
from seqshard.train.step import make_train_step  # noqa: E402


def _bench(path: str, overrides: list[str], rounds: int) -> None:
    base = load_config(path, overrides)
    mesh = training_mesh(base.mesh.sizes())
    rng = np.random.default_rng(0)
    b, length = base.train.batch_size, base.train.seq_len
    tokens = rng.integers(0, base.model.vocab, (b, length))
    starts = rng.random((b, length)) < 0.01
    starts[:, 0] = True
    batch = jax.device_put(token_batch(tokens, starts), shardings(TokenBatch, mesh))
    steps, states = {}, {}
    for name in ("adamw", "muon"):
        cfg = dataclasses.replace(
            base, train=dataclasses.replace(base.train, optimizer=name, warmup_steps=0)
        )
        opt = make_optimizer(cfg.train, cfg.model, mesh)
        states[name] = init_train_state(cfg.model, mesh, opt, jax.random.key(0))
        steps[name] = make_train_step(cfg, mesh, opt)
        states[name], _ = jax.block_until_ready(steps[name](states[name], batch))  # compile
    times: dict[str, list[float]] = {"adamw": [], "muon": []}
    for _ in range(rounds):
        for name in times:
            t0 = time.perf_counter()
            states[name], metrics = jax.block_until_ready(steps[name](states[name], batch))
            times[name].append(time.perf_counter() - t0)
    median = {name: statistics.median(t) for name, t in times.items()}
    muon = dataclasses.replace(base, train=dataclasses.replace(base.train, optimizer="muon"))
    calls = collectives_per_step(muon)
    update = sum(c.bytes_per_step for c in calls if c.phase == "update")
    other = sum(c.bytes_per_step for c in calls if c.phase != "update")
    devices = mesh.devices.size
    ns = newton_schulz_flops(base.model, base.train.muon.ns_steps) / devices
    model = flops_per_token(base.model, length).total * b * length / devices
    print(f"{path} {' '.join(overrides)} (mesh {base.mesh.describe()}, {rounds} rounds)")
    for name in ("adamw", "muon"):
        print(f"  {name:6} step {median[name] * 1e3:8.1f} ms (median)")
    print(f"  muon / adamw step time: {median['muon'] / median['adamw']:.3f}")
    print(
        f"  Newton-Schulz {ns / 1e9:.3f} GFLOP per device per step "
        f"({ns / model:.1%} of the step's model FLOPs); update all_to_alls "
        f"{update / 2**20:.2f} MiB sent per device ({update / other:.1%} of the step's other "
        f"collectives' {other / 2**20:.2f} MiB)"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="*", default=None)
    parser.add_argument("--rounds", type=int, default=15)
    args, overrides = parser.parse_known_args(argv)
    configs = [c for c in args.configs if c.endswith(".yaml")] or [
        "configs/tiny-cpu.yaml",
        "configs/tiny-cpu-moe.yaml",
    ]
    overrides += [c for c in args.configs if not c.endswith(".yaml")]
    print(f"jax {jax.__version__}, {jax.device_count()} {jax.default_backend()} devices")
    for path in configs:
        _bench(path, overrides, args.rounds)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
