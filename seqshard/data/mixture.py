"""Weighted mixtures of prepared token sets, in stages: which source each row of a global batch
comes from, and which row of that source's own stream it is.

    mixture = Mixture.of([("data/web", 0.7), ("data/code", 0.3)])          # one stage
    mixture = Mixture((Stage(0, ...), Stage(5000, (Source("data/web", 0.5), ...))))
    plan = MixturePlan(mixture, batch_size=32)
    source, source_row = plan.locate(step, np.arange(32))   # [32] each
    plan.rows_drawn(step)                                    # per source, in steps < step

Each stage's weights become whole counts ``n_k`` of a period of ``PERIOD`` rows (largest
remainder, so they sum to ``PERIOD`` exactly), spread evenly over the period: source ``k``'s
``j``-th row of a period sits at the rank of ``(j + 1/2) / n_k`` among all sources' such keys.
Row ``g`` of a stage (``g = (step - start) * B + r``) is slot ``g % PERIOD`` of period
``g // PERIOD``: its source and its rank among that source's rows are a table lookup, so every
row is located in constant time from ``(step, r)`` alone, with no count of the steps before.
Over each period the sources get exactly their counts; within one batch each source's share is
its weight's to within a row.

A source's rows are its own packed stream (:class:`~seqshard.data.packing.PackedStream`: its
epochs independent of the others', a small source repeating sooner, a large one never
exhausted); a source continues its stream from stage to stage (the rows it drew in earlier
stages are not drawn again).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

__all__ = ["PERIOD", "Mixture", "MixturePlan", "Source", "Stage", "mixture_of"]

PERIOD = 1 << 16
"""Rows in which a stage's weights are met exactly; the smallest weight a source may have is
``1 / PERIOD`` of the stage's total."""


@dataclasses.dataclass(frozen=True)
class Source:
    """A prepared token directory and its weight (any non-negative number; stages normalize)."""

    path: str
    weight: float

    @property
    def name(self) -> str:
        """The directory's name: its metrics keys (``tokens/<name>``, ``val_loss/<name>``)."""
        return Path(self.path).name


@dataclasses.dataclass(frozen=True)
class Stage:
    """Batches ``start_step`` on (until the next stage) draw rows from ``sources``; batch ``s``
    is the one of the step that follows ``s`` steps (logged as step ``s + 1``)."""

    start_step: int
    sources: tuple[Source, ...]


@dataclasses.dataclass(frozen=True)
class Mixture:
    """Stages with rising start steps, the first at step 0. Raises ValueError, naming the
    stage and source, for a negative or non-finite weight, a stage whose weights are all zero,
    a weight below ``1 / PERIOD`` of its stage, start steps out of order, or two sources with
    the same directory name (their metrics keys would clash)."""

    stages: tuple[Stage, ...]

    @classmethod
    def of(cls, sources: Sequence[tuple[str | os.PathLike, float]]) -> Mixture:
        """One stage of ``(path, weight)`` pairs."""
        return cls((Stage(0, tuple(Source(str(p), float(w)) for p, w in sources)),))

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a mixture needs at least one stage of sources.")
        if self.stages[0].start_step != 0:
            raise ValueError(
                f"the first stage starts at step {self.stages[0].start_step}; it must start at "
                f"step 0 (set its start_step to 0, or add a stage for steps before it)."
            )
        for before, stage in zip(self.stages, self.stages[1:], strict=False):
            if stage.start_step <= before.start_step:
                raise ValueError(
                    f"stage start steps must rise: {before.start_step} then {stage.start_step}; "
                    f"list the stages in step order, each start once."
                )
        for stage in self.stages:
            _check_weights(stage)
        names: dict[str, str] = {}
        for source in self.sources:
            if names.setdefault(source.name, source.path) != source.path:
                raise ValueError(
                    f"two sources are named {source.name!r} ({names[source.name]} and "
                    f"{source.path}): the per-source metrics would clash. Rename one directory."
                )

    @property
    def sources(self) -> tuple[Source, ...]:
        """Every source of any stage, once each (by path), in the order first listed; the
        weight is the first stage's that lists it."""
        seen: dict[str, Source] = {}
        for stage in self.stages:
            for source in stage.sources:
                seen.setdefault(source.path, source)
        return tuple(seen.values())

    def stage_at(self, step: int) -> Stage:
        starts = [s.start_step for s in self.stages]
        return self.stages[int(np.searchsorted(starts, step, side="right")) - 1]

    def weights_at(self, step: int) -> dict[str, float]:
        """Each source's share at ``step`` (summing to 1), by name."""
        stage = self.stage_at(step)
        total = sum(s.weight for s in stage.sources)
        shares = {s.name: 0.0 for s in self.sources}
        for s in stage.sources:
            shares[s.name] += s.weight / total
        return shares


def mixture_of(mixture: Sequence, stages: Sequence) -> Mixture | None:
    """The :class:`Mixture` of a config's ``data.mixture`` (items with ``path`` and ``weight``)
    and ``data.stages`` (items with ``start_step`` and ``mixture``); None if both are empty.
    ``mixture`` is the stage at step 0 unless a stage starts there (then it must be empty)."""
    listed = [(st.start_step, st.mixture) for st in stages]
    if mixture:
        if listed and listed[0][0] == 0:
            raise ValueError(
                "data.mixture and data.stages[0] (start_step 0) both say what step 0 reads; "
                "drop data.mixture, or start the first stage later."
            )
        listed.insert(0, (0, mixture))
    if not listed:
        return None
    return Mixture(
        tuple(
            Stage(start, tuple(Source(str(m.path), float(m.weight)) for m in sources))
            for start, sources in listed
        )
    )


def _check_weights(stage: Stage) -> None:
    where = f"stage at step {stage.start_step}"
    if not stage.sources:
        raise ValueError(f"the {where} lists no sources; give it at least one {{path, weight}}.")
    for s in stage.sources:
        if not math.isfinite(s.weight) or s.weight < 0:
            raise ValueError(
                f"the {where}: source {s.path} has weight {s.weight}; weights must be finite "
                f"and >= 0 (they are normalized: 0.7 and 0.3, or 7 and 3)."
            )
    total = sum(s.weight for s in stage.sources)
    if total == 0:
        raise ValueError(
            f"the {where}: every weight is 0 ({', '.join(s.path for s in stage.sources)}); "
            f"give at least one source a positive weight."
        )
    for s in stage.sources:
        if 0 < s.weight < total / PERIOD:
            raise ValueError(
                f"the {where}: source {s.path} has weight {s.weight}, below 1/{PERIOD} of the "
                f"stage's total {total}, too small to draw from; raise it or set it to 0."
            )


@dataclasses.dataclass(frozen=True)
class _StageTable:
    """One stage's period: each slot's source and rank among that source's slots."""

    start_step: int
    counts: np.ndarray  # int64 [n_sources]: rows of each source per period
    slot_source: np.ndarray  # int32 [PERIOD]
    slot_rank: np.ndarray  # int64 [PERIOD]

    def drawn(self, k: int, rows: int) -> int:
        """Rows of source ``k`` among the stage's first ``rows`` rows."""
        periods, rest = divmod(rows, PERIOD)
        return periods * int(self.counts[k]) + int(np.count_nonzero(self.slot_source[:rest] == k))


def _stage_table(stage: Stage, sources: tuple[Source, ...]) -> _StageTable:
    index = {s.path: k for k, s in enumerate(sources)}
    weights = np.zeros(len(sources))
    for s in stage.sources:
        weights[index[s.path]] += s.weight
    exact = weights / weights.sum() * PERIOD
    counts = np.floor(exact).astype(np.int64)
    by_remainder = np.argsort(-(exact - counts), kind="stable")
    counts[by_remainder[: PERIOD - int(counts.sum())]] += 1
    source = np.repeat(np.arange(len(sources), dtype=np.int32), counts)
    rank = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])
    keys = (rank + 0.5) / np.maximum(counts, 1)[source]
    order = np.lexsort((source, keys))  # by key, ties by source
    return _StageTable(stage.start_step, counts, source[order], rank[order])


class MixturePlan:
    """Where each row of each global batch comes from (see the module docstring)."""

    def __init__(self, mixture: Mixture, batch_size: int) -> None:
        self.mixture, self.batch_size = mixture, batch_size
        self.sources = mixture.sources
        self._tables = [_stage_table(stage, self.sources) for stage in mixture.stages]
        self._starts = np.asarray([t.start_step for t in self._tables], np.int64)
        # Rows each source drew in the stages before each stage.
        before = np.zeros((len(self._tables), len(self.sources)), np.int64)
        for i in range(1, len(self._tables)):
            rows = int(self._starts[i] - self._starts[i - 1]) * batch_size
            drawn = [self._tables[i - 1].drawn(k, rows) for k in range(len(self.sources))]
            before[i] = before[i - 1] + drawn
        self._before = before

    def _stage_index(self, step: int) -> int:
        return int(np.searchsorted(self._starts, step, side="right")) - 1

    def locate(self, step: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``rows`` (positions in the global batch) of ``step``: each one's source index
        and its row in that source's stream, both int64 ``[len(rows)]``."""
        i = self._stage_index(step)
        table = self._tables[i]
        g = (step - table.start_step) * self.batch_size + np.asarray(rows, np.int64)
        period, slot = np.divmod(g, PERIOD)
        source = table.slot_source[slot].astype(np.int64)
        source_row = self._before[i][source] + period * table.counts[source] + table.slot_rank[slot]
        return source, source_row

    def rows_drawn(self, step: int) -> np.ndarray:
        """Rows each source gave to steps ``0 .. step - 1`` (int64 ``[n_sources]``)."""
        if step <= 0:
            return np.zeros(len(self.sources), np.int64)
        i = self._stage_index(step - 1)
        table = self._tables[i]
        rows = (step - table.start_step) * self.batch_size
        drawn = [table.drawn(k, rows) for k in range(len(self.sources))]
        return self._before[i] + np.asarray(drawn, np.int64)
