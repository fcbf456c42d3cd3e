#!/usr/bin/env python
"""Train one config several ways and compare their loss curves step by step: the numerics of a
change (FP8, bf16) against a baseline run, all on the same data, seed and machine.

    python scripts/compare_losses.py configs/tiny-cpu.yaml --steps 50 \\
        --run f32= --run bf16=model.compute_dtype=bfloat16 \\
        --run fp8=model.compute_dtype=bfloat16,model.fp8=current

Each ``--run NAME=KEY=VALUE,...`` is one ``seqshard train`` of the config with those overrides
(``NAME=`` alone: the config as it is), one after another, in ``--dir``. The first run is the
baseline. Printed: each run's loss at a few steps, and its largest relative difference from
the baseline's over all steps (and over the last half, after the start's fast fall), which
docs/fp8.md uses to set FP8's tolerance against bf16's own distance from f32.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile


def _run(config: str, name: str, overrides: list[str], steps: int, root: pathlib.Path) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "seqshard.cli",
        "train",
        config,
        f"train.steps={steps}",
        "train.log_every=1",
        "train.eval_every=100000",
        f"train.checkpoint_every={steps}",
        f"run.name={name}",
        f"run.dir={root}",
        *overrides,
    ]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"run {name!r} failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    losses = {}
    for line in (root / name / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("loss") is not None and "step" in row:
            losses[int(row["step"])] = float(row["loss"])
    return losses


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--run", action="append", required=True, help="NAME=KEY=VALUE,...")
    parser.add_argument("--dir", default=None, help="where the runs go (default: a temp dir)")
    args = parser.parse_args(argv)
    root = pathlib.Path(args.dir or tempfile.mkdtemp(prefix="compare_losses_"))
    runs = {}
    for spec in args.run:
        name, _, rest = spec.partition("=")
        overrides = [o for o in rest.split(",") if o]
        runs[name] = _run(args.config, name, overrides, args.steps, root)
        print(f"{name}: done ({len(runs[name])} steps logged)", flush=True)
    base_name, base = next(iter(runs.items()))
    steps = sorted(base)
    shown = [s for s in steps if s in (steps[0], 10, 20, 30, 40) or s == steps[-1]]
    print(f"\nloss by step ({args.config}, {args.steps} steps; baseline {base_name})")
    print(f"{'run':>10} " + " ".join(f"{s:>8}" for s in shown) + "   max rel diff  (last half)")
    for name, losses in runs.items():
        rel = {s: abs(losses[s] - base[s]) / abs(base[s]) for s in steps if s in losses}
        late = [r for s, r in rel.items() if s > steps[-1] / 2]
        print(
            f"{name:>10} "
            + " ".join(f"{losses[s]:8.4f}" for s in shown)
            + f"   {max(rel.values()):12.2e}  ({max(late):.2e})"
        )


if __name__ == "__main__":
    main()
