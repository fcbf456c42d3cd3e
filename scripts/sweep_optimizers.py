#!/usr/bin/env python
"""AdamW against Muon on a config: a small learning-rate sweep of each, then the best of each
side by side (equal steps, batches, tokens and seed; only ``train.optimizer`` and ``train.lr``
differ).

    python scripts/sweep_optimizers.py configs/tiny-cpu.yaml --dir runs/sweep-dense
    python scripts/sweep_optimizers.py configs/tiny-cpu-moe.yaml --dir runs/sweep-moe

Each run is one ``seqshard train`` of the config (its own steps, schedule and data) with
``train.optimizer`` and ``train.lr`` set, evaluated on ``--eval-batches`` validation batches at
the end. The sweep starts at ``--lrs``; when an optimizer's best lr is at an end of its grid,
one more lr beyond it (x3 or /3) is tried, once. Printed, and written to ``DIR/sweep.json``:
each run's final train and validation loss and its median step time (after ``--skip`` steps:
the first compiles), then per optimizer the best lr, and ``seqshard plot`` of the two best
runs to ``DIR/adamw_vs_muon.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

from seqshard.config import load_config


def _train(args, optimizer: str, lr: float) -> dict:
    name = f"{optimizer}-lr{lr:g}"
    run_dir = args.dir / name
    metrics = run_dir / "metrics.jsonl"
    done = json.loads(metrics.read_text().splitlines()[-1]) if metrics.exists() else {}
    if done.get("step") != args.steps or "val_loss" not in done:  # not run to the end
        cmd = [
            sys.executable,
            "-m",
            "seqshard.cli",
            "train",
            args.config,
            f"train.optimizer={optimizer}",
            f"train.lr={lr}",
            f"train.eval_batches={args.eval_batches}",
            "train.log_every=10",
            f"run.name={name}",
            f"run.dir={args.dir}",
            "run.trackers=[jsonl]",
            *args.overrides,
        ]
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    train = [x for x in lines if "loss" in x]
    evals = [x for x in lines if "val_loss" in x]
    times = [x["step_time_s"] for x in train if x["step"] > args.skip and "step_time_s" in x]
    return {
        "optimizer": optimizer,
        "lr": lr,
        "steps": train[-1]["step"],
        "train_loss": train[-1]["loss"],
        "val_loss": evals[-1]["val_loss"],
        "step_time_s": statistics.median(times) if times else None,
        "run_dir": str(run_dir),
    }


def _sweep(args, optimizer: str) -> list[dict]:
    lrs = sorted(args.lrs)
    runs = {lr: _train(args, optimizer, lr) for lr in lrs}
    best = min(runs.values(), key=lambda r: r["val_loss"])["lr"]
    if best in (lrs[0], lrs[-1]):  # at an end of the grid: one step beyond it
        beyond = best * 3 if best == lrs[-1] else best / 3
        runs[beyond] = _train(args, optimizer, beyond)
    return [runs[lr] for lr in sorted(runs)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--dir", type=pathlib.Path, required=True)
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--skip", type=int, default=20, help="steps left out of step times")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE for every run")
    args = parser.parse_args(argv)
    args.steps = load_config(args.config, args.overrides).train.steps
    args.dir.mkdir(parents=True, exist_ok=True)
    results = {opt: _sweep(args, opt) for opt in ("adamw", "muon")}
    print(f"{'optimizer':10} {'lr':>8} {'train':>8} {'val':>8} {'s/step':>8}")
    for runs in results.values():
        for r in runs:
            print(
                f"{r['optimizer']:10} {r['lr']:8.2g} {r['train_loss']:8.4f} {r['val_loss']:8.4f} "
                f"{r['step_time_s'] or float('nan'):8.3f}"
            )
    best = {opt: min(runs, key=lambda r: r["val_loss"]) for opt, runs in results.items()}
    for opt, r in best.items():
        print(f"best {opt}: lr {r['lr']:g}, val loss {r['val_loss']:.4f}")
    ratio = best["muon"]["step_time_s"] / best["adamw"]["step_time_s"]
    print(f"muon / adamw step time: {ratio:.3f}")
    plot = args.dir / "adamw_vs_muon.png"
    subprocess.run(
        [sys.executable, "-m", "seqshard.cli", "plot", "--out", str(plot)]
        + [best[o]["run_dir"] for o in ("adamw", "muon")],
        check=True,
    )
    (args.dir / "sweep.json").write_text(
        json.dumps({"runs": results, "best": best, "step_time_ratio": ratio}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
