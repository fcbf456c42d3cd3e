"""The training loop: config -> mesh -> state -> batches -> jitted step -> metrics / checkpoints.

    result = train(load_config("configs/tiny-cpu.yaml"))

A run lives in ``<run.dir>/<run.name>``: ``config.yaml`` (the resolved config),
``metrics.jsonl``, ``tb/`` (TensorBoard) and the other ``run.trackers``
(:mod:`seqshard.train.trackers`), ``log.txt`` (every note the run printed, warnings included),
``checkpoints/<step>``, ``profile/`` (with ``train.profile``), and ``run.json`` (the
resolved data directory it trains on, so ``seqshard eval`` and ``generate`` find it from
anywhere). Training on a directory that holds checkpoints resumes from the latest good one,
exactly (same batches, same state), on any mesh. SIGTERM or Ctrl-C finishes the current step,
writes a checkpoint, and returns cleanly; before the first step it returns at once.

A fresh run with ``init.from_hf`` starts from a Hugging Face model's weights, which this
package does not read (seqshard.train and seqshard.hf do not import each other): the caller
passes the loader, as `seqshard train` does (``seqshard.cli.hf_initial_weights``)::

    train(cfg, initial_weights=hf_initial_weights)   # (cfg, mesh, log) -> Weights
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import optax
import yaml
from jax.sharding import Mesh

from seqshard.config import (
    Config,
    ConfigError,
    TrainConfig,
    config_changes,
    config_from_yaml,
    config_to_yaml,
    read_run_config,
)
from seqshard.data import Loader, path_corpus, prepare, read_meta, stdlib_corpus, tokenizer_hash
from seqshard.data.mixture import Mixture, mixture_of
from seqshard.data.prepare import PrepareConfig
from seqshard.data.sft import find_chat_template
from seqshard.evals.configured import make_task_eval, timed
from seqshard.evals.tasks import task_of_figure
from seqshard.hardware import peak_flops
from seqshard.launch import agree_any, barrier, is_main_process, process_label
from seqshard.mesh import training_mesh
from seqshard.model.cost import flops_per_token
from seqshard.model.weights import Weights, init_weights, weight_structs
from seqshard.train.checkpoint import (
    Checkpointer,
    CheckpointError,
    checkpoint_steps,
    latest_state,
    step_directories,
)
from seqshard.train.metrics import (
    METRICS_FILE,
    MetricsLogger,
    RunLog,
    SilentMetricsLogger,
    show,
    warnings_as_notes,
)
from seqshard.train.optimizer import lr_schedule, make_optimizer
from seqshard.train.profile import PROFILE_DIR, ProfileWindow
from seqshard.train.run_files import RunWriteError, atomic_write_text
from seqshard.train.run_lock import RunLock, RunLockedError
from seqshard.train.state import (
    NONFINITE_KINDS,
    NonfiniteGuard,
    TrainState,
    init_train_state,
    layer_order,
    relayered,
)
from seqshard.train.step import make_eval_step, make_train_step
from seqshard.train.trackers import open_trackers, require_trackers
from seqshard.train.validation import evaluate, make_validate

__all__ = [
    "RUN_INFO",
    "run_weights",
    "data_mixture",
    "InitialWeights",
    "NonfiniteError",
    "StopRequested",
    "TrainResult",
    "ensure_data",
    "evaluate",
    "read_run_info",
    "run_dir_of",
    "train",
    "with_run_data",
]

# Train-config keys that may change between a run and its resumption; anything else changing
# means another experiment, which must not write into this run's directory.
_RESUMABLE_CHANGES = {
    "mesh",
    "run",
    "runtime",
    "model.backward",  # the same gradients, written by hand or by autodiff
    "model.residual",  # the same model, its residual in another layout
    "train.steps",
    "train.microbatches",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.peak_flops",
    "train.resume",
    "train.nonfinite",
    "train.max_nonfinite_skips",
    "train.eval_on_stop",
    "train.profile",
}


RUN_INFO = "run.json"
"""A run directory's record of where its inputs are, resolved when it started:
``{"data_dir": "/abs/path"}``, and for a mixture ``"sources": {"data/web": "/abs/data/web"}``
(each source as the config writes it)."""


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What one call of :func:`train` did."""

    run_dir: Path
    step: int  # the step the run is at now
    train_loss: float | None  # the last logged train loss; None when no step ran or it
    # counted no token (a batch of fine-tuning prompts alone)
    val_loss: float | None  # the last validation loss; None if none ran or it counted no token
    tokens_per_s: float  # over the last logging window (0 when no step ran)
    mfu: float
    wall_s: float  # of this call, start-up included
    interrupted: bool = False  # SIGTERM / Ctrl-C stopped it before train.steps
    already_finished: bool = False  # the run was at train.steps already: nothing trained
    steps_run: int = 0  # steps this call trained
    tasks: dict = dataclasses.field(default_factory=dict)  # the last eval.tasks scores
    #   ('task/<name>/acc': ...), empty without tasks


@dataclasses.dataclass(frozen=True)
class _Run:
    """What one call of :func:`train` works with, set up before the first step."""

    cfg: Config
    run_dir: Path
    data_dir: Path
    mesh: Mesh
    opt: optax.GradientTransformation
    ckpt: Checkpointer
    log: Callable[[str], None]
    tty: bool | None
    started: float  # time.perf_counter() when train was called


def run_dir_of(cfg: Config) -> Path:
    if not cfg.run.name:
        raise ConfigError("run.name is empty: set run.name=NAME (it names the run directory).")
    return Path(cfg.run.dir) / cfg.run.name


def data_mixture(cfg: Config) -> Mixture | None:
    """``data.mixture`` and ``data.stages`` as one Mixture (None: the run reads ``data.dir``);
    ConfigError for bad weights or steps."""
    try:
        return mixture_of(cfg.data.mixture, cfg.data.stages)
    except ValueError as e:
        raise ConfigError(f"data.mixture / data.stages: {e}") from None


def ensure_data(
    cfg: Config, log: Callable[[str], None] = print, prepare_missing: bool = True
) -> Path:
    """The prepared data directory, preparing it from ``data.inputs`` (or the stdlib) if missing
    (and ``prepare_missing``: in a multi-process run process 0 prepares, the others read).
    With ``data.mixture``: each source checked (never prepared here); the first one's path."""
    mixture = data_mixture(cfg)
    if mixture is not None:
        for source in mixture.sources:
            _check_prepared(Path(source.path), cfg, f"data.mixture source {source.path}")
        return Path(mixture.sources[0].path)
    data_dir = Path(cfg.data.dir)
    if not (data_dir / "meta.json").exists() and not prepare_missing:
        raise ConfigError(
            f"data.dir={data_dir} holds no prepared data on this host{process_label()}, though "
            f"process 0 has it: every process reads its own rows. Put data.dir on a filesystem "
            f"every host sees, or copy the directory to the same path on each host."
        )
    if not (data_dir / "meta.json").exists():
        if data_dir.is_file() or (data_dir.is_dir() and any(data_dir.iterdir())):
            raise ConfigError(
                f"data.dir={data_dir} exists but is not a prepared data directory (no meta.json), "
                f"and seqshard will not write over it. Point data.dir at a directory that "
                f"`seqshard prepare` wrote, or at a new path to prepare it there."
            )
        log(f"preparing {data_dir} (first use) ...")
        data = cfg.data
        prepare_config = PrepareConfig(
            vocab_size=data.vocab_size,
            val_fraction=data.val_fraction,
            tokenizer_path=data.tokenizer,
        )
        template = find_chat_template(data.chat_template, data.tokenizer)
        prepare(
            data_dir,
            path_corpus(data.inputs, chat_template=template) if data.inputs else stdlib_corpus(),
            prepare_config,
            log=log,
            overwrite=True,  # at most an empty directory: nothing to lose
        )
    _check_prepared(data_dir, cfg, f"data.dir={data_dir}")
    return data_dir


def _check_prepared(data_dir: Path, cfg: Config, what: str) -> None:
    """A prepared directory fits the config: its tokenizer is data.tokenizer (when given) and
    its vocabulary fits the model's."""
    if not (data_dir / "meta.json").exists():
        raise ConfigError(
            f"{what} holds no prepared data (no {data_dir / 'meta.json'}); mixture sources are "
            f"not prepared on first use: run `seqshard prepare --out {data_dir} --tokenizer "
            f"TOKENIZER.json INPUTS...` with the tokenizer the other sources share."
        )
    meta = read_meta(data_dir)
    if cfg.data.tokenizer is not None and Path(cfg.data.tokenizer).is_file():
        want = tokenizer_hash(cfg.data.tokenizer)
        if meta.get("tokenizer_sha256") not in (None, want):
            raise ConfigError(
                f"{what} was tokenized with {meta.get('tokenizer_source')}, not "
                f"data.tokenizer={cfg.data.tokenizer} (the files differ): the ids would mean "
                f"other tokens. Point data.dir at a new directory to prepare it with this tokenizer."
            )
    vocab = meta["vocab_size"]
    if vocab > cfg.model.vocab:
        raise ConfigError(
            f"{data_dir}/meta.json: the tokenizer has {vocab} tokens but model.vocab={cfg.model.vocab}; "
            f"ids would fall outside the embedding. Set model.vocab={vocab} (or larger, e.g. a "
            f"multiple of mesh.t), or prepare the data with a smaller tokenizer."
        )


def _has_checkpoint(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds a step directory with anything in it (a complete checkpoint,
    or one damaged that restore must skip or refuse by name rather than a new run overwrite)."""
    return bool(step_directories(run_dir / "checkpoints"))


def _check_run_dir(run_dir: Path, cfg: Config) -> bool:
    """True if ``run_dir`` holds a checkpoint of this run (resume); raise if it holds another
    run's work.

    A directory holding step checkpoints or metrics is never taken for a fresh run: its
    checkpoints would be pruned and its metrics truncated under a config they were not
    trained with. Each saved config there (``config.yaml``, and the newest readable
    checkpoint's own, which is what a resume continues) must equal ``cfg`` in every key that
    changes the trajectory. A directory with neither (a run that failed before logging a
    step) is fresh: nothing in it would be lost."""
    has_checkpoint = _has_checkpoint(run_dir)
    metrics = run_dir / METRICS_FILE
    has_metrics = metrics.is_file() and metrics.stat().st_size > 0
    if not has_checkpoint and not has_metrics:
        return False
    saved: dict[str, Config] = {}
    if (run_dir / "config.yaml").is_file():
        saved[str(run_dir / "config.yaml")] = read_run_config(run_dir)
    if has_checkpoint:
        saved.update(_checkpoint_config(run_dir / "checkpoints"))
    if not saved:
        held = "step checkpoints" if has_checkpoint else METRICS_FILE
        raise ConfigError(
            f"{run_dir} holds {held} but no config.yaml and no checkpoint whose saved config "
            f"can be read, so seqshard cannot tell whether it is this run's work, and will not "
            f"truncate or prune it. Choose another run.name, or move the directory away."
        )
    for source, old in saved.items():
        changes = config_changes(old, cfg)
        diff = [
            f"{k}: {was!r} -> {now!r}"
            for k, (was, now) in changes.items()
            if not any(k == r or k.startswith(r + ".") for r in _RESUMABLE_CHANGES)
        ]
        if diff:
            raise ConfigError(
                f"{run_dir} holds a run of another config ({'; '.join(diff)}; saved in "
                f"{source}). Choose another run.name, resume with the run's own config, or "
                f"delete the directory."
            )
    return has_checkpoint


def _checkpoint_config(directory: Path) -> dict[str, Config]:
    """{where: config} of the newest complete checkpoint in ``directory`` whose metadata reads
    (the one a resume starts from, unless its arrays turn out damaged); {} if none does."""
    ckpt = Checkpointer(directory, read_only=True, log=lambda _: None)
    try:
        for step in reversed(checkpoint_steps(directory)):
            try:
                meta = ckpt.read_meta(step)
            except CheckpointError:
                continue
            where = f"checkpoint {directory / str(step)}"
            return {where: config_from_yaml(meta["config"], f"{where} metadata")}
        return {}
    finally:
        ckpt.close()


def _write_run_files(run_dir: Path, cfg: Config, data_dir: Path) -> None:
    """The resolved config, and where the run's data is (each replaced whole: a kill or a full
    disk leaves the old file or the new one)."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunWriteError(run_dir, e, 0) from None
    atomic_write_text(run_dir / "config.yaml", config_to_yaml(cfg))
    info: dict[str, Any] = {"data_dir": str(data_dir.resolve())}
    mixture = data_mixture(cfg)
    if mixture is not None:  # each source as the config writes it -> where it resolved
        info["sources"] = {s.path: str(Path(s.path).resolve()) for s in mixture.sources}
    atomic_write_text(run_dir / RUN_INFO, json.dumps(info, indent=1) + "\n")


def read_run_info(run_dir: str | Path) -> dict[str, Any] | None:
    """``RUN_DIR/run.json`` (see :data:`RUN_INFO`), checked; None if the run has none (a run of
    an older seqshard: its config's own paths are used). ConfigError naming the file, what it
    should hold and the fix if it is unreadable or incomplete."""
    path = Path(run_dir) / RUN_INFO
    if not path.is_file():
        return None
    fix = (
        "`seqshard train` writes it again at the next start; until then pass the data the run "
        "trained on as an override (data.dir=DIR, or data.mixture=[...] for a mixture)."
    )
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(
            f'{path} is not readable JSON ({e}); expected {{"data_dir": "/abs/path"}}. {fix}'
        ) from None
    sources = info.get("sources", {}) if isinstance(info, dict) else None
    if (
        not isinstance(info, dict)
        or not isinstance(info.get("data_dir"), str)
        or not isinstance(sources, dict)
        or not all(isinstance(v, str) for v in sources.values())
    ):
        raise ConfigError(
            f'{path} holds {json.dumps(info)[:120]}; expected {{"data_dir": "/abs/path"}} '
            f'(and "sources": {{path: /abs/path}} for a mixture). {fix}'
        )
    return info


def with_run_data(cfg: Config, run_dir: str | Path) -> Config:
    """``cfg`` reading the data the run in ``run_dir`` trained on, wherever it is read from:
    ``data.dir`` and every mixture source as ``run.json`` recorded them resolved (a relative
    path in the config meant the directory `seqshard train` ran in)."""
    info = read_run_info(run_dir)
    if info is None:
        return cfg
    sources = info.get("sources", {})

    def moved(source):
        return dataclasses.replace(source, path=sources.get(str(source.path), source.path))

    data = cfg.data
    data = dataclasses.replace(
        data,
        dir=info["data_dir"],
        mixture=tuple(moved(s) for s in data.mixture),
        stages=tuple(
            dataclasses.replace(st, mixture=tuple(moved(s) for s in st.mixture))
            for st in data.stages
        ),
    )
    return dataclasses.replace(cfg, data=data)


def _newest_checkpoint(directory: Path, ckpt: Checkpointer | None = None) -> str:
    """A sentence naming the newest complete checkpoint in ``directory`` (after the save in
    flight, if any, has finished or failed)."""
    if ckpt is not None:
        with contextlib.suppress(CheckpointError):  # a save that failed too: it says so itself
            ckpt.wait()
    steps = checkpoint_steps(directory)
    if not steps:
        return "There is no checkpoint yet: the run starts again from step 0."
    return (
        f"The newest intact checkpoint is {directory / str(steps[-1])} (step {steps[-1]}), "
        f"where resuming starts."
    )


class StopRequested(BaseException):
    """SIGTERM or Ctrl-C before the first step finished: there is nothing to save. A
    BaseException, like KeyboardInterrupt, so that no library's ``except Exception`` (during
    restore, data preparation, compilation) swallows it."""


class NonfiniteError(RuntimeError):
    """Training stopped on a non-finite loss or gradient norm (``train.nonfinite``)."""

    exit_code = 3  # `seqshard train`'s exit status for it


class _StopOnSignal:
    """SIGTERM / SIGINT, from the moment :func:`train` starts.

    Before the first step has run (start-up, data preparation, restore, the first compile)
    the handler raises :class:`StopRequested`: nothing is lost by stopping there. Once the
    loop is ``armed`` it only sets ``requested``: the loop saves a checkpoint at the current
    step boundary and stops (a second Ctrl-C stops at once)."""

    def __init__(self, log: Callable[[str], None]):
        self.requested, self.armed, self.log, self.previous = False, False, log, {}
        self.early: str | None = None  # a signal before arming, even if its exception was lost

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)
        self.unraisable, sys.unraisablehook = sys.unraisablehook, self._quiet
        return self

    def _quiet(self, unraisable) -> None:
        """A stop request raised where it cannot propagate (inside a ``__del__``) is not an
        error to print: ``early`` still stops the run after the first compile."""
        if not isinstance(unraisable.exc_value, StopRequested):
            self.unraisable(unraisable)

    def _handle(self, signum, frame):
        name = signal.Signals(signum).name
        if not self.armed:
            self.early = name
            raise StopRequested(name)
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.requested = True
        self.log(f"{name}: saving a checkpoint after this step, then stopping")

    def __exit__(self, *exc):
        sys.unraisablehook = self.unraisable
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def _schedule_change(saved: TrainConfig, train_cfg: TrainConfig, step: int) -> str | None:
    """A note when ``train.steps`` changed since the checkpoint: the lr schedule is a function
    of ``train.steps`` (cosine or WSD), so the resumed run continues on the new schedule, and
    the learning rate at ``step`` changes (a WSD run extended from its stable phase keeps
    ``lr``; a finished cosine run goes back up)."""
    if saved.steps == train_cfg.steps:
        return None
    before = float(lr_schedule(dataclasses.replace(train_cfg, steps=saved.steps))(step))
    after = float(lr_schedule(train_cfg)(step))
    return (
        f"train.steps changed {saved.steps} -> {train_cfg.steps}: the {train_cfg.schedule} lr schedule now spans "
        f"{train_cfg.steps} steps; lr at step {step}: {before:.3g} -> {after:.3g}"
    )


class _Throughput:
    """Tokens/s and MFU over a window of steps: the steps since the last log line."""

    def __init__(self, tokens_per_step: int, flops_per_token: int, peak: float):
        self.tokens_per_step, self.flops_per_token, self.peak = (
            tokens_per_step,
            flops_per_token,
            peak,
        )
        self.restart()

    def restart(self) -> None:
        self.start, self.steps = time.perf_counter(), 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def take(self) -> dict[str, float]:
        """The window's figures (none for an empty window), and a new window."""
        elapsed, steps = self.elapsed(), self.steps
        self.restart()
        if not steps:
            return {}
        tokens_per_s = steps * self.tokens_per_step / elapsed
        return {
            "tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s * self.flops_per_token / self.peak,
            "step_time_s": elapsed / steps,
        }


def _every(interval: int, step: int) -> bool:
    """Whether a periodic action (interval 0: never) falls on ``step``."""
    return bool(interval) and step % interval == 0


InitialWeights = Callable[[Config, Mesh, Callable[[str], None]], Weights]
"""``(cfg, mesh, log) -> weights`` of a fresh run with ``init.from_hf``, in the model's layer
order, sharded on ``mesh`` (``seqshard.cli.hf_initial_weights``)."""


def train(
    cfg: Config,
    *,
    log: Callable[[str], None] = show,
    tty: bool | None = None,
    initial_weights: InitialWeights | None = None,
) -> TrainResult:
    """Train (or resume) the run ``cfg`` describes; returns its final figures.

    A fresh run starts from ``initial_weights(cfg, mesh, log)`` when ``init.from_hf`` is set
    (required then: ``seqshard.cli.hf_initial_weights`` reads the Hugging Face directory),
    from random weights otherwise.

    Raises :class:`NonfiniteError` when ``train.nonfinite`` says to stop on a non-finite step
    (nothing is saved after it), and ConfigError / CheckpointError on bad input.

    ``log`` shows each note of the run (by default on stdout, above the progress bar), every
    Python warning raised meanwhile among them (``warning: ...``); process 0 also appends them
    to ``RUN_DIR/log.txt`` (:class:`~seqshard.train.metrics.RunLog`).

    A signal before the first step returns a result with ``interrupted`` set and no step run;
    it may have landed in a compile, which XLA then finishes on its own threads: a program
    that ends after such a stop should end without the interpreter's teardown, as `seqshard
    train` does (``os._exit``; see ``seqshard.cli``)."""
    started = time.perf_counter()
    if cfg.init.from_hf and initial_weights is None:
        raise ConfigError(
            f"init.from_hf={cfg.init.from_hf}: train() does not read Hugging Face weights "
            f"itself; pass initial_weights=seqshard.cli.hf_initial_weights (which reads them "
            f"with seqshard.hf.load.load_hf_weights), or run `seqshard train CONFIG`."
        )
    if not is_main_process():  # every process runs the run; process 0 reports it
        log = _quiet
    notes = RunLog(log)  # and into log.txt once the run has written its config.yaml
    with _StopOnSignal(notes) as stop, warnings_as_notes(notes):
        try:
            return _train(cfg, stop, notes, tty, started, initial_weights)
        except Exception:
            if stop.early is None or stop.armed:
                raise
            # The stop request landed inside a library that turned it into its own error.
            notes(f"{stop.early}: stopping before the first step; nothing to save")
            return _stopped_early(cfg, started)
        except StopRequested as e:
            notes(f"{e}: stopping before the first step; nothing to save")
            return _stopped_early(cfg, started)
        finally:
            notes.close()


def _quiet(message: str) -> None:
    """The log of a process other than 0."""


def _stopped_early(cfg: Config, started: float) -> TrainResult:
    return TrainResult(
        run_dir=run_dir_of(cfg),
        step=0,  # not known yet (a resume had not restored); nothing ran
        train_loss=None,
        val_loss=None,
        tokens_per_s=0.0,
        mfu=0.0,
        wall_s=time.perf_counter() - started,
        interrupted=True,
    )


def _train(
    cfg: Config,
    stop: _StopOnSignal,
    log: RunLog,
    tty,
    started: float,
    initial_weights: InitialWeights | None,
) -> TrainResult:
    run_dir = run_dir_of(cfg)
    # Everything that can fail on bad input is checked before the run directory is written.
    require_trackers(cfg.run.trackers)
    resuming = _check_run_dir(run_dir, cfg)
    if cfg.init.from_run and not resuming:  # a run directory, or stop before writing anything
        try:
            read_run_config(cfg.init.from_run)
        except ConfigError as e:
            raise ConfigError(f"init.from_run={cfg.init.from_run}: {e}") from None
    lock = _lock_run_dir(run_dir, log)
    try:
        return _train_locked(cfg, stop, log, tty, started, resuming, initial_weights)
    finally:
        if lock is not None:
            lock.release()


def _lock_run_dir(run_dir: Path, log) -> RunLock | None:
    """Process 0, the run's one writer, takes the run directory's lock; every process stops if
    it could not (another training writes there)."""
    lock, error = None, None
    if is_main_process():
        try:
            lock = RunLock.acquire(run_dir, log=log)
        except RunLockedError as e:
            error = e
    if agree_any(error is not None):
        if lock is not None:
            lock.release()
        raise error or RunLockedError(
            f"{run_dir}: process 0 could not lock the run directory (another training writes "
            f"there); its message says which."
        )
    return lock


def _train_locked(
    cfg: Config,
    stop,
    log: RunLog,
    tty,
    started: float,
    resuming: bool,
    initial_weights: InitialWeights | None,
) -> TrainResult:
    run_dir = run_dir_of(cfg)
    if is_main_process():  # prepares the data directory on first use; the others wait
        ensure_data(cfg, log)
    barrier("seqshard: data prepared")
    data_dir = ensure_data(cfg, log, prepare_missing=False)
    mesh = training_mesh(cfg.mesh.sizes())
    if is_main_process():
        try:
            _write_run_files(run_dir, cfg, data_dir)
            log.open(run_dir)  # log.txt, with the notes so far
        except RunWriteError as e:
            raise e.with_checkpoint(_newest_checkpoint(run_dir / "checkpoints")) from None
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep_checkpoints, log=log)
    try:
        opt = make_optimizer(cfg.train, cfg.model, mesh)
        run = _Run(cfg, run_dir, data_dir, mesh, opt, ckpt, log, tty, started)
        state, start, meta = _initial_state(run, resuming, initial_weights)
        loader = Loader(
            data_mixture(cfg) or data_dir,
            "train",
            batch_size=cfg.train.batch_size,
            seq_len=cfg.train.seq_len,
            mesh=mesh,
            seed=cfg.data.seed,
            vocab=cfg.model.vocab,
            start_step=start,
        )
        with loader:
            if meta is not None:
                loader.check_state(meta["loader"])
            _warn_of_long_prompts(loader, cfg.train.seq_len, log)
            validate = make_validate(loader, make_eval_step(cfg, mesh), cfg.train.eval_batches)
            validate = _with_tasks(validate, cfg, mesh, data_dir)
            if start >= cfg.train.steps:
                loader.close()
                return _finished_already(run, state, start, validate)
            return _train_steps(run, state, start, loader, validate, stop)
    except RunWriteError as e:  # metrics, TensorBoard: say where the run can resume
        raise e.with_checkpoint(_newest_checkpoint(ckpt.directory, ckpt)) from None
    finally:
        ckpt.close()


def _warn_of_long_prompts(loader: Loader, seq_len: int, log: Callable[[str], None]) -> None:
    """A note for each fine-tuning source whose records have prompts of ``seq_len`` tokens or
    more: their rows inside the prompt count no token (a step of such rows has no loss), and
    each completion is learned without the start of its prompt."""
    for split in loader.splits:
        long, seen = split.long_prompts(seq_len)
        if long:
            share = "" if seen == split.n_docs else f" (a sample of {seen} of {split.n_docs})"
            log(
                f"warning: {long} of {seen} fine-tuning records in {split.data_dir}{share} "
                f"have a prompt of train.seq_len={seq_len} tokens or more: no row holds such a "
                f"prompt with its completion, so the completion is learned without the start of "
                f"its prompt, and rows inside the prompt count no token (their loss shows as "
                f"n/a). Raise train.seq_len or shorten the prompts."
            )


def _initial_state(
    run: _Run, resuming: bool, initial_weights: InitialWeights | None
) -> tuple[TrainState, int, dict[str, Any] | None]:
    """(state, its step, the checkpoint's metadata or None): restored, or freshly initialized
    (from ``initial_weights`` with init.from_hf, which :func:`train` has checked is given)."""
    cfg = run.cfg
    if not resuming:
        key = jax.random.key(cfg.train.seed)
        if cfg.init.from_hf:
            weights = initial_weights(cfg, run.mesh, run.log)
        elif cfg.init.from_run:
            weights = run_weights(cfg, run.mesh, run.log)
        else:
            weights = init_weights(cfg.model, run.mesh, key)
        # In the model's layer order; the circular pipeline stores every p-th block per stage.
        order = layer_order(cfg, run.mesh.shape["p"])
        weights = relayered(weights, range(cfg.model.n_layers), order)
        state = init_train_state(cfg.model, run.mesh, run.opt, key, weights)
        run.log(f"starting {run.run_dir} on mesh {run.cfg.mesh.describe()}")
        return state, 0, None
    restored = run.ckpt.restore(cfg, run.mesh, run.opt)
    start = int(jax.device_get(restored.state.step))
    run.log(f"resuming {run.run_dir} at step {start} on mesh {run.cfg.mesh.describe()}")
    saved = config_from_yaml(restored.meta["config"], f"checkpoint {start} metadata")
    note = _schedule_change(saved.train, cfg.train, start)
    if note:
        run.log(note)
    return restored.state, start, restored.meta


def run_weights(cfg: Config, mesh: Mesh, log: Callable[[str], None]) -> Weights:
    """``init.from_run``: the weights of that run's newest good checkpoint, in the model's layer
    order, on ``mesh``. ConfigError if it is not a run directory or its weights have other
    shapes (naming the model keys that differ)."""
    source = Path(cfg.init.from_run)
    other = read_run_config(source)
    mine, theirs = weight_structs(cfg.model), weight_structs(other.model)
    if jax.tree.map(lambda s: (s.shape, s.dtype), mine) != jax.tree.map(
        lambda s: (s.shape, s.dtype), theirs
    ):
        differ = {k: v for k, v in config_changes(other, cfg).items() if k.startswith("model.")}
        shown = "; ".join(f"{k}: {a!r} there, {b!r} here" for k, (a, b) in differ.items())
        raise ConfigError(
            f"init.from_run={source}: its weights do not fit this model ({shown}). Use its "
            f"model settings (its config.yaml), or start from random weights."
        )
    restore_cfg = dataclasses.replace(other, mesh=cfg.mesh)
    state = latest_state(source, restore_cfg, mesh, log=log)
    order = layer_order(restore_cfg, mesh.shape["p"])
    log(f"starting from the weights of {source} at step {int(jax.device_get(state.step))}")
    return relayered(state.weights, order, range(cfg.model.n_layers))


def _with_tasks(validate, cfg: Config, mesh, data_dir):
    """``validate`` and then ``eval.tasks``' scores (seqshard.evals): the figures of both. The
    tasks read the weights only, so the run's batches and losses are the same without them."""
    tasks = [(t.path, t.examples) for t in cfg.eval.tasks]
    train = cfg.train
    evaluate = make_task_eval(cfg.model, mesh, data_dir, tasks, train.batch_size, train.seq_len)
    if evaluate is None:
        return validate

    def both(weights, step: int) -> dict:
        return {**validate(weights, step), **timed(evaluate, weights)}

    return both


def _finished_already(run: _Run, state: TrainState, step: int, validate) -> TrainResult:
    values = validate(state.weights, step)
    val_loss = values["val_loss"]
    run.log(
        f"{run.run_dir} is already at step {step} of train.steps={run.cfg.train.steps}: "
        f"nothing to train"
    )
    return TrainResult(
        run_dir=run.run_dir,
        step=step,
        train_loss=None,
        val_loss=val_loss,
        tokens_per_s=0.0,
        mfu=0.0,
        wall_s=time.perf_counter() - run.started,
        already_finished=True,
        tasks=_task_figures(values),
    )


def _task_figures(values: dict) -> dict:
    return {k: v for k, v in values.items() if task_of_figure(k)}


def _train_steps(
    run: _Run, state: TrainState, start: int, loader: Loader, validate, stop: _StopOnSignal
) -> TrainResult:
    """Steps ``start + 1 .. train.steps``: log, evaluate and checkpoint on their intervals."""
    cfg, train_cfg = run.cfg, run.cfg.train
    step_fn = make_train_step(cfg, run.mesh, run.opt)
    n_devices = cfg.mesh.n_devices
    peak = (
        train_cfg.peak_flops * n_devices
        if train_cfg.peak_flops > 0
        else peak_flops(n_devices, cfg.model.compute_dtype)
    )
    window = _Throughput(
        train_cfg.batch_size * train_cfg.seq_len,
        flops_per_token(cfg.model, train_cfg.seq_len).total,
        peak,
    )
    metrics_log = (
        MetricsLogger(
            run.run_dir,
            total_steps=train_cfg.steps,
            start_step=start,
            tty=run.tty,
            trackers=open_trackers(
                cfg.run.trackers,
                run.run_dir,
                config=yaml.safe_load(config_to_yaml(cfg)),  # as config.yaml holds it
                name=cfg.run.name,
            ),
            notes=run.log,
        )
        if is_main_process()
        else SilentMetricsLogger()
    )
    metrics_log.truncate_after(start)
    # Every process traces its own devices; process 0's trace is the one summed.
    where = run.run_dir / PROFILE_DIR
    if jax.process_index():
        where = where / f"process-{jax.process_index()}"
    profile = ProfileWindow(
        train_cfg.profile.start_step, train_cfg.profile.steps, where, metrics_log.message
    )
    stop.log = metrics_log.message
    nonfinite = _NonfiniteWatch(run, int(jax.device_get(state.guard.total)), metrics_log.message)
    step, loss, val_loss, figures = start, None, None, {"tokens_per_s": 0.0, "mfu": 0.0}
    tasks: dict = {}
    stopping = False
    try:
        window.restart()
        for step in range(start + 1, train_cfg.steps + 1):
            batch = _next_batch(run, loader, state, step, nonfinite.seen)
            state, metrics = profile.run(step, step_fn, state, batch)
            window.steps += 1
            run.ckpt.raise_if_save_failed()  # a flag read: a failed save stops the next step
            if step == start + 1:  # the first step compiles: keep it out of the throughput
                jax.block_until_ready(metrics)
                metrics_log.message(f"compiled and ran the first step in {window.elapsed():.1f} s")
                window.restart()
                if stop.early:  # its exception was caught inside a library call: stop now
                    raise StopRequested(stop.early)
                stop.armed = True  # from now on a signal saves this step's state first
            # Read the flag once: a signal that lands after this (while logging, say)
            # stops after the next step, which then saves; breaking on it here would
            # stop without a checkpoint.
            stopping = agree_any(stop.requested)
            last = step == train_cfg.steps or stopping
            evaluate_now = (last and not stopping) or _every(train_cfg.eval_every, step)
            evaluate_now = evaluate_now or (stopping and train_cfg.eval_on_stop)
            save_now = last or _every(train_cfg.checkpoint_every, step)
            if _every(train_cfg.log_every, step) or evaluate_now or save_now:
                # One fetch for the metrics and the guard; nothing is saved before the guard
                # was read: a state after a non-finite step under `stop` is never written.
                metrics, guard = jax.device_get((metrics, state.guard))
                values = {k: float(v) for k, v in metrics.items()}
                window_figures = window.take()
                values.update(window_figures)
                figures.update(window_figures)
                nonfinite.check(guard, values)
                if values.get("tokens_counted") == 0:
                    values["loss"] = None  # a loss over no token: none, not 0 (logged as n/a)
                if loader.mixture is not None:
                    values.update({f"tokens/{k}": n for k, n in loader.tokens_drawn(step).items()})
                if evaluate_now:
                    values.update(validate(state.weights, step))
                    val_loss, tasks = values["val_loss"], _task_figures(values)
                loss = values["loss"]
                metrics_log.log(step, values)
            if save_now:
                run.ckpt.save(state, cfg, loader.state())
            if stopping:
                break
        interrupted = stopping and step < train_cfg.steps
    finally:
        try:
            profile.close()
        finally:
            metrics_log.close()
    return TrainResult(
        run_dir=run.run_dir,
        step=step,
        train_loss=loss,
        val_loss=val_loss,
        tokens_per_s=figures["tokens_per_s"],
        mfu=figures["mfu"],
        wall_s=time.perf_counter() - run.started,
        interrupted=interrupted,
        steps_run=step - start,
        tasks=tasks,
    )


def _next_batch(run: _Run, loader: Loader, state: TrainState, step: int, nonfinite_seen: int):
    """The batch of ``step``. Bad data (a corrupt token or offsets file, found as it is read)
    stops the run, but first the steps trained since the last checkpoint are saved, when that
    is safe: one process (each process reads its own rows, so another may not have failed),
    and no non-finite step since the guard was last read."""
    try:
        return next(loader)
    except ValueError as e:
        error = str(e)
    done = step - 1
    saved = ""
    run.ckpt.wait()
    latest = run.ckpt.latest_step()
    if jax.process_count() == 1 and done > (latest or 0):
        guard_total = int(jax.device_get(state.guard.total))
        if guard_total == nonfinite_seen:
            run.ckpt.save(state, run.cfg, loader.state())
            run.ckpt.wait()
            latest = done
            saved = f" Steps up to {done} were saved first."
    where = (
        f"The newest checkpoint is {run.ckpt.directory / str(latest)} (step {latest})."
        if latest is not None
        else "There is no checkpoint yet."
    )
    raise ValueError(f"step {step}: bad data: {error}{saved} {where}") from None


class _NonfiniteWatch:
    """Acts on the guard the train step keeps on device (see ``seqshard.train.state``), each
    time the loop fetches it: ``stop`` raises at the first non-finite step; ``skip`` notes the
    skipped steps and raises after ``max_nonfinite_skips`` in a row."""

    def __init__(self, run: _Run, seen: int, log: Callable[[str], None]):
        self.run, self.seen, self.log = run, seen, log

    def check(self, guard: NonfiniteGuard, values: dict[str, float]) -> None:
        total, in_a_row = int(guard.total), int(guard.in_a_row)
        if total == self.seen:
            return
        new, self.seen = total - self.seen, total
        train_cfg = self.run.cfg.train
        loss_kind = NONFINITE_KINDS[int(guard.last_loss)]
        grad_kind = NONFINITE_KINDS[int(guard.last_grad_norm)]
        standing_still = loss_kind == "finite" and grad_kind == "zero"
        fault = (
            "zero gradient (no weight can move: training stands still)"
            if standing_still
            else "not finite"
        )
        what = f"step {int(guard.last_step)}: loss {loss_kind}, grad norm {grad_kind}: {fault}"
        values["nonfinite_steps"] = float(total)
        if train_cfg.nonfinite == "skip" and in_a_row < train_cfg.max_nonfinite_skips:
            self.log(
                f"{what}, update skipped ({new} new, {in_a_row} in a row, {total} "
                f"in the run; train.nonfinite=skip stops after {train_cfg.max_nonfinite_skips} "
                f"in a row)"
            )
            return
        self.run.ckpt.wait()  # a save in flight is of a finite state from before the step
        latest = self.run.ckpt.latest_step()
        good = (
            f"the last good checkpoint is {self.run.ckpt.directory / str(latest)} (step "
            f"{latest}), where resuming starts"
            if latest is not None
            else "there is no checkpoint yet: a new run starts from step 0"
        )
        why = (
            f"{in_a_row} non-finite or zero-gradient steps in a row (train.max_nonfinite_skips="
            f"{train_cfg.max_nonfinite_skips})"
            if train_cfg.nonfinite == "skip"
            else "train.nonfinite=stop"
        )
        check = (
            "Check the initial weights for values far outside a trained model's (init.from_hf "
            "warns about them), lower "
            if standing_still
            else "Lower "
        )
        raise NonfiniteError(
            f"{what}; stopping ({why}). No update was applied from that step on "
            f"and nothing was saved after it; {good}. {check}"
            f"train.lr (now {train_cfg.lr:g}), keep train.grad_clip > 0 (now "
            f"{train_cfg.grad_clip:g}), or set train.nonfinite=skip to skip such batches."
        )
