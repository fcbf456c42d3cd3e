"""Loss curves from ``RUN_DIR/metrics.jsonl``: ``seqshard plot RUN_DIR [RUN_DIR ...] [--out PATH]``.

Train loss is drawn as a line and val loss as markers in the same colour, one colour per run,
labelled by the run dir's name; a run that scored ``eval.tasks`` gets a second panel of each
task's accuracy (solid) and normalized accuracy (dashed) over the steps. A run with experts
also gets ``RUN_DIR/expert_load.png``
(:func:`plot_expert_load`): each MoE layer's experts over the steps, coloured by load over
the mean. The figures are rendered with matplotlib's Agg canvas directly
(``matplotlib.figure.Figure``), so pyplot's global backend and figure list are never touched.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from seqshard.evals.tasks import task_of_figure
from seqshard.train.metrics import METRICS_FILE, read_metrics

__all__ = ["EXPERT_LOAD_FILE", "expert_loads", "plot_expert_load", "plot_runs"]

EXPERT_LOAD_FILE = "expert_load.png"


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

    tasks = [_task_curves(d) for d in dirs]
    fig = Figure(figsize=(13, 5) if any(tasks) else (8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1) if any(tasks) else fig.add_subplot()
    colors = [f"C{i % 10}" for i in range(len(dirs))]
    if any(tasks):  # eval.tasks' accuracies beside the losses
        right = fig.add_subplot(1, 2, 2)
        for label, curves_of_run, color in zip(_labels(dirs), tasks, colors, strict=True):
            for key, (steps, values) in curves_of_run.items():
                style = "--" if key.endswith("_norm") else "-"
                right.plot(steps, values, color=color, linestyle=style, marker="o", markersize=3,
                           label=f"{label} {key}")  # fmt: skip
        right.set_xlabel("step")
        right.set_ylabel("accuracy")
        right.set_title("eval.tasks")
        right.grid(True, alpha=0.3)
        right.legend(fontsize="small")
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


def _task_curves(run_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """``'<task> acc'`` and ``'<task> acc_norm'`` -> (steps, values): the run's eval.tasks."""
    out: dict[str, list[tuple[int, float]]] = {}
    for record in read_metrics(run_dir):
        for key, value in record.items():
            task = task_of_figure(key)
            if task and task[1] in ("acc", "acc_norm"):
                out.setdefault(" ".join(task), []).append((record["step"], value))
    return {k: _unzip(v) for k, v in out.items()}


def _unzip(points: list[tuple[int, float]]) -> tuple[list[int], list[float]]:
    return [s for s, _ in points], [v for _, v in points]


def _labels(dirs: list[Path]) -> list[str]:
    """Run dir names; the full paths where two runs share a name."""
    names = [d.resolve().name or str(d) for d in dirs]
    if len(set(names)) == len(names):
        return names
    return [str(d) for d in dirs]


def expert_loads(run_dir: str | os.PathLike[str]) -> tuple[list[int], dict[int, list[list[float]]]]:
    """(the logged steps, {MoE layer: [expert][step] its share of the layer's token copies})
    from ``RUN_DIR/metrics.jsonl``'s ``moe_load/<layer>/<expert>`` values; empty for a run
    without experts. A resumed run's later record of a step wins."""
    by_step: dict[int, dict[str, Any]] = {}
    for record in read_metrics(Path(run_dir)):
        by_step.setdefault(record["step"], {}).update(record)
    cells: dict[tuple[int, int], dict[int, float]] = {}
    for step, record in by_step.items():
        for key, value in record.items():
            parts = key.split("/")
            if parts[0] == "moe_load" and len(parts) == 3:
                cells.setdefault((int(parts[1]), int(parts[2])), {})[step] = value
    steps = sorted({s for by in cells.values() for s in by})
    nan = float("nan")
    layers: dict[int, list[list[float]]] = {}
    for layer, expert in sorted(cells):
        layers.setdefault(layer, []).append([cells[layer, expert].get(s, nan) for s in steps])
    return steps, layers


def plot_expert_load(
    run_dir: str | os.PathLike[str], out_path: str | os.PathLike[str] | None = None
) -> Path:
    """Write a PNG heatmap of each MoE layer's expert load over the logged steps (one panel
    per layer, experts down, steps across, colour the load over the layer's mean: 1 is
    balanced, 2 an expert taking twice its share); returns its path (default
    ``RUN_DIR/expert_load.png``). ValueError naming the run when it logged no expert load."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"plot: run dir {str(run_dir)!r} does not exist.")
    steps, layers = expert_loads(run_dir)
    if not layers:
        raise ValueError(
            f"plot: {run_dir / METRICS_FILE} holds no expert load (moe_load/<layer>/<expert>); "
            f"run dir {str(run_dir)!r} is not a run with experts (model.moe.n_experts > 0) or "
            f"has logged no step yet."
        )
    out_path = Path(out_path) if out_path is not None else run_dir / EXPERT_LOAD_FILE

    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    relative = {k: np.asarray(v) * len(v) for k, v in layers.items()}  # share x E: 1 balanced
    top = max(2.0, max(float(np.nanmax(r)) for r in relative.values()))
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=top)
    cols = math.ceil(math.sqrt(len(relative)))
    rows = math.ceil(len(relative) / cols)
    fig = Figure(figsize=(4 * cols + 1, 3 * rows + 0.5), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    image = None
    for ax, (layer, load) in zip(axes.flat, relative.items(), strict=False):  # spare panels
        image = ax.imshow(load, aspect="auto", interpolation="nearest", cmap="RdBu_r", norm=norm,
                          extent=(steps[0] - 0.5, steps[-1] + 0.5, load.shape[0] - 0.5, -0.5))  # fmt: skip
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("step")
        ax.set_ylabel("expert")
    for ax in list(axes.flat)[len(relative) :]:
        ax.set_visible(False)
    fig.colorbar(image, ax=axes, label="load / mean (1 = balanced)")
    fig.suptitle(f"{run_dir.resolve().name}: expert load")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, format="png")
    return out_path
