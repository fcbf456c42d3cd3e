"""The ``seqshard`` command: prepare, train, eval, generate, plot, show, export.

    seqshard prepare [--out DIR] [INPUTS ...]          text -> tokenizer + token files
    seqshard train CONFIG [key=value ...]              train or resume runs/<name>
    seqshard eval RUN_DIR [key=value ...]              validation loss of the latest checkpoint
    seqshard generate RUN_DIR --prompt TEXT            sample from the latest checkpoint
    seqshard plot RUN_DIR [RUN_DIR ...]                loss curves -> PNG
    seqshard show CONFIG [--devices N --chip NAME]     sizes, layouts, FLOPs, memory, a plan
    seqshard export RUN_DIR OUT_DIR                    a checkpoint as Llama/Qwen3/Mixtral/Qwen3-MoE
    seqshard config [SECTION] [--markdown]             every config key: type, default, meaning

``train`` and ``eval`` join a multi-process run with ``--coordinator HOST:PORT
--num-processes N --process-id I`` (or find it under SLURM and on Cloud TPU VMs:
seqshard.launch); ``show --devices N --chip h100`` plans for hardware this machine lacks.

Each subcommand is one :class:`Command`: its arguments and the function that runs it, side by
side. Options and dotted overrides may come in any order (``seqshard train CONFIG
--sample-tokens 0 train.steps=5``). Heavy imports (JAX, the model) happen inside the run
functions, after the CPU device count is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import shlex
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:  # annotations only: JAX and the model load inside the run functions
    from jax.sharding import Mesh

    from seqshard.config import Config
    from seqshard.hf.export import ExportConfig, ExportResult
    from seqshard.model.weights import Weights

__all__ = [
    "COMMANDS",
    "Command",
    "export_checkpoint",
    "export_config",
    "hf_initial_weights",
    "main",
]


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand: ``arguments`` adds its arguments to its parser, ``run`` runs it."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str = ""


def _load(
    path: str,
    overrides: Sequence[str],
    devices: int | None = None,
    processes: int = 1,
    saved: bool = False,
):
    """The config (``saved``: ``path`` is a run's own config.yaml). With ``devices``: planned
    for that many (``-1`` sizes resolved, the mesh held to the count), and this machine's
    devices left alone. Otherwise, before JAX's backend starts, each of ``processes`` CPU
    processes gets its share of the mesh's devices (unless XLA_FLAGS sets a count, which wins)."""
    from seqshard.config import check_overrides_once, load_config
    from seqshard.launch import use_cpu_devices

    check_overrides_once(overrides)
    cfg = load_config(path, overrides, saved=saved, from_hf=with_hf_model)
    if devices is not None:
        from seqshard.plan.planner import target_config

        return target_config(cfg, devices)
    if cfg.mesh.is_resolved:
        per_process, extra = divmod(cfg.mesh.n_devices, processes)
        use_cpu_devices(per_process + bool(extra))  # uneven: the mesh check says so
    return cfg


def _process_arguments(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group(
        "multi-process runs (one process per host; see docs/launching.md)",
        "Give all three to every process, or set SEQSHARD_COORDINATOR, SEQSHARD_NUM_PROCESSES "
        "and SEQSHARD_PROCESS_ID. Under SLURM (srun) and on Cloud TPU VMs JAX finds them itself.",
    )
    group.add_argument(
        "--coordinator", metavar="HOST:PORT", help="process 0's address and a free port"
    )
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
    group.add_argument("--process-id", type=int, metavar="I", help="this process: 0 .. N-1")


def _start(args, config_path: str, overrides: Sequence[str], run_dir: str | None = None):
    """Join the run's processes and resolve the config on their devices (with ``run_dir``:
    reading the data that run trained on, see :func:`_with_run_data`).

    Before JAX's backend starts: the collective-overlap XLA flags, and on CPU each process's
    share of the mesh's devices (unless XLA_FLAGS sets a count, which wins)."""
    from seqshard.config import resolve_mesh
    from seqshard.launch import find_processes, set_overlap_flags, start_processes

    processes = find_processes(args.coordinator, args.num_processes, args.process_id)
    saved = run_dir is not None
    cfg = _load(config_path, overrides, processes=processes.num_processes or 1, saved=saved)
    if run_dir is not None:
        cfg = _with_run_data(cfg, run_dir, overrides)
    set_overlap_flags(cfg.runtime.overlap_collectives)
    start_processes(processes, cfg.runtime)
    import jax

    return resolve_mesh(cfg, jax.device_count())


def _say(*args, **kwargs) -> None:
    """print, in process 0 only: every process runs the same program; one reports it."""
    from seqshard.launch import is_main_process

    if is_main_process():
        print(*args, **kwargs)


def _run_config_args(run_dir: str, overrides: Sequence[str]) -> tuple[str, list[str]]:
    """A run's own config file and ``overrides`` (which win over where the run is and where
    its weights first came from)."""
    from seqshard.config import override_key, read_run_config

    read_run_config(run_dir)  # a clear error if run_dir is not a run directory
    run = Path(run_dir)
    given = {override_key(o) for o in overrides}
    # The run's weights are in its checkpoints: where they first came from is not read again.
    own = [
        f"run.dir={run.parent}",
        f"run.name={run.name}",
        "init.from_hf=null",
        "init.from_run=null",
    ]
    return str(run / "config.yaml"), [
        *(o for o in own if override_key(o) not in given),
        *overrides,
    ]


_DATA_KEYS = ("dir", "mixture", "stages")  # data.* keys that say which data a run reads


def _with_run_data(cfg: Config, run_dir: str, overrides: Sequence[str]) -> Config:
    """``cfg`` reading the data its run trained on (``data.dir`` and each mixture source,
    resolved in its ``run.json``), unless an override names other data."""
    from seqshard.config import override_key
    from seqshard.train.loop import with_run_data

    if any(override_key(o).split(".")[:2] == ["data", k] for o in overrides for k in _DATA_KEYS):
        return cfg
    return with_run_data(cfg, run_dir)


def _run_config(run_dir: str, overrides: Sequence[str]):
    cfg = _load(*_run_config_args(run_dir, overrides), saved=True)
    return _with_run_data(cfg, run_dir, overrides)


def _config_arguments(p: argparse.ArgumentParser, what: str = "config") -> None:
    if what == "config":
        p.add_argument("config", help="YAML config, e.g. configs/tiny-cpu.yaml")
    else:
        p.add_argument("run_dir", help="a run directory, e.g. runs/tiny-cpu")
    p.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.steps=100 mesh.d=4 mesh.t=2"
    )


# -- prepare ----------------------------------------------------------------------------------


def _prepare_arguments(p: argparse.ArgumentParser) -> None:
    from seqshard.data.prepare import DEFAULT_OUT, DEFAULT_SHARD_TOKENS, DEFAULT_VOCAB

    p.add_argument(
        "inputs",
        nargs="*",
        metavar="INPUTS",
        help="text files or directories (recursive: .txt .md .py .jsonl; a .jsonl line is one "
        "document: its --text-field, or a fine-tuning record with 'prompt' and 'completion' or "
        "chat 'messages', whose loss mask counts only the completion / assistant turns)",
    )
    p.add_argument("--out", default=DEFAULT_OUT, help="output directory")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB,
        help="size of the BPE to train (ignored with --tokenizer)",
    )
    p.add_argument(
        "--tokenizer",
        metavar="PATH",
        help="use this tokenizer.json instead of training one (e.g. another data dir's)",
    )
    p.add_argument(
        "--hf-dataset",
        metavar="NAME",
        help="Hugging Face dataset, streamed; NAME or NAME:CONFIG (needs "
        "`pip install 'seqshard[hf]'`)",
    )
    p.add_argument("--hf-split", default="train", help="split of --hf-dataset to read")
    p.add_argument("--text-field", default="text", help="text field of .jsonl / HF records")
    p.add_argument(
        "--chat-template",
        metavar="PATH",
        help="chat template for .jsonl records with 'messages': a .jinja file, a "
        "tokenizer_config.json or a Hugging Face model directory (default: the "
        "tokenizer_config.json beside --tokenizer)",
    )
    p.add_argument(
        "--val-fraction", type=float, default=0.01, help="fraction of documents held out as val"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    p.add_argument("--max-docs", type=int, help="read at most this many documents")
    p.add_argument(
        "--workers", type=int, default=1, help="tokenizing processes (the output is the same)"
    )
    p.add_argument(
        "--shard-tokens",
        type=int,
        default=DEFAULT_SHARD_TOKENS,
        help="bound of a shard (a unit of documents of at most this many UTF-8 bytes)",
    )
    p.add_argument("--force", action="store_true", help="replace --out if it exists")


def _prepare(args) -> int:
    from seqshard.data.prepare import PrepareConfig, prepare

    config = PrepareConfig(
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        tokenizer_path=args.tokenizer,
        seed=args.seed,
        workers=args.workers,
        shard_tokens=args.shard_tokens,
    )
    prepare(args.out, _prepare_corpus(args), config, overwrite=args.force)
    return 0


def _prepare_corpus(args):
    """The documents the prepare flags name: INPUTS and/or --hf-dataset, one after the other
    (the Python stdlib if neither), the first --max-docs of them."""
    from seqshard.data.corpus import Corpus, hf_corpus, path_corpus, stdlib_corpus
    from seqshard.data.sft import find_chat_template

    parts = []
    if args.inputs:
        template = find_chat_template(args.chat_template, args.tokenizer)
        parts.append(path_corpus(args.inputs, text_field=args.text_field, chat_template=template))
    if args.hf_dataset:
        parts.append(hf_corpus(args.hf_dataset, split=args.hf_split, text_field=args.text_field))
    if not parts:
        corpus = stdlib_corpus()
    elif len(parts) == 1:
        corpus = parts[0]
    else:
        corpus = Corpus(
            " + ".join(p.description for p in parts),
            lambda: itertools.chain.from_iterable(parts),
            lambda: [skipped for p in parts for skipped in p.skipped()],
        )
    return corpus.take(args.max_docs)


# -- train ------------------------------------------------------------------------------------


def _train_arguments(p: argparse.ArgumentParser) -> None:
    _config_arguments(p)
    _process_arguments(p)
    p.add_argument(
        "--sample-prompt",
        help="prompt for the text sample printed at the end (default: "
        f"{_SAMPLE_PROMPT!r}; for a run whose data has a chat template, a user message, "
        f"default {_SAMPLE_QUESTION!r}, whose reply stops at the end of turn)",
    )
    p.add_argument(
        "--sample-tokens", type=int, default=64, help="tokens to sample at the end (0: none)"
    )


_SAMPLE_PROMPT = "def __init__(self"
_SAMPLE_QUESTION = "What does `os.path.join` do?"  # the style of configs/sft/chat-stdlib.jsonl


class _StopBeforeStart(BaseException):
    """SIGTERM or Ctrl-C while `seqshard train` starts up (before the training loop's own
    handler is installed): nothing has run, nothing is lost. A BaseException, like
    KeyboardInterrupt, so that no library's ``except Exception`` swallows it."""


_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received: list[str] = []  # the signal, also kept here in case its exception was swallowed


def _stop_before_start(signum, frame):
    _received.append(signal.Signals(signum).name)
    raise _StopBeforeStart(_received[-1])


def _train(args) -> int:
    # Handled from the first moment: importing JAX and loading the config take seconds.
    previous = {sig: signal.signal(sig, _stop_before_start) for sig in _SIGNALS}
    unraisable, sys.unraisablehook = sys.unraisablehook, _quiet_stop(sys.unraisablehook)
    try:
        return _train_run(args)
    except _StopBeforeStart as e:
        print(f"{e}: stopped before training started; nothing to save.", flush=True)
        _end_abandoned_work()
    except Exception:
        if not _received:
            raise
        # The stop request landed inside a library that turned it into its own error (JAX's
        # backend start-up reports "initialization failed"): it is still only a stop.
        print(f"{_received[-1]}: stopped before training started; nothing to save.", flush=True)
        _end_abandoned_work()
    finally:
        sys.unraisablehook = unraisable
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _quiet_stop(hook):
    """``sys.unraisablehook`` that drops a stop request raised where it cannot propagate (a
    signal landing inside a ``__del__`` during an import): ``_received`` still stops the run."""

    def quiet(unraisable) -> None:
        if not isinstance(unraisable.exc_value, _StopBeforeStart):
            hook(unraisable)

    return quiet


def _end_abandoned_work() -> NoReturn:
    """End the process (status 0) after a stop before the first step, without the
    interpreter's teardown.

    A signal that lands while JAX compiles (``backend.compile_and_load``, which waits for XLA
    with Python's signal checks on) raises out of the wait but not out of the compile: XLA
    goes on compiling on its own threads. Python's teardown would then free the XLA client
    under that compile (``free(): invalid pointer``, LLVM errors, segfaults: 3 exits in 8 for
    a signal in tiny-cpu's first compile). Nothing is left to save or flush before the first
    step (the loop's ``finally`` blocks have closed the loader and the checkpointer, and the
    run files are written atomically), so the process ends here."""
    from seqshard import launch

    launch.exit_now(0)


def _train_run(args) -> int:
    from seqshard.launch import joined
    from seqshard.train.loop import run_dir_of, train

    cfg = _start(args, args.config, args.overrides)
    if _received:  # its exception was caught inside an import; it still stops us
        raise _StopBeforeStart(_received[-1])
    _say(f"run directory: {run_dir_of(cfg)}", flush=True)
    result = train(cfg, initial_weights=hf_initial_weights)
    val = _loss_text(result.val_loss)
    if result.already_finished:
        _say(f"step {result.step}: val loss {val} (train.steps={cfg.train.steps} already reached)")
    elif result.steps_run == 0:
        _say("stopped before the first step; nothing was saved.")
        _end_abandoned_work()
    else:
        _say(
            f"step {result.step}: train loss {_loss_text(result.train_loss)}, val loss {val}, "
            f"{result.tokens_per_s:,.0f} tokens/s, MFU {result.mfu:.2%}, wall {result.wall_s:.0f} s"
        )
    for name, figures in _by_task(result.tasks).items():
        _say(f"  task {name}: " + ", ".join(f"{k} {v:.3f}" for k, v in figures.items()))
    if result.interrupted:
        again = shlex.join(["seqshard", "train", args.config, *args.overrides])
        _say(f"stopped early; `{again}` resumes from the checkpoint.")
        return 0
    if args.sample_tokens > 0 and joined():
        _say(f"no sample in a multi-process run: `seqshard generate {result.run_dir}` samples.")
    elif args.sample_tokens > 0:
        _end_of_run_sample(cfg, result.run_dir, args.sample_prompt, args.sample_tokens)
    _say(f"run directory: {result.run_dir}")
    return 0


def _end_of_run_sample(cfg: Config, run_dir: Path, prompt: str | None, tokens: int) -> None:
    """Print a sample of ``tokens`` tokens: after ``prompt``, or for a run whose data has a
    chat template, a reply to the user message ``prompt``, stopped at the end of turn."""
    template = _run_chat_template(cfg)
    if template is None:
        prompt = _SAMPLE_PROMPT if prompt is None else prompt
        _say(f"sample ({tokens} tokens after {prompt!r}):")
        _say(prompt + _sample(cfg, run_dir, [prompt], tokens, 0.8, 40, 0)[0])
        return
    question = _SAMPLE_QUESTION if prompt is None else prompt
    end = template.end_of_turn()
    stop = [end] if end is not None else []
    chat = template.user_turn(question)
    _say(f"sample (a reply of at most {tokens} tokens to {question!r}, stopped at {end!r}):")
    _say(chat + _sample(cfg, run_dir, [chat], tokens, 0.8, 40, 0, stop)[0])


def _loss_text(loss: float | None) -> str:
    """A loss as the summaries print it; None: none was measured, or it counted no token."""
    return "n/a" if loss is None else f"{loss:.4f}"


def with_hf_model(cfg: Config, written: frozenset[str]) -> Config:
    """``cfg`` with the model sizes and tokenizer of the Hugging Face directory
    ``cfg.init.from_hf``: the ``from_hf`` of seqshard.config.load_config (which does not import
    seqshard.hf). Model fields in ``written`` (set by the layer naming from_hf or a later one)
    must agree with its config.json; the others are filled."""
    from seqshard.config import ConfigError
    from seqshard.hf.hf_config import HFFormatError, read_hf_config

    try:
        hf = read_hf_config(cfg.init.from_hf)
    except HFFormatError as e:
        raise ConfigError(f"init.from_hf: {e}") from None
    diff = [
        f"model.{k}={ours!r} but config.json says {theirs!r}"
        for k, (ours, theirs) in hf.disagreements(cfg.model, written).items()
    ]
    if diff:
        raise ConfigError(
            f"init.from_hf={cfg.init.from_hf}: {'; '.join(diff)}. Leave these out of the config "
            f"(they are filled from {hf.path}) or make them equal."
        )
    try:
        model = hf.model_config(cfg.model)
    except ValueError as e:
        raise ConfigError(f"init.from_hf={cfg.init.from_hf}: {e}") from None
    data = cfg.data
    if data.tokenizer is None:
        tokenizer = Path(cfg.init.from_hf) / "tokenizer.json"
        if not tokenizer.is_file():
            raise ConfigError(
                f"init.from_hf={cfg.init.from_hf} has no tokenizer.json, and data.tokenizer is "
                f"not set: the data must be tokenized as the model was trained. Set "
                f"data.tokenizer=PATH/tokenizer.json."
            )
        data = dataclasses.replace(data, tokenizer=str(tokenizer))
    return dataclasses.replace(cfg, model=model, data=data)


def hf_initial_weights(cfg: Config, mesh: Mesh, log: Callable[[str], None]) -> Weights:
    """The weights of the Hugging Face directory ``cfg.init.from_hf``, placed on ``mesh``: the
    ``initial_weights`` of seqshard.train.loop.train (which does not import seqshard.hf)."""
    import jax

    from seqshard.hf.load import load_hf_weights

    # A weight the files do not hold (multi-token prediction modules asked beside them) is
    # drawn as init_weights draws it from the run's seed.
    key = jax.random.key(cfg.train.seed)
    return load_hf_weights(cfg.init.from_hf, cfg.model, mesh, log=log, key=key)


# -- export -----------------------------------------------------------------------------------


def _export_arguments(p: argparse.ArgumentParser) -> None:
    from seqshard.hf.export import DEFAULT_MAX_FILE_BYTES

    p.add_argument("run_dir", help="a run directory, e.g. runs/tiny-cpu")
    p.add_argument("out_dir", help="the Hugging Face model directory to write, e.g. hf/tiny-cpu")
    p.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. mesh.d=2 mesh.t=1 (where to restore)"
    )
    p.add_argument(
        "--step", type=int, help="the checkpoint to export (default: the newest good one)"
    )
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="weights' dtype"
    )
    p.add_argument(
        "--max-file-size",
        type=_byte_size,
        default=DEFAULT_MAX_FILE_BYTES,
        metavar="BYTES",
        help="split the safetensors files above this size (e.g. 5GB, 500MiB, 1000000)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace OUT_DIR if it exists (once complete)"
    )
    _process_arguments(p)


def _byte_size(text: str) -> int:
    import re

    units = {
        "": 1,
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
    }
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in units or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: write a positive number of bytes, e.g. 5GB, 500MiB or 1000000"
        )
    return int(float(match.group(1)) * units[match.group(2).upper()])


def _export(args) -> int:
    from seqshard.mesh import training_mesh

    cfg = _start(args, *_run_config_args(args.run_dir, args.overrides), args.run_dir)
    export = export_config(
        cfg,
        args.out_dir,
        dtype=args.dtype,
        max_file_bytes=args.max_file_size,
        overwrite=args.overwrite,
    )
    mesh = training_mesh(cfg.mesh.sizes())
    export_checkpoint(args.run_dir, export, cfg, mesh, step=args.step, log=_say)
    return 0


def export_config(cfg: Config, out_dir: str | Path, **options) -> ExportConfig:
    """The :class:`~seqshard.hf.export.ExportConfig` of the run ``cfg`` into ``out_dir``: its
    model, the tokenizer of its ``data.dir``, the chat template of its data (if any) and the
    positions it trained on; ``options`` set the other fields (``dtype``, ``max_file_bytes``,
    ``overwrite``, ``tokenizer``, ``chat_template``)."""
    from seqshard.hf.export import ExportConfig, max_position

    fields = {
        "tokenizer": Path(cfg.data.dir) / "tokenizer.json",
        "max_position": max_position(cfg.model, cfg.train.seq_len),
        **options,
    }
    if "chat_template" not in fields:
        fields["chat_template"] = _run_chat_template(cfg)
    return ExportConfig(out_dir=Path(out_dir), model=cfg.model, **fields)


def export_checkpoint(
    run_dir: str | Path,
    export: ExportConfig,
    cfg: Config,
    mesh: Mesh,
    *,
    step: int | None = None,
    log: Callable[[str], None] = print,
) -> ExportResult:
    """Export checkpoint ``step`` (default: the newest good one) of ``run_dir``, restored on
    ``mesh``, as ``export`` says (seqshard.hf.export.export_run). ``export.check()`` comes
    first: a bad OUT_DIR, tokenizer or a full disk fails before a large checkpoint is read."""
    from seqshard.hf.export import export_run
    from seqshard.train.checkpoint import Checkpointer
    from seqshard.train.optimizer import make_optimizer
    from seqshard.train.state import layer_order, relayered

    export.check()
    ckpt = Checkpointer(Path(run_dir) / "checkpoints", read_only=True, log=log)
    try:
        restored = ckpt.restore(cfg, mesh, make_optimizer(cfg.train, cfg.model, mesh), step)
    finally:
        ckpt.close()
    # Layer i of the export is the model's layer i, whatever order the stages store.
    order = layer_order(cfg, mesh.shape["p"])
    weights = relayered(restored.state.weights, order, range(cfg.model.n_layers))
    source = f"{run_dir} step {restored.step}"
    del restored  # the optimizer's moments: freed before the weights are gathered
    return export_run(weights, export, source=source, log=log)


# -- eval and generate ------------------------------------------------------------------------


def _eval_arguments(p: argparse.ArgumentParser) -> None:
    _config_arguments(p, "run_dir")
    _process_arguments(p)
    p.add_argument(
        "--batches", type=int, default=0, help="validation batches (default: train.eval_batches)"
    )
    p.add_argument(
        "--tasks",
        nargs="+",
        metavar="TASK",
        help="score these tasks instead of the validation loss: JSON Lines task files or "
        "built-in tasks (stdlib_next_line); a table of accuracies (seqshard.evals)",
    )
    p.add_argument(
        "--examples",
        type=int,
        default=0,
        help="with --tasks: each task's first N examples (0: all)",
    )
    p.add_argument("--json", action="store_true", help="with --tasks: the results as JSON")


def _eval_tasks(args, cfg, mesh, weights, step: int) -> int:
    """``seqshard eval RUN_DIR --tasks ...``: each task's scores, a table or JSON."""
    import json

    from seqshard.evals.configured import make_task_eval
    from seqshard.shardlib.tables import format_table

    tasks = [(path, args.examples) for path in args.tasks]
    train = cfg.train
    evaluate = make_task_eval(cfg.model, mesh, cfg.data.dir, tasks, train.batch_size, train.seq_len)
    results = evaluate(weights)
    if args.json:
        rows = [{"task": r.name, "examples": r.examples, **r.metrics} for r in results]
        print(json.dumps({"run_dir": str(args.run_dir), "step": step, "tasks": rows}, indent=2))
        return 0

    def cell(r, key: str) -> str:
        value = r.metrics.get(key)
        return "-" if value is None else f"{value:.4f}"

    header = ("task", "examples", "acc", "acc_norm", "acc_stderr", "nll/token", "greedy")
    body = [
        (r.name, str(r.examples), cell(r, "acc"), cell(r, "acc_norm"),
         cell(r, "acc_stderr") if "acc" in r.metrics else cell(r, "greedy_stderr"),
         cell(r, "nll"), cell(r, "greedy"))
        for r in results
    ]  # fmt: skip
    _say(f"{args.run_dir} step {step}:")
    _say(format_table(body, header, right=frozenset(range(1, len(header)))))
    return 0


def _eval(args) -> int:
    from seqshard.data import Loader
    from seqshard.mesh import training_mesh
    from seqshard.train.checkpoint import latest_state
    from seqshard.train.loop import data_mixture
    from seqshard.train.step import make_eval_step
    from seqshard.train.validation import make_validate

    cfg = _start(args, *_run_config_args(args.run_dir, args.overrides), args.run_dir)
    mesh = training_mesh(cfg.mesh.sizes())
    state = latest_state(args.run_dir, cfg, mesh)
    if args.tasks:
        return _eval_tasks(args, cfg, mesh, state.weights, int(state.step))
    train_cfg = cfg.train
    n_batches = args.batches or train_cfg.eval_batches
    with Loader(
        data_mixture(cfg) or cfg.data.dir,
        "train",
        batch_size=train_cfg.batch_size,
        seq_len=train_cfg.seq_len,
        mesh=mesh,
        vocab=cfg.model.vocab,
        prefetch=0,
    ) as loader:
        validate = make_validate(loader, make_eval_step(cfg, mesh), n_batches)
    step = int(state.step)
    losses = validate(state.weights, step)
    _say(
        f"{args.run_dir} step {step}: val loss {_loss_text(losses.pop('val_loss'))} over {n_batches} "
        f"batches of {train_cfg.batch_size}x{train_cfg.seq_len}"
        + (" a source (the mixture's, weighted by its shares at this step)" if losses else "")
    )
    for key, loss in losses.items():
        _say(f"  {key.removeprefix('val_loss/')}: val loss {_loss_text(loss)}")
    return 0


def _sample(cfg, run_dir, prompts, max_new_tokens, temperature, top_k, seed, stop=()) -> list[str]:
    """Continuations of ``prompts`` by the latest checkpoint of ``run_dir``, in one batch, each
    cut before the first of the ``stop`` strings (seqshard.sample.generate_text)."""
    import jax

    from seqshard.data import load_tokenizer
    from seqshard.mesh import training_mesh
    from seqshard.model.generate import Sampling
    from seqshard.sample import generate_text
    from seqshard.train.checkpoint import latest_state

    sampling = Sampling(max_new_tokens, temperature, top_k, key=jax.random.key(seed))
    weights = latest_state(run_dir, cfg, training_mesh(cfg.mesh.sizes())).weights
    tokenizer = load_tokenizer(Path(cfg.data.dir) / "tokenizer.json")
    # mesh None: generate_text picks a decode mesh the batch and model fit
    return generate_text(weights, tokenizer, prompts, cfg.model, None, sampling, stop=stop)


def _run_chat_template(cfg: Config):
    """The chat template the run's data was rendered with (seqshard.data.sft.ChatTemplate),
    or None: ``data.chat_template``, else a tokenizer_config.json with one beside
    ``data.tokenizer`` or in ``data.dir``."""
    from seqshard.data.sft import find_chat_template

    data = cfg.data
    try:
        template = find_chat_template(data.chat_template, data.tokenizer)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"the run's chat template data.chat_template={data.chat_template} does not exist "
            f"(moved or deleted since the run trained?); pass data.chat_template=PATH (a .jinja "
            f"file, a tokenizer_config.json or a Hugging Face model directory)."
        ) from None
    return template or find_chat_template(None, Path(data.dir) / "tokenizer.json")


def _generate_arguments(p: argparse.ArgumentParser) -> None:
    _config_arguments(p, "run_dir")
    prompts = p.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", help="the text to continue (with --chat: the user's message)")
    prompts.add_argument(
        "--prompts-file",
        metavar="FILE",
        help="one prompt per line (blank lines skipped), all generated in one batch; the "
        "outputs come in the file's order",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="each prompt is a user message, rendered by the run's chat template "
        "(data.chat_template, or the tokenizer_config.json beside data.tokenizer) with the "
        "generation prompt; each reply stops at the template's end of turn (e.g. <|end|>)",
    )
    p.add_argument(
        "--stop",
        action="append",
        metavar="STR",
        help="stop a row once its text contains STR, cut before it (repeatable; rows also stop "
        "at <|endoftext|>)",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=100, help="tokens generated per row, at most"
    )
    p.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    p.add_argument("--top-k", type=int, default=40, help="0 for no top-k cut")
    p.add_argument(
        "--num-samples",
        type=int,
        default=1,
        help="samples of each prompt, generated in the same batch",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the sampling (the same seed gives the same text on any mesh; unused at "
        "--temperature 0)",
    )


def _generate(args) -> int:
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}.")
    cfg = _run_config(args.run_dir, args.overrides)
    prompts = [args.prompt] if args.prompts_file is None else _prompts_file(args.prompts_file)
    stop = list(args.stop or [])
    if args.chat:
        template = _run_chat_template(cfg)
        if template is None:
            raise ValueError(
                f"--chat needs the chat template of {args.run_dir}'s data, and it has none "
                f"(data.chat_template is unset, and no tokenizer_config.json with one is beside "
                f"data.tokenizer or in data.dir={cfg.data.dir}); pass data.chat_template=PATH "
                f"(a .jinja file, a tokenizer_config.json or a Hugging Face model directory)."
            )
        prompts = [template.user_turn(p) for p in prompts]
        end = template.end_of_turn()
        stop += [end] if end is not None else []
    prompts = [p for p in prompts for _ in range(args.num_samples)]
    top_k = args.top_k or None
    texts = _sample(
        cfg, args.run_dir, prompts, args.max_new_tokens, args.temperature, top_k, args.seed, stop
    )
    for prompt, text in zip(prompts, texts, strict=True):
        print(prompt + text)
        print("-" * 40)
    return 0


def _prompts_file(path: str) -> list[str]:
    """The prompts of ``--prompts-file``: its lines, blank ones skipped."""
    if not Path(path).is_file():
        raise FileNotFoundError(
            f"--prompts-file {path} is not a file; pass a text file with one prompt per line."
        )
    prompts = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(
            f"--prompts-file {path} holds no prompt; write one prompt per line (blank lines "
            f"are skipped)."
        )
    return prompts


# -- plot and show ----------------------------------------------------------------------------


def _plot_arguments(p: argparse.ArgumentParser) -> None:
    from seqshard.train.metrics import METRICS_FILE

    p.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help=f"a training run dir holding {METRICS_FILE}"
    )
    p.add_argument("--out", type=Path, metavar="PATH", help="where to write the PNG")


def _plot(args) -> int:
    from seqshard.train.plot import expert_loads, plot_expert_load, plot_runs

    print(plot_runs(args.run_dirs, args.out))
    for run_dir in args.run_dirs:  # runs with experts: their load heatmap too
        if expert_loads(run_dir)[1]:
            print(plot_expert_load(run_dir))
    return 0


def _show_arguments(p: argparse.ArgumentParser) -> None:
    from seqshard.hardware import CHIPS

    _config_arguments(p)
    skip = "skip compiling the train step (no communication table, no XLA memory figures)"
    p.add_argument("--no-compile", action="store_true", help=skip)
    p.add_argument(
        "--devices",
        type=int,
        metavar="N",
        help="plan for N devices (a mesh size of -1 takes the remaining ones); the step is "
        "compiled only if this machine has N devices (default: the mesh's device count)",
    )
    p.add_argument(
        "--chip",
        metavar="NAME",
        help="plan a training step on this chip (one of seqshard.hardware.CHIPS: "
        f"{', '.join(CHIPS)}): memory, communication, roofline step time and MFU, and "
        "whether it fits; needs no such device",
    )


def _show(args) -> int:
    from seqshard.config import ConfigError
    from seqshard.hardware import chip
    from seqshard.plan.planner import config_target, target_config
    from seqshard.plan.show import describe

    if args.chip is not None:
        chip(args.chip)  # an unknown name fails here, before anything compiles
    target = config_target(args.config) if args.devices is None and args.chip is None else None
    if target is not None:  # the machine the config is written for
        devices, args.chip = target
        print(
            f"(planning for the config's target: --devices {devices} --chip {args.chip}; pass "
            f"--devices N --chip NAME to plan for other hardware)\n"
        )
        if args.chip != "cpu":  # fake CPU devices are made here: compile as for no flags
            args.devices = devices
    cfg = _load(args.config, args.overrides, args.devices)
    compile_step = not args.no_compile
    if compile_step:
        import jax

        here = jax.device_count()
        if not cfg.mesh.is_resolved:
            cfg = target_config(cfg, here)
        if cfg.mesh.n_devices != here:
            compile_step = False  # compiling needs the mesh's devices
            print(
                f"(not compiling the train step: mesh {cfg.mesh.describe()} needs "
                f"{cfg.mesh.n_devices} devices and this machine has {here})\n"
            )
    elif not cfg.mesh.is_resolved:
        raise ConfigError(
            f"mesh {cfg.mesh.describe()} has a -1 size (the remaining devices): pass "
            f"--devices N to say how many devices to plan for."
        )
    print(describe(cfg, compile_step=compile_step, chip=args.chip))
    return 0


# -- config: the reference of every key -------------------------------------------------------


def _config_keys_arguments(p: argparse.ArgumentParser) -> None:
    from seqshard.config import SECTIONS

    p.add_argument(
        "section",
        nargs="?",
        help=f"one section ({', '.join(SECTIONS)}) or a part of one (model.moe); default: all",
    )
    p.add_argument(
        "--markdown", action="store_true", help="as Markdown (docs/config.md is all of it)"
    )


def _config_keys(args) -> int:
    from seqshard.config import config_reference

    print(config_reference(args.section, markdown=args.markdown), end="")
    return 0


COMMANDS: tuple[Command, ...] = (
    Command(
        "prepare",
        "tokenize text into a data directory",
        _prepare_arguments,
        _prepare,
        "Tokenize text into a seqshard data directory (shards of token ids and document offsets, meta.json, "
        "tokenizer.json). With no INPUTS and no --hf-dataset, the corpus is the Python standard "
        "library's own source (~12 MB, no network needed).",
    ),
    Command(
        "train",
        "train, or resume, the run a config describes",
        _train_arguments,
        _train,
        "Train runs/<run.name> from CONFIG; an existing run directory resumes from its latest "
        "checkpoint. The data directory is prepared on first use. SIGTERM / Ctrl-C checkpoints "
        "and stops.",
    ),
    Command(
        "eval",
        "validation loss of a run's latest checkpoint",
        _eval_arguments,
        _eval,
        "Validation loss of RUN_DIR's latest checkpoint, on the data it trained on (or "
        "data.dir=...), on its mesh or another (mesh.d=8 mesh.t=1).",
    ),
    Command(
        "generate",
        "sample text from a run's latest checkpoint",
        _generate_arguments,
        _generate,
        "Continue --prompt, or each line of --prompts-file (one batch), with RUN_DIR's latest "
        "checkpoint. --chat sends each as a user message through the run's chat template and "
        "stops the reply at its end of turn; --stop STR stops a row at a string of your own. "
        "A row that has stopped generates nothing more, and generation ends when every row has.",
    ),
    Command(
        "export",
        "write a run's checkpoint as a Hugging Face Llama, Qwen3, Mixtral, Qwen3-MoE or "
        "DeepSeek-V3",
        _export_arguments,
        _export,
        "Write RUN_DIR's newest good checkpoint (or --step) to OUT_DIR as a Hugging Face Llama, "
        "Qwen3, Mixtral, Qwen3-MoE or DeepSeek-V3 directory, whichever holds the model "
        "(model.attention, model.qk_norm and model.moe decide): config.json, safetensors "
        "weights split above --max-file-size with "
        "their index, and the run's tokenizer, with its chat template for a chat-tuned run, which "
        "transformers' AutoModelForCausalLM and AutoTokenizer (apply_chat_template) load. "
        "Start a run from such a directory with the config key init.from_hf: PATH.",
    ),
    Command(
        "plot",
        "plot train/val loss of runs to a PNG",
        _plot_arguments,
        _plot,
        "Plot train loss (lines) and val loss (markers) vs step from each RUN_DIR/metrics.jsonl. "
        "One run is written to RUN_DIR/loss.png, several to ./loss_compare.png, unless --out "
        "is given. A run with experts also gets RUN_DIR/expert_load.png: each MoE layer's "
        "experts over the steps, coloured by load over the mean.",
    ),
    Command(
        "show",
        "resolved config, parameter count, layouts, FLOPs and memory per device",
        _show_arguments,
        _show,
        "What CONFIG means on its mesh: the resolved config, parameters, each weight's layout, "
        "FLOPs per token, and the plan (memory per device by kind, collective bytes per mesh "
        "axis, a roofline step time and MFU, and whether it fits). With --devices N --chip NAME "
        "it plans for that hardware without it; on this machine's own device count it also "
        "compiles the step and reports XLA's collectives and memory.",
    ),
    Command(
        "lm-eval",
        "the lm-evaluation-harness's command line with the seqshard model (pip install -e '.[eval]')",
        lambda p: p.add_argument("harness_args", nargs="*", help="lm_eval's own flags"),
        lambda args: _lm_eval(args.harness_args),
        "Runs the lm-evaluation-harness (`lm_eval`) with every flag of its own, the model "
        "`seqshard` registered: `seqshard lm-eval --model seqshard --model_args "
        "run_dir=runs/NAME --tasks TASKS [--include_path DIR]` scores a run's latest checkpoint "
        "on any task the harness knows or reads from a local YAML (seqshard.harness).",
    ),
    Command(
        "config",
        "every config key: its type, default and meaning",
        _config_keys_arguments,
        _config_keys,
        "Every key a config file or a dotted override sets, by section: its type, its default "
        "(configs/base.yaml sets some others) and what it means, read from the dataclasses of "
        "seqshard/config.py. A relative path is relative to the config file that names it (in "
        "an override: to the working directory). docs/config.md is `seqshard config --markdown`.",
    ),
)


def _by_task(figures: dict[str, float]) -> dict[str, dict[str, float]]:
    """``{'task/t/acc': 0.4}`` -> ``{'t': {'acc': 0.4}}``."""
    from seqshard.evals.tasks import task_of_figure

    out: dict[str, dict[str, float]] = {}
    for key, value in figures.items():
        name, metric = task_of_figure(key)
        out.setdefault(name, {})[metric] = value
    return out


def _lm_eval(harness_args: Sequence[str]) -> int:
    """``lm_eval`` with the seqshard model registered (seqshard.harness)."""
    from seqshard.harness import main as harness_main

    try:
        harness_main(list(harness_args))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    return 0


def _version() -> str:
    """The installed distribution's version (pyproject.toml's)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("seqshard")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="seqshard",
        description="Train language models on device meshes, every layout and transfer written "
        "in a checked notation.",
        epilog="`seqshard COMMAND --help` describes a command's arguments; `--debug` anywhere "
        "shows an error's full traceback. Exit status: 0 done (or stopped by SIGTERM / Ctrl-C "
        "after saving), 2 an error, 3 training stopped on a non-finite loss or gradient norm or "
        "a zero gradient (train.nonfinite).",
    )
    p.add_argument("--version", action="version", version=f"seqshard {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        sub.add_parser(command.name, help=command.help, add_help=False)
    return p


class _DefaultsOnce(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, once: not where the help says its default itself
    (``(default: train.eval_batches)``), nor for an unset or off one (None, False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default in (None, False):
            return text
        return super()._get_help_string(action)


def _command_parser(command: Command) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"seqshard {command.name}",
        description=command.description or command.help,
        formatter_class=_DefaultsOnce,
    )
    command.arguments(p)
    return p


EXIT_ERROR = 2
"""Bad input, a missing or damaged file, a failed save: the message says what and how to fix it."""
EXIT_NONFINITE = 3
"""Training stopped on a non-finite loss or gradient norm (``train.nonfinite``); the error's
``exit_code`` (seqshard.train.loop.NonfiniteError)."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv  # anywhere: show the full traceback of an error
    argv = [a for a in argv if a != "--debug"]
    by_name = {c.name: c for c in COMMANDS}
    if argv and argv[0] == "lm-eval":  # every other argument is lm_eval's, help included
        try:
            return _lm_eval(argv[1:])
        except ImportError as e:
            print(f"seqshard lm-eval: error: {e}", file=sys.stderr)
            return EXIT_ERROR
    try:
        if not argv or argv[0] not in by_name:
            _top_parser().parse_args(argv)  # prints usage (or --help) and exits
            return EXIT_ERROR
        command = by_name[argv[0]]
        parser = _command_parser(command)
        # Intermixed: options may come after the dotted overrides (plain parse_args stops
        # collecting a positional list at the first option).
        args, unknown = parser.parse_known_intermixed_args(argv[1:])
        if unknown:
            dashed = _dashed_override(unknown, argv) if hasattr(args, "overrides") else None
            if dashed is not None:
                print(f"seqshard {command.name}: error: {dashed}", file=sys.stderr)
                return EXIT_ERROR
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as e:  # --help exits 0, usage errors 2: return the status instead
        return e.code if isinstance(e.code, int) else EXIT_ERROR
    try:
        return command.run(args)
    except (ValueError, TypeError, OSError, RuntimeError, ImportError) as e:
        # OSError: unwritable run.dir, missing files; ImportError: an optional extra missing.
        if debug:
            _exit_now_if_joined(traceback=True)
            raise
        print(f"seqshard {command.name}{_process()}: error: {e}{_peer_hint(e)}", file=sys.stderr)
        _exit_now_if_joined(getattr(e, "exit_code", EXIT_ERROR))
        return getattr(e, "exit_code", EXIT_ERROR)
    except Exception:
        _exit_now_if_joined(traceback=True)
        raise


def _dashed_override(unknown: Sequence[str], argv: Sequence[str]) -> str | None:
    """The hint for a dotted override written as an option (``--train.steps=10`` or
    ``--train.steps 10``, the torchtitan / draccus habit), for a command that takes overrides;
    None if no unknown argument is one."""
    for arg in unknown:
        key, eq, value = arg.partition("=")
        if not (key.startswith("--") and "." in key and key[2:3].isalpha()):
            continue
        if not eq:  # the value, if any, is the next argument
            at = argv.index(arg) + 1
            value = argv[at] if at < len(argv) and not argv[at].startswith("--") else "VALUE"
            arg = f"{arg} {value}" if value != "VALUE" else arg
        return (
            f"{arg} is not an option: a config override is written without dashes, as "
            f"{key[2:]}={value}."
        )
    return None


def _process() -> str:
    """`` (process 1 of 2)`` in a multi-process run, else ``''`` (JAX not imported: ``''``)."""
    from seqshard import launch

    return launch.process_label() if launch.joined() else ""


def _peer_hint(error: Exception) -> str:
    """In a multi-process run a failed collective usually means another process failed first."""
    from seqshard import launch

    if not launch.joined():
        return ""
    import jax

    if not isinstance(error, jax.errors.JaxRuntimeError):
        return ""
    return (
        " (a collective failed: another process of the run has probably stopped first; its "
        "own output says why)"
    )


def _exit_now_if_joined(code: int = EXIT_ERROR, traceback: bool = False) -> None:
    """In a multi-process run, a failing process ends at once (after its message): raising
    would leave the others waiting for it in their next collective (seqshard.launch)."""
    from seqshard import launch

    if launch.joined():
        if traceback:
            import traceback as tb

            tb.print_exc()
            code = 1
        launch.exit_now(code)


if __name__ == "__main__":
    sys.exit(main())
