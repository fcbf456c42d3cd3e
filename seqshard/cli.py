"""The ``seqshard`` command: prepare, train, eval, generate, plot, show.

seqshard prepare [--out DIR] [INPUTS ...]          text -> tokenizer + token files
seqshard train CONFIG [key=value ...]              train or resume runs/<name>
seqshard eval RUN_DIR [key=value ...]              validation loss of the latest checkpoint
seqshard generate RUN_DIR --prompt TEXT            sample from the latest checkpoint
seqshard plot RUN_DIR [RUN_DIR ...]                loss curves -> PNG
seqshard show CONFIG [key=value ...]               sizes, layouts, FLOPs, memory per device
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]


def _use_host_devices(n: int) -> None:
    """Give the CPU backend ``n`` fake devices unless the user set a count. XLA reads the flag
    when the backend starts (the first device query), so this must run before that."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _load(path: str, overrides: Sequence[str]):
    from seqshard.config import load_config

    cfg = load_config(path, overrides)
    _use_host_devices(max(cfg.mesh.d * cfg.mesh.t, 1))
    return cfg


def _run_config(run_dir: str, overrides: Sequence[str]):
    config = Path(run_dir) / "config.yaml"
    if not config.exists():
        raise FileNotFoundError(
            f"{config} does not exist: {run_dir} is not a run directory. Pass the directory "
            f"`seqshard train` printed (e.g. runs/tiny-cpu)."
        )
    run_name = Path(run_dir)
    cfg = _load(
        str(config), [f"run.dir={run_name.parent}", f"run.name={run_name.name}", *overrides]
    )
    if any(o.startswith("data.dir=") for o in overrides):
        return cfg
    data_dir = _launch_relative(Path(cfg.data.dir), run_name, config)
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dir=str(data_dir)))


def _launch_relative(path: Path, run_dir: Path, config: Path) -> Path:
    """``path`` from a run's config.yaml, relative to the directory `seqshard train` ran in.

    The saved ``run.dir/run.name`` is the run directory relative to that launch directory, so
    stripping it from ``run_dir`` finds it: ``seqshard eval ../seqshard/runs/tiny-cpu`` finds
    ``data/stdlib`` at ``../seqshard/data/stdlib``. Absolute paths, and paths that exist from
    here, are kept."""
    import yaml

    if path.is_absolute() or path.exists():
        return path
    saved_run = (yaml.safe_load(config.read_text()) or {}).get("run") or {}
    saved = Path(str(saved_run.get("dir", ""))) / str(saved_run.get("name", ""))
    resolved = run_dir.resolve()
    if saved.is_absolute() or resolved.parts[-len(saved.parts) :] != saved.parts:
        return path
    launch_dir = Path(*resolved.parts[: -len(saved.parts)])
    return launch_dir / path if (launch_dir / path).exists() else path


def _train(args) -> int:
    from seqshard.mesh import initialize_distributed
    from seqshard.train.loop import run_dir_of, train

    cfg = _load(args.config, args.overrides)
    initialize_distributed()
    print(f"run directory: {run_dir_of(cfg)}", flush=True)
    result = train(cfg)
    val = f"{result.val_loss:.4f}" if result.val_loss is not None else "n/a"
    if math.isnan(result.train_loss):  # nothing left to train: the run was already finished
        print(f"step {result.step}: val loss {val} (train.steps={cfg.train.steps} already reached)")
    else:
        print(
            f"step {result.step}: train loss {result.train_loss:.4f}, val loss {val}, "
            f"{result.tokens_per_s:,.0f} tokens/s, MFU {result.mfu:.2%}, wall {result.wall_s:.0f} s"
        )
    if result.interrupted:
        print(f"stopped early; `seqshard train {args.config}` resumes from the checkpoint.")
        return 0
    if args.sample_tokens > 0:
        samples = _generate(
            cfg, result.run_dir, [args.sample_prompt], args.sample_tokens, 0.8, 40, 0
        )
        print(f"sample ({args.sample_tokens} tokens after {args.sample_prompt!r}):")
        print(args.sample_prompt + samples[0])
    print(f"run directory: {result.run_dir}")
    return 0


def _generate(cfg, run_dir, prompts, max_new_tokens, temperature, top_k, seed) -> list[str]:
    from seqshard.data import load_tokenizer
    from seqshard.mesh import training_mesh
    from seqshard.model.generate import generate_text
    from seqshard.train.loop import latest_weights

    weights = latest_weights(run_dir, cfg, training_mesh(cfg.mesh)).weights
    tokenizer = load_tokenizer(Path(cfg.data.dir) / "tokenizer.json")
    return generate_text(
        weights,
        tokenizer,
        prompts,
        cfg.model,
        None,  # generate_text picks a decode mesh the batch and model fit
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        seed=seed,
    )


def _eval(args) -> int:
    from seqshard.data import Loader
    from seqshard.mesh import training_mesh
    from seqshard.train.loop import evaluate, latest_weights
    from seqshard.train.step import make_eval_step

    cfg = _run_config(args.run_dir, args.overrides)
    mesh = training_mesh(cfg.mesh)
    state = latest_weights(args.run_dir, cfg, mesh)
    t = cfg.train
    with Loader(
        cfg.data.dir,
        "train",
        batch_size=t.batch_size,
        seq_len=t.seq_len,
        mesh=mesh,
        vocab=cfg.model.vocab,
        prefetch=0,
    ) as loader:
        batches = list(loader.eval_batches(args.batches or t.eval_batches))
    loss = evaluate(make_eval_step(cfg, mesh), state.weights, batches)
    print(
        f"{args.run_dir} step {int(state.step)}: val loss {loss:.4f} over {len(batches)} batches of {t.batch_size}x{t.seq_len}"
    )
    return 0


def _generate_cmd(args) -> int:
    cfg = _run_config(args.run_dir, args.overrides)
    prompts = [args.prompt] * args.num_samples
    for text in _generate(
        cfg, args.run_dir, prompts, args.max_new_tokens, args.temperature, args.top_k, args.seed
    ):
        print(args.prompt + text)
        print("-" * 40)
    return 0


def _show(args) -> int:
    from seqshard.show import describe

    cfg = _load(args.config, args.overrides)
    print(describe(cfg, compile_step=not args.no_compile))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="seqshard",
        description="Train language models on device meshes, every layout and transfer written in a checked notation.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "prepare",
        help="tokenize text into a data directory (see `seqshard prepare --help`)",
        add_help=False,
    )

    t = sub.add_parser(
        "train",
        help="train, or resume, the run a config describes",
        description="Train runs/<run.name> from CONFIG; an existing run directory resumes from its latest checkpoint. "
        "The data directory is prepared on first use. SIGTERM / Ctrl-C checkpoints and stops.",
    )
    t.add_argument("config", help="YAML config, e.g. configs/tiny-cpu.yaml")
    t.add_argument(
        "overrides", nargs="*", help="dotted overrides, e.g. train.steps=100 mesh.d=4 mesh.t=2"
    )
    t.add_argument(
        "--sample-prompt",
        default="def __init__(self",
        help="prompt for the text sample printed at the end",
    )
    t.add_argument(
        "--sample-tokens", type=int, default=64, help="tokens to sample at the end (0: none)"
    )
    t.set_defaults(fn=_train)

    e = sub.add_parser("eval", help="validation loss of a run's latest checkpoint")
    e.add_argument("run_dir")
    e.add_argument(
        "overrides", nargs="*", help="e.g. mesh.d=2 mesh.t=4 to evaluate on another mesh"
    )
    e.add_argument(
        "--batches", type=int, default=0, help="validation batches (default: train.eval_batches)"
    )
    e.set_defaults(fn=_eval)

    g = sub.add_parser("generate", help="sample text from a run's latest checkpoint")
    g.add_argument("run_dir")
    g.add_argument("overrides", nargs="*", help="e.g. mesh.d=1 mesh.t=1")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=100)
    g.add_argument("--temperature", type=float, default=0.8, help="0 for greedy")
    g.add_argument("--top-k", type=int, default=40, help="0 for no top-k cut")
    g.add_argument("--num-samples", type=int, default=1)
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(fn=_generate_cmd)

    sub.add_parser(
        "plot",
        help="plot train/val loss of runs to a PNG (see `seqshard plot --help`)",
        add_help=False,
    )

    s = sub.add_parser(
        "show", help="resolved config, parameter count, layouts, FLOPs and memory per device"
    )
    s.add_argument("config")
    s.add_argument("overrides", nargs="*")
    s.add_argument(
        "--no-compile",
        action="store_true",
        help="skip compiling the train step (no communication table, no XLA memory figures)",
    )
    s.set_defaults(fn=_show)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "prepare":
        from seqshard.data import prepare_main

        return prepare_main(argv[1:])
    if argv and argv[0] == "plot":
        from seqshard.train.plot import plot_main

        return plot_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "generate" and args.top_k == 0:
        args.top_k = None
    try:
        return args.fn(args)
    except (ValueError, OSError, RuntimeError) as e:  # OSError: unwritable run.dir, data.dir, ...
        print(f"seqshard {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
