"""Fake runs' metrics for the metrics and plot tests."""

from pathlib import Path

from seqshard.train.metrics import MetricsLogger, read_metrics


def _metrics(step: int) -> dict[str, float]:
    return {
        "loss": 5.0 / step,
        "lr": 1e-3,
        "grad_norm": 0.5,
        "tokens_per_s": 4512.0,
        "mfu": 0.012,
        "step_time_s": 0.91,
    }


def _write_run(run_dir: Path, steps: range, *, val_every: int = 0) -> None:
    with MetricsLogger(run_dir, total_steps=steps.stop, tty=False) as log:
        for step in steps:
            metrics = _metrics(step)
            if val_every and step % val_every == 0:
                metrics["val_loss"] = 6.0 / step
            log.log(step, metrics)


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir)]
