"""Global batches of packed tokens, sharded ``B/dp L/c`` on the mesh, with a prefetch thread.

    with Loader("data/tokens", "train", batch_size=32, seq_len=256, mesh=mesh) as loader:
        for batch in loader:    # TokenBatch(tokens, is_seq_start, loss_mask), each 'B/dp L/c'
            state = step_fn(state, batch)
            ckpt["data"] = loader.state()  # {'step': next step, 'seed': ..., ...}
    # resume: Loader(..., seed=ckpt["data"]["seed"], start_step=ckpt["data"]["step"])

The batch at step ``s`` is rows ``[s*B, (s+1)*B)`` of the split's packed stream
(:mod:`seqshard.data.packing`): a function of ``(data, seed, batch_size, seq_len, s)`` only, so
fresh loaders agree, resuming at ``s`` is exact, and no step needs the ones before it. Each
process reads only the rows its own devices hold (the ``d`` blocks of ``B``, as the
:class:`~seqshard.batch.TokenBatch` types split them) and hands them to
``jax.make_array_from_process_local_data``, so the same code runs on one host or many.
Each epoch's last ``n_tokens % seq_len`` tokens (the end of its last documents) are not emitted;
every other token is emitted exactly once per epoch.

Rows are ``seq_len`` tokens of the stream; a model predicting token ``i + 1`` from token ``i``
shifts within the row and masks the pairs that cross a document start (``is_seq_start``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import queue
import threading
import warnings
from pathlib import Path

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from seqshard.batch import TokenBatch
from seqshard.data.mixture import Mixture, MixturePlan
from seqshard.data.packing import PackedStream
from seqshard.data.tokenfile import META_FILE, TokenSplit, check_tokenizer, open_split, read_meta
from seqshard.shardlib.shardtypes import shardings

__all__ = ["EVAL_SEED", "Loader", "unigram_entropy"]

# eval_batches always shuffles val with this seed, so runs with different training seeds are
# evaluated on the same batches.
EVAL_SEED = 0
_POLL_S = 0.1  # how often blocked queue operations look at the stop flag


@dataclasses.dataclass(frozen=True)
class _Failure:
    error: BaseException


def _local_row_ranges(sharding: NamedSharding, global_shape: tuple[int, int]) -> list[range]:
    """The row ranges of ``global_shape`` this process's devices hold, sorted, each once (devices
    along ``t`` hold the same rows). Their concatenation is the process-local data that
    ``make_array_from_process_local_data`` expects."""
    rows = set()
    for index in sharding.addressable_devices_indices_map(global_shape).values():
        start, stop, _ = index[0].indices(global_shape[0])
        rows.add((start, stop))
    return [range(a, b) for a, b in sorted(rows)]


def _check_same_tokenizer(data_dirs: list[Path]) -> None:
    """Every directory's tokenizer is the one that made its ids, and all are the same one."""
    first = data_dirs[0]
    check_tokenizer(first)
    want = read_meta(first)["tokenizer_sha256"]
    for data_dir in data_dirs[1:]:
        check_tokenizer(data_dir)
        got = read_meta(data_dir)["tokenizer_sha256"]
        if got != want:
            raise ValueError(
                f"{data_dir / META_FILE} was tokenized with tokenizer sha256 {got[:16]}..., but "
                f"{first / META_FILE} with {want[:16]}...: a mixture's sources must share one "
                f"tokenizer (an id must mean one token). Re-run `seqshard prepare --out "
                f"{data_dir} --tokenizer {first / 'tokenizer.json'}`."
            )


def _combined_hash(splits: list[TokenSplit], mixture: Mixture | None) -> str:
    """The split's recorded hash; a mixture's: one hash of its sources' and stages'."""
    if mixture is None:
        return splits[0].sha256
    text = repr([(s.data_dir.name, s.sha256) for s in splits]) + repr(mixture.stages)
    return hashlib.sha256(text.encode()).hexdigest()


class Loader:
    """Batches of one split of a prepared data directory, or of a
    :class:`~seqshard.data.mixture.Mixture` of several (each row from its source's own stream,
    as the mixture's plan locates it); iterate it, or call :meth:`batch_at`.

    ``vocab`` (the model's vocabulary size), if given, is checked against the largest id in the
    split. ``prefetch`` batches are built ahead by a background thread (0: none, build on
    demand); errors there are raised by the next ``next()``. Call :meth:`close` (or use ``with``)
    to stop the thread.
    """

    def __init__(
        self,
        data: str | os.PathLike | Mixture,
        split: str,
        *,
        batch_size: int,
        seq_len: int,
        mesh: Mesh,
        seed: int = 0,
        vocab: int | None = None,
        prefetch: int = 2,
        start_step: int = 0,
    ) -> None:
        if "d" not in mesh.shape:
            raise ValueError(
                f"Loader needs a mesh with a 'd' axis to split the batch over; got axes "
                f"{tuple(mesh.shape)}. Build it with seqshard.mesh.training_mesh(sizes) or "
                f"mesh_of_sizes(sizes): every axis of seqshard.shardlib.axes, unnamed ones size 1."
            )
        n_d = mesh.shape["d"]
        if not isinstance(batch_size, int) or batch_size < 1 or batch_size % n_d:
            raise ValueError(
                f"batch_size must be a positive multiple of the mesh's d axis ({n_d}) so every "
                f"d shard gets whole rows; got {batch_size!r}. Use a multiple of {n_d}, or a "
                f"mesh whose d axis divides the batch size."
            )
        if not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be an int >= 0, got {start_step!r}.")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}.")
        self.mixture = data if isinstance(data, Mixture) else None
        self.data_dirs = (
            [Path(s.path) for s in self.mixture.sources] if self.mixture else [Path(data)]
        )
        self.data_dir, self.split_name = self.data_dirs[0], split
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, int(seed)
        self.mesh, self.vocab, self.prefetch = mesh, vocab, prefetch

        _check_same_tokenizer(self.data_dirs)
        self.splits = [self._open_checked(d, split) for d in self.data_dirs]
        self.streams = [PackedStream(s, seq_len, self.seed) for s in self.splits]
        self.split, self.stream = self.splits[0], self.streams[0]
        self.plan = MixturePlan(self.mixture, batch_size) if self.mixture else None
        self.shardings = shardings(TokenBatch, mesh)
        self._shape = (batch_size, seq_len)
        self._local_rows = _local_row_ranges(self.shardings.tokens, self._shape)
        self._val_streams: list[PackedStream] | None = None

        self._step = start_step  # the step the consumer gets next
        self._queue: queue.Queue = queue.Queue(maxsize=max(prefetch, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    @property
    def source_names(self) -> list[str]:
        """The sources' names (their directories' names), in the order of :attr:`splits`."""
        return [d.name for d in self.data_dirs]

    # -- reading -------------------------------------------------------------------------------

    def _open_checked(self, data_dir: Path, split: str) -> TokenSplit:
        data = open_split(data_dir, split)
        if self.vocab is not None and data.max_id >= self.vocab:
            raise ValueError(
                f"{data.path} holds token id {data.max_id}, but the model's vocab is "
                f"{self.vocab} (ids must be < vocab; the data's tokenizer has "
                f"{data.vocab_size} tokens). Set model.vocab >= {data.vocab_size}, or re-run "
                f"`seqshard prepare --vocab-size {self.vocab}` (or with --tokenizer of a "
                f"matching tokenizer.json)."
            )
        return data

    def _local_positions(self) -> np.ndarray:
        """The positions in the global batch of the rows this process's devices hold."""
        return np.concatenate([np.arange(r.start, r.stop) for r in self._local_rows])

    def _build(self, streams: list[PackedStream], step: int) -> TokenBatch:
        rows = self._local_positions()
        if self.plan is None or len(streams) == 1:
            tokens, starts, mask = streams[0].rows(step * self.batch_size + rows)
        else:
            source, source_rows = self.plan.locate(step, rows)
            tokens = np.empty((len(rows), self.seq_len), np.int32)
            starts = np.empty((len(rows), self.seq_len), np.bool_)
            mask = np.empty((len(rows), self.seq_len), np.bool_)
            for k in np.unique(source):
                at = source == k
                tokens[at], starts[at], mask[at] = streams[k].rows(source_rows[at])
        local = TokenBatch(tokens=tokens, is_seq_start=starts, loss_mask=mask)
        return jax.tree.map(
            lambda x, sharding: jax.make_array_from_process_local_data(sharding, x, self._shape),
            local,
            self.shardings,
        )

    def batch_at(self, step: int) -> TokenBatch:
        """The batch at ``step``, built now (independent of the iterator's position)."""
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}.")
        return self._build(self.streams, int(step))

    def tokens_drawn(self, step: int) -> dict[str, int]:
        """Tokens each source gave to steps ``0 .. step - 1``, by source name."""
        if self.plan is None:
            return {self.source_names[0]: step * self.batch_size * self.seq_len}
        rows = self.plan.rows_drawn(step)
        return {
            name: int(n) * self.seq_len for name, n in zip(self.source_names, rows, strict=True)
        }

    def eval_sets(self, n: int) -> dict[str, list[TokenBatch]]:
        """``n`` batches of each source's val split, by source name: the same ones on every
        call and for every training seed (shuffled with :data:`EVAL_SEED`), steps 0 .. n-1 of
        its stream."""
        if self._val_streams is None:
            self._val_streams = [
                PackedStream(self._open_checked(d, "val"), self.seq_len, EVAL_SEED)
                for d in self.data_dirs
            ]
        for stream in self._val_streams:
            if n * self.batch_size > stream.rows_per_epoch:
                warnings.warn(
                    f"eval_batches({n}) needs {n * self.batch_size} rows of {self.seq_len} "
                    f"tokens but {stream.split.path} has {stream.rows_per_epoch}; rows repeat "
                    f"(in new orders). Use fewer eval batches or a larger --val-fraction.",
                    stacklevel=2,
                )
        return {
            name: [self._build([stream], step) for step in range(n)]
            for name, stream in zip(self.source_names, self._val_streams, strict=True)
        }

    def eval_batches(self, n: int) -> list[TokenBatch]:
        """:meth:`eval_sets` of a loader of one data directory: its ``n`` val batches."""
        if self.mixture is not None:
            raise ValueError(
                "eval_batches is for a loader of one data directory; a mixture has a val set "
                "per source: use eval_sets."
            )
        return next(iter(self.eval_sets(n).values()))

    # -- iteration and the prefetch thread -----------------------------------------------------

    def __iter__(self) -> Loader:
        return self

    @property
    def step(self) -> int:
        """The step of the batch ``next()`` returns."""
        return self._step

    def __next__(self) -> TokenBatch:
        if self._failure is not None:
            raise self._failure
        if self._stop.is_set():
            raise StopIteration
        if self.prefetch == 0:
            batch = self.batch_at(self._step)
        else:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._produce, args=(self._step,), name="seqshard-loader", daemon=True
                )
                self._thread.start()
            item = self._get()
            if isinstance(item, _Failure):
                self._failure = item.error
                self.close()
                raise item.error
            _, batch = item  # the thread builds steps in order from self._step
        self._step += 1
        return batch

    def _get(self) -> tuple[int, TokenBatch] | _Failure:
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._thread is not None and not self._thread.is_alive() and self._queue.empty():
                    return _Failure(
                        RuntimeError("the loader's prefetch thread stopped unexpectedly")
                    )

    def _put(self, item: tuple[int, TokenBatch] | _Failure) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                pass
        return False

    def _produce(self, step: int) -> None:
        try:
            while not self._stop.is_set():
                if not self._put((step, self.batch_at(step))):
                    return
                step += 1
        except BaseException as e:  # handed to the consumer, which re-raises it
            self._put(_Failure(e))

    def close(self) -> None:
        """Stop and join the prefetch thread; iteration then ends. Safe to call twice."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            while thread.is_alive():
                try:  # unblock a pending put
                    self._queue.get_nowait()
                except queue.Empty:
                    thread.join(timeout=_POLL_S)

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- resumption ----------------------------------------------------------------------------

    def state(self) -> dict:
        """What a checkpoint needs to resume exactly: ``step`` is the next batch's step."""
        return {
            "step": self._step,
            "seed": self.seed,
            "split": self.split_name,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "data_hash": _combined_hash(self.splits, self.mixture),
        }

    def check_state(self, state: dict) -> None:
        """Raise ValueError if ``state`` (from :meth:`state`) was saved for a different stream
        than this loader's (other data, seed, split, batch size or sequence length)."""
        mine = self.state()
        diff = {k: (state.get(k), mine[k]) for k in mine if k != "step" and state.get(k) != mine[k]}
        if diff:
            shown = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise ValueError(
                f"the data state to resume was saved for a different stream ({shown}); resume "
                f"with the same data directory and settings, or start from step 0."
            )


def unigram_entropy(data_dir: str | os.PathLike, split: str = "train") -> float:
    """Entropy (nats per token) of the split's token frequencies: the loss of a model that knows
    only how often each token occurs. A model that learns anything goes below it."""
    data = open_split(data_dir, split)
    counts = np.zeros(data.vocab_size, np.int64)
    chunk = 1 << 24
    for shard in data.shards:
        for i in range(0, shard.n_tokens, chunk):
            counts += np.bincount(shard.tokens[i : i + chunk], minlength=data.vocab_size)
    p = counts[counts > 0] / data.n_tokens
    return float(-(p * np.log(p)).sum())
