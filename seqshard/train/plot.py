"""Loss curves from ``RUN_DIR/metrics.jsonl``: ``seqshard plot RUN_DIR [RUN_DIR ...] [--out PATH]``.

Train loss is drawn as a line and val loss as markers in the same colour, one colour per run,
labelled by the run dir's name. The figure is rendered with matplotlib's Agg canvas directly
(``matplotlib.figure.Figure``), so pyplot's global backend and figure list are never touched.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from seqshard.train.metrics import METRICS_FILE, read_metrics

__all__ = ["plot_runs"]


def plot_runs(
    run_dirs: Sequence[str | os.PathLike[str]], out_path: str | os.PathLike[str] | None = None
) -> Path:
    """Write a PNG of train loss (lines) and val loss (markers) vs step; returns its path.

    ``out_path`` defaults to ``RUN_DIR/loss.png`` for one run and ``./loss_compare.png`` for
    several. Raises FileNotFoundError / ValueError naming the run dir when its metrics.jsonl is
    missing or holds no loss.
    """
    if isinstance(run_dirs, (str, os.PathLike)):
        raise TypeError(f"plot_runs: run_dirs must be a list of run dirs, got {run_dirs!r}.")
    if not run_dirs:
        raise ValueError("plot_runs: got no run dirs; pass at least one.")
    dirs = [Path(d) for d in run_dirs]
    curves = [_loss_curves(d) for d in dirs]
    if out_path is None:
        out_path = dirs[0] / "loss.png" if len(dirs) == 1 else Path.cwd() / "loss_compare.png"
    out_path = Path(out_path)

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    colors = [f"C{i % 10}" for i in range(len(dirs))]
    for label, (train, val), color in zip(_labels(dirs), curves, colors, strict=True):
        if train[0]:
            ax.plot(*train, color=color, linewidth=1.2, label=f"{label} train")
        if val[0]:
            ax.plot(*val, color=color, linestyle="none", marker="o", markersize=4,
                    label=f"{label} val")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title("loss" if len(dirs) == 1 else "loss comparison")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png")
    return out_path


def _loss_curves(run_dir: Path) -> tuple[tuple[list[int], list[float]], ...]:
    """((train steps, losses), (val steps, val losses)), last record per step winning."""
    if not run_dir.is_dir():
        raise FileNotFoundError(f"plot: run dir {str(run_dir)!r} does not exist.")
    records = read_metrics(run_dir)
    # A run resumed without truncate_after repeats steps; the later (resumed) value wins,
    # so the curve does not double back.
    by_step: dict[int, dict[str, Any]] = {}
    for record in records:
        by_step.setdefault(record["step"], {}).update(record)
    steps = sorted(by_step)
    train = [(s, by_step[s]["loss"]) for s in steps if "loss" in by_step[s]]
    val = [(s, by_step[s]["val_loss"]) for s in steps if "val_loss" in by_step[s]]
    if not train and not val:
        what = "is empty" if not records else "has no 'loss' or 'val_loss' values"
        raise ValueError(
            f"plot: {run_dir / METRICS_FILE} {what}; run dir {str(run_dir)!r} has nothing to "
            f"plot yet (did the run log a step?)."
        )
    return _unzip(train), _unzip(val)


def _unzip(points: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    return [s for s, _ in points], [v for _, v in points]


def _labels(dirs: list[Path]) -> list[str]:
    """Run dir names; the full paths where two runs share a name."""
    names = [d.resolve().name or str(d) for d in dirs]
    if len(set(names)) == len(names):
        return names
    return [str(d) for d in dirs]
