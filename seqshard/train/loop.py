"""The training loop: config -> mesh -> state -> batches -> jitted step -> metrics / checkpoints.

    result = train(load_config("configs/tiny-cpu.yaml"))

A run lives in ``<run.dir>/<run.name>``: ``config.yaml`` (the resolved config), ``metrics.jsonl``,
``tb/`` (TensorBoard), ``checkpoints/<step>``. Training on a directory that holds checkpoints
resumes from the latest one, exactly (same batches, same state), on any mesh. SIGTERM or
Ctrl-C finishes the current step, writes a checkpoint, and returns cleanly.
"""

from __future__ import annotations

import dataclasses
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
import yaml

from seqshard.config import Config, ConfigError, TrainConfig, config_to_yaml
from seqshard.data import Loader, prepare, read_meta
from seqshard.flops import flops_per_token
from seqshard.hardware import peak_flops
from seqshard.mesh import training_mesh
from seqshard.train.checkpoint import Checkpointer
from seqshard.train.metrics import MetricsLogger
from seqshard.train.optimizer import lr_schedule, make_optimizer
from seqshard.train.state import TrainState, init_train_state
from seqshard.train.step import make_eval_step, make_train_step

__all__ = ["TrainResult", "ensure_data", "evaluate", "run_dir_of", "train"]

# Train-config keys that may change between a run and its resumption; anything else changing
# means another experiment, which must not write into this run's directory.
_RESUMABLE_CHANGES = {
    "mesh",
    "run",
    "train.steps",
    "train.microbatches",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.peak_flops",
}


@dataclasses.dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    step: int
    train_loss: float
    val_loss: float | None
    tokens_per_s: float
    mfu: float
    wall_s: float
    interrupted: bool


def run_dir_of(cfg: Config) -> Path:
    if not cfg.run.name:
        raise ConfigError("run.name is empty: set run.name=NAME (it names the run directory).")
    return Path(cfg.run.dir) / cfg.run.name


def ensure_data(cfg: Config, log: Callable[[str], None] = print) -> Path:
    """The prepared data directory, preparing it from ``data.inputs`` (or the stdlib) if missing."""
    data_dir = Path(cfg.data.dir)
    if not (data_dir / "meta.json").exists():
        log(f"preparing {data_dir} (first use) ...")
        prepare(
            data_dir,
            inputs=list(cfg.data.inputs) or None,
            vocab_size=cfg.data.vocab_size,
            val_fraction=cfg.data.val_fraction,
            tokenizer_path=cfg.data.tokenizer,
            log=log,
        )
    vocab = read_meta(data_dir)["vocab_size"]
    if vocab > cfg.model.vocab:
        raise ConfigError(
            f"{data_dir}/meta.json: the tokenizer has {vocab} tokens but model.vocab={cfg.model.vocab}; "
            f"ids would fall outside the embedding. Set model.vocab={vocab} (or larger, e.g. a "
            f"multiple of mesh.t), or prepare the data with a smaller tokenizer."
        )
    return data_dir


def _flatten(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _has_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a finished checkpoint (orbax names those by their step alone)."""
    ckpts = run_dir / "checkpoints"
    return ckpts.is_dir() and any(p.name.isdigit() for p in ckpts.iterdir())


def _check_run_dir(run_dir: Path, cfg: Config) -> bool:
    """True if ``run_dir`` holds a checkpoint of this run (resume); raise if of another config.

    A run directory without a finished checkpoint (a run that failed before saving) is fresh:
    nothing in it would be lost, so it does not hold its old config against a new one."""
    saved_path = run_dir / "config.yaml"
    if not saved_path.exists() or not _has_checkpoint(run_dir):
        return False
    saved = _flatten(yaml.safe_load(saved_path.read_text()) or {})
    current = _flatten(yaml.safe_load(config_to_yaml(cfg)))
    diff = [
        f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
        for k in sorted(set(saved) | set(current))
        if saved.get(k) != current.get(k)
        and k.split(".")[0] not in _RESUMABLE_CHANGES
        and k not in _RESUMABLE_CHANGES
    ]
    if diff:
        raise ConfigError(
            f"{run_dir} holds a run of another config ({'; '.join(diff)}). Choose another "
            f"run.name, resume with its own config ({saved_path}), or delete the directory."
        )
    return True


class _StopOnSignal:
    """SIGTERM / SIGINT ask the loop to checkpoint and stop after the current step."""

    def __init__(self, log: Callable[[str], None]):
        self.requested, self.log, self.previous = False, log, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.requested = True
        self.log(
            f"{signal.Signals(signum).name}: saving a checkpoint after this step, then stopping"
        )

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _schedule_change(meta: dict, t: TrainConfig, step: int) -> str | None:
    """A note when ``train.steps`` changed since the checkpoint: the lr schedule is a function
    of ``train.steps`` (cosine or WSD), so the resumed run continues on the new schedule, and
    the learning rate at ``step`` changes (a WSD run extended from its stable phase keeps
    ``lr``; a finished cosine run goes back up)."""
    saved_steps = (yaml.safe_load(meta.get("config") or "") or {}).get("train", {}).get("steps")
    if not isinstance(saved_steps, int) or saved_steps == t.steps:
        return None
    before = float(lr_schedule(dataclasses.replace(t, steps=saved_steps))(step))
    after = float(lr_schedule(t)(step))
    return (
        f"train.steps changed {saved_steps} -> {t.steps}: the {t.schedule} lr schedule now spans "
        f"{t.steps} steps; lr at step {step}: {before:.3g} -> {after:.3g}"
    )


def evaluate(eval_step, weights, batches) -> float:
    """Mean next-token loss over ``batches`` (summed losses over summed counts)."""
    totals = sum(
        np.asarray(eval_step(weights, b.tokens, b.is_seq_start), np.float64) for b in batches
    )
    return float(totals[0] / max(totals[1], 1.0))


def train(
    cfg: Config, *, log: Callable[[str], None] = print, tty: bool | None = None
) -> TrainResult:
    """Train (or resume) the run ``cfg`` describes; returns its final figures."""
    wall_start = time.perf_counter()
    run_dir, t = run_dir_of(cfg), cfg.train
    # Everything that can fail on bad input is checked before the run directory is written.
    resuming = _check_run_dir(run_dir, cfg)
    data_dir = ensure_data(cfg, log)
    mesh = training_mesh(cfg.mesh)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_to_yaml(cfg))

    opt = make_optimizer(cfg.train)
    ckpt = Checkpointer(run_dir / "checkpoints", keep=t.keep_checkpoints)
    try:
        return _train(cfg, run_dir, data_dir, mesh, opt, ckpt, resuming, log, tty, wall_start)
    finally:
        ckpt.close()


def _train(cfg, run_dir, data_dir, mesh, opt, ckpt, resuming, log, tty, wall_start) -> TrainResult:
    t = cfg.train
    if resuming:
        restored = ckpt.restore(cfg, mesh, opt)
        state, start = restored.state, int(jax.device_get(restored.state.step))
        log(f"resuming {run_dir} at step {start} on mesh d={cfg.mesh.d} x t={cfg.mesh.t}")
        note = _schedule_change(restored.meta, t, start)
        if note:
            log(note)
    else:
        restored, start = None, 0
        state = init_train_state(cfg.model, mesh, opt, jax.random.key(t.seed))
        log(f"starting {run_dir} on mesh d={cfg.mesh.d} x t={cfg.mesh.t}")

    loader = Loader(
        data_dir,
        "train",
        batch_size=t.batch_size,
        seq_len=t.seq_len,
        mesh=mesh,
        seed=cfg.data.seed,
        vocab=cfg.model.vocab,
        start_step=start,
    )
    if restored is not None:
        loader.check_state(restored.meta["loader"])
    eval_batches = list(loader.eval_batches(t.eval_batches))
    eval_step = make_eval_step(cfg, mesh)
    if start >= t.steps:
        loader.close()
        val_loss = evaluate(eval_step, state.weights, eval_batches)
        log(f"{run_dir} is already at step {start} of train.steps={t.steps}: nothing to train")
        return TrainResult(
            run_dir,
            start,
            float("nan"),
            val_loss,
            0.0,
            0.0,
            time.perf_counter() - wall_start,
            False,
        )
    step_fn = make_train_step(cfg, mesh, opt)
    n_devices = cfg.mesh.d * cfg.mesh.t
    peak = t.peak_flops * n_devices if t.peak_flops > 0 else peak_flops(n_devices)
    step_flops = flops_per_token(cfg.model, t.seq_len).total
    tokens_per_step = t.batch_size * t.seq_len

    metrics_log = MetricsLogger(run_dir, total_steps=t.steps, start_step=start, tty=tty)
    metrics_log.truncate_after(start)
    step, loss, val_loss, tokens_per_s, mfu = start, float("nan"), None, 0.0, 0.0
    try:
        with _StopOnSignal(metrics_log.message) as stop, loader:
            window_start, window_steps = time.perf_counter(), 0
            for step in range(start + 1, t.steps + 1):
                batch = next(loader)
                state, metrics = step_fn(state, batch.tokens, batch.is_seq_start)
                window_steps += 1
                if step == start + 1:  # the first step compiles: keep it out of the throughput
                    jax.block_until_ready(metrics)
                    metrics_log.message(
                        f"compiled and ran the first step in {time.perf_counter() - window_start:.1f} s"
                    )
                    window_start, window_steps = time.perf_counter(), 0
                # Read the flag once: a signal that lands after this (while logging, say)
                # stops after the next step, which then saves; breaking on it here would
                # stop without a checkpoint.
                stopping = stop.requested
                last = step == t.steps or stopping
                evaluate_now = last or (t.eval_every and step % t.eval_every == 0)
                if step % t.log_every == 0 or evaluate_now:
                    values = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    elapsed = time.perf_counter() - window_start
                    if window_steps:
                        tokens_per_s = window_steps * tokens_per_step / elapsed
                        mfu = tokens_per_s * step_flops / peak
                        values.update(
                            tokens_per_s=tokens_per_s, mfu=mfu, step_time_s=elapsed / window_steps
                        )
                    if evaluate_now:
                        val_loss = values["val_loss"] = evaluate(
                            eval_step, state.weights, eval_batches
                        )
                    loss = values["loss"]
                    metrics_log.log(step, values)
                    window_start, window_steps = time.perf_counter(), 0
                if last or (t.checkpoint_every and step % t.checkpoint_every == 0):
                    ckpt.save(state, cfg, loader.state())
                if stopping:
                    break
            interrupted = stop.requested and step < t.steps
    finally:
        metrics_log.close()
    return TrainResult(
        run_dir,
        step,
        loss,
        val_loss,
        tokens_per_s,
        mfu,
        time.perf_counter() - wall_start,
        interrupted,
    )


def latest_weights(run_dir: str | Path, cfg: Config, mesh) -> TrainState:
    """The latest checkpoint's train state of ``run_dir``, restored onto ``mesh``."""
    ckpt = Checkpointer(Path(run_dir) / "checkpoints")
    try:
        return ckpt.restore(cfg, mesh, make_optimizer(cfg.train)).state
    finally:
        ckpt.close()
