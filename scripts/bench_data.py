"""Data throughput: prepare's tokens/s with 1 and N workers, and the loader's tokens/s against
what the tiny-cpu train step consumes.

    python scripts/bench_data.py                       # ~40 MB corpus, N = os.cpu_count()
    python scripts/bench_data.py --mb 400 --workers 8

The corpus is the Python standard library's source repeated (with each copy's documents
numbered, so no two are equal) to about ``--mb`` megabytes, tokenized with the main job's
tokenizer (``--tokenizer``; data/stdlib/tokenizer.json once the main job ran), in shards of
``--shard-tokens``. Prepare runs with 1 worker, then N, on the same corpus (the two outputs are
checked equal). The loader reads ``--steps`` batches of configs/tiny-cpu.yaml's shape
(32 x 128) on one CPU device with no prefetch; the train step's rate is measured on the same
config (8 fake devices) over a few steps after compiling. Lines to read: ``prepare_speedup``,
``loader_ahead_ratio``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def corpus_of(mb: float):
    from seqshard.data.corpus import Corpus, stdlib_corpus

    base = list(stdlib_corpus())
    size = sum(len(d) for d in base)
    copies = max(1, round(mb * 1e6 / size))

    def documents():
        for c in range(copies):
            for i, doc in enumerate(base):
                yield f"# copy {c} document {i}\n{doc}"

    return Corpus(f"stdlib x {copies}", documents), copies * size


def timed_prepare(out: Path, corpus, config) -> float:
    from seqshard.data.prepare import prepare

    t0 = time.perf_counter()
    prepare(out, corpus, config, log=None)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=40)
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--shard-tokens", type=int, default=1 << 22)
    p.add_argument("--tokenizer", default="data/stdlib/tokenizer.json")
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()

    import jax
    import numpy as np

    from seqshard.batch import token_batch
    from seqshard.config import load_config
    from seqshard.data import Loader
    from seqshard.data.prepare import PrepareConfig
    from seqshard.data.tokenfile import read_meta
    from seqshard.mesh import mesh_of_sizes, training_mesh
    from seqshard.train.optimizer import make_optimizer
    from seqshard.train.state import init_train_state
    from seqshard.train.step import make_train_step

    corpus, chars = corpus_of(args.mb)
    config = PrepareConfig(tokenizer_path=args.tokenizer, shard_tokens=args.shard_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        one = timed_prepare(Path(tmp) / "one", corpus, config)
        many_config = dataclasses.replace(config, workers=args.workers)
        many = timed_prepare(Path(tmp) / "many", corpus, many_config)
        meta = read_meta(Path(tmp) / "one")
        tokens = sum(meta["splits"][s]["n_tokens"] for s in ("train", "val"))
        same = all(
            (Path(tmp) / "one" / f.name).read_bytes() == f.read_bytes()
            for f in (Path(tmp) / "many").iterdir()
        )
        print(
            f"corpus: {chars / 1e6:.1f} M characters, {tokens / 1e6:.2f} M tokens, "
            f"{len(meta['splits']['train']['shards'])} train shards"
        )
        print(f"prepare_tokens_per_s workers=1: {tokens / one:,.0f}")
        print(f"prepare_tokens_per_s workers={args.workers}: {tokens / many:,.0f}")
        print(f"prepare_speedup: {one / many:.2f} (outputs identical: {same})")

        cfg = load_config("configs/tiny-cpu.yaml")
        B, L = cfg.train.batch_size, cfg.train.seq_len
        one_device = mesh_of_sizes({}, jax.devices()[:1])
        with Loader(
            Path(tmp) / "one", "train", batch_size=B, seq_len=L, mesh=one_device, prefetch=0
        ) as loader:
            loader.batch_at(0)
            t0 = time.perf_counter()
            for step in range(1, args.steps + 1):
                jax.block_until_ready(loader.batch_at(step))
            loader_rate = args.steps * B * L / (time.perf_counter() - t0)
    mesh = training_mesh(cfg.mesh.sizes())
    opt = make_optimizer(cfg.train, cfg.model, mesh)
    state = init_train_state(cfg.model, mesh, opt, jax.random.key(0))
    step_fn = make_train_step(cfg, mesh, opt)

    rng = np.random.default_rng(0)
    batch = token_batch(rng.integers(0, cfg.model.vocab, (B, L)), np.zeros((B, L), bool))
    state, m = step_fn(state, batch)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(10):
        state, m = step_fn(state, batch)
    jax.block_until_ready(m)
    step_rate = 10 * B * L / (time.perf_counter() - t0)
    print(f"loader_tokens_per_s (one process, no prefetch): {loader_rate:,.0f}")
    print(f"train_step_tokens_per_s (tiny-cpu, 8 fake devices): {step_rate:,.0f}")
    print(f"loader_ahead_ratio: {loader_rate / step_rate:.1f}")


if __name__ == "__main__":
    main()
