"""Test set-up: 8 fake CPU devices and -O0 code generation before JAX starts, strict numpy rank
promotion."""

import atexit
import os
import shutil
import tempfile

from process_helpers import TEST_COMPILE_FLAGS  # no JAX import there

# 8 fake devices, and LLVM at -O0 (process_helpers.TEST_COMPILE_FLAGS says why) unless the
# environment already chooses an optimization level.
_flags = os.environ.get("XLA_FLAGS", "")
if "--xla_backend_optimization_level" not in _flags:
    _flags += " " + TEST_COMPILE_FLAGS
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# JAX's persistent compilation cache, for this session and the `seqshard` processes its tests
# start (they inherit the environment): the run-level tests compile the same programs again and
# again (a train step in a module's fixture, then in a subprocess of the CLI, ...), and a hit
# costs a read instead of a compile (measured on 2 cores: -31 s for test_checkpoint, test_loop
# and hf together, -6 s for test_cli; nothing won or lost for the model tests). A fresh
# directory per session, removed at its end; set JAX_COMPILATION_CACHE_DIR to keep one.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache_dir = tempfile.mkdtemp(prefix="seqshard-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache_dir
if "PYTEST_XDIST_WORKER" in os.environ:  # a directory per worker: the writes are not atomic
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
        os.environ["JAX_COMPILATION_CACHE_DIR"], os.environ["PYTEST_XDIST_WORKER"]
    )
# The CPU's measured peak (MFU's denominator) is kept per machine: in a directory of the
# session's, not the user's ~/.cache (tests/test_hardware.py gives each of its tests its own).
if "SEQSHARD_CACHE_DIR" not in os.environ:
    _seqshard_cache = tempfile.mkdtemp(prefix="seqshard-tests-cache-")
    atexit.register(shutil.rmtree, _seqshard_cache, ignore_errors=True)
    os.environ["SEQSHARD_CACHE_DIR"] = _seqshard_cache
# The CPU's matmul class (seqshard/shardlib/matmul.py) pinned to 'bf16' whatever the CPU's
# flags: the tests that count a compiled bf16 step's dots by dtype expect one machine-independent
# path; tests/shardlib/test_matmul.py forces each class in turn.
os.environ.setdefault("SEQSHARD_CPU_MATMUL", "bf16")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])


# -- a tiny prepared corpus and model for the run-level tests (config, checkpoint, loop, cli) --

import random  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# Model sizes every mesh of 8 devices used by the run tests divides (4x2, 2x4, 8x1):
# vocab and d_ff and n_kv by t <= 4, d_model by d * t = 8. vocab >= the tokenizer's 300.
TINY_MODEL = {
    "vocab": 320,
    "d_model": 32,
    "n_layers": 2,
    "n_q_per_kv": 2,
    "n_kv": 4,
    "d_head": 8,
    "d_ff": 64,
    "compute_dtype": "float32",
    "attention_impl": "einsum",
}
TINY_VOCAB = 300  # the BPE the corpus fixture trains


def _write_corpus(root: Path, n_docs: int = 60) -> None:
    """Short documents of prose and Python, deterministic."""
    rng = random.Random(0)
    words = (  # noqa: SIM905 (a sentence reads better than a 27-line list)
        "the of and to in is was for on that with as by at from data model train step loss "
        "value batch mesh shard token layer head"
    ).split()
    root.mkdir(parents=True)
    for i in range(n_docs):
        if i % 2:
            body = "\n".join(
                f"def f{i}_{j}(x, y):\n    return x * {j} + y  # {rng.choice(words)}\n"
                for j in range(rng.randint(3, 8))
            )
            (root / f"code{i:02d}.py").write_text(body)
        else:
            body = " ".join(rng.choice(words) for _ in range(rng.randint(80, 200)))
            (root / f"text{i:02d}.txt").write_text(body.capitalize() + ".\n")


@pytest.fixture(scope="session")
def tiny_model_config():
    """``tiny_model_config(**changes)``: the tests' tiny ModelConfig (tests/model_weights.py)."""
    from model_weights import tiny_model

    return tiny_model


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus") / "text"
    _write_corpus(root)
    return root


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory, corpus_dir) -> Path:
    """A prepared data directory: a 300-token BPE, ~13k train and ~1.3k val tokens."""
    from seqshard.data import path_corpus, prepare
    from seqshard.data.prepare import PrepareConfig

    out = tmp_path_factory.mktemp("data") / "tokens"
    config = PrepareConfig(vocab_size=TINY_VOCAB, val_fraction=0.1)
    prepare(out, path_corpus([corpus_dir]), config, log=None)
    return out


@pytest.fixture(scope="session")
def tiny_overrides(data_dir):
    """``tiny_overrides(run_dir, name="tiny", **train)``: overrides for a run of the tiny model
    on a 4x2 mesh over ``data_dir``: 6 steps of 8 x 32 tokens, every step logged, val loss every
    3 steps, a checkpoint at the end. ``train`` replaces train.* values."""

    def make(run_dir: Path, name: str = "tiny", **train) -> list[str]:
        t = {
            "steps": 6,
            "batch_size": 8,
            "seq_len": 32,
            "warmup_steps": 2,
            "log_every": 1,
            "eval_every": 3,
            "eval_batches": 2,
            "checkpoint_every": 0,
            "peak_flops": 1e10,  # skip measuring the CPU's peak (seconds of matmuls)
            **train,
        }
        return [
            *(f"model.{k}={v}" for k, v in TINY_MODEL.items()),
            "mesh.d=4",
            "mesh.t=2",
            *(f"train.{k}={v}" for k, v in t.items()),
            f"data.dir={data_dir}",
            f"data.vocab_size={TINY_VOCAB}",
            f"run.dir={run_dir}",
            f"run.name={name}",
        ]

    return make


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory, tiny_overrides):
    """One trained run for the tests that read one (tests/train/test_checkpoint.py, and
    test_loop.py's resumptions): the tiny model of ``tiny_overrides`` trained 6 steps on 4x2,
    ``run_helpers.TRAINED_RUN``: the lr constant after warmup (``min_lr_ratio=1``, so that resumed to any
    length it equals a straight run), a checkpoint every 2 steps, 2 kept (4 and 6).
    ``(config, run_dir)``, the run named "trained". Read only: copy it to change it."""
    from run_helpers import TRAINED_RUN

    from seqshard.config import load_config
    from seqshard.train.loop import train

    runs = tmp_path_factory.mktemp("trained_run")
    cfg = load_config(None, tiny_overrides(runs, "trained", **TRAINED_RUN))
    result = train(cfg, log=lambda _: None, tty=False)
    assert result.step == 6 and not result.interrupted
    return cfg, result.run_dir


@pytest.fixture(scope="session")
def tiny_yaml(data_dir):
    """``tiny_yaml(path, run_dir, data=data_dir)``: write a config at ``path``, layered over the
    shipped tiny-cpu.yaml, that trains the tiny model of ``tiny_overrides`` (6 steps) on
    ``data`` into ``run_dir``."""
    tiny_cpu = Path(__file__).resolve().parent.parent / "configs" / "tiny-cpu.yaml"

    def make(path: Path, run_dir: Path, data: Path = data_dir) -> Path:
        model = ", ".join(f"{k}: {v}" for k, v in TINY_MODEL.items())
        path.write_text(
            f"base: {tiny_cpu}\n"
            f"model: {{{model}}}\n"
            f"data: {{dir: {data}, vocab_size: {TINY_VOCAB}}}\n"
            "train: {steps: 6, batch_size: 8, seq_len: 32, warmup_steps: 2, log_every: 1,\n"
            "        eval_every: 3, eval_batches: 2, checkpoint_every: 0, peak_flops: 1.0e+10}\n"
            f"run: {{dir: {run_dir}}}\n"
        )
        return path

    return make


# -- scheduling: the longest test files first -------------------------------------------------

# pytest-xdist (--dist loadfile) hands out whole files in collection order, so a long file
# collected last keeps one worker busy while the other idles. Starting with the longest files
# (the longest-processing-time-first rule) leaves the short ones to fill in at the end.
# Measured sums per file on 2 cores, seconds; the others keep their order after these.
LONGEST_FIRST = (
    "tests/model/pipeline/test_pipelined.py",  # ~120
    "tests/train/test_step.py",  # ~80
    "tests/model/test_context.py",  # ~65
    "tests/model/test_moe.py",  # ~60
    "tests/train/test_loop.py",  # ~60
    "tests/model/test_transformer.py",  # ~60
    "tests/model/test_backward.py",  # ~55
    "tests/plan/test_step_comms.py",  # ~50
    "tests/plan/test_planner.py",  # ~45
    "tests/train/test_checkpoint.py",  # ~45
    "tests/test_launch.py",  # ~40
    "tests/test_cli.py",  # ~40
    "tests/train/test_moe_training.py",  # ~40
)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = Path(str(config.rootpath))

    def key(item) -> int:
        path = Path(str(item.path)).relative_to(root).as_posix()
        return rank.get(path, len(LONGEST_FIRST))

    items.sort(key=key)  # stable: each file's tests keep their order
