"""Pipeline schedules over mesh axis p: which microbatch each stage works on at each tick.

A pipeline splits the scanned layers into blocks held by p stages and the batch into m
microbatches. The program runs in ticks: in a tick every stage runs the same program on its own
microbatch, then passes activations to the next stage (forward) and cotangents to the previous
one (backward), each one ``ppermute`` over p. A schedule is that timetable, written here once
and read by the pipelined step and by ``seqshard show``::

    gpipe     m + p - 1 forward ticks (microbatch i on stage s at tick i + s), then as many
              backward ticks in the reverse order. Stage s keeps the inputs of all m
              microbatches for its backward.
    circular  v virtual stages per device (``train.pipeline_repeats``): stage s holds layer
              blocks s, s + p, ..., s + (v-1)p, and a microbatch goes round the ring v times
              (repeat r of microbatch i on stage s at tick r·m + i + s; needs m >= p, so that
              a microbatch is back at stage 0 when its next round starts). v·m + p - 1
              forward ticks, then the backward mirrored.
    1f1b      p - 1 forward ticks fill the pipe; then each of m ticks runs one forward and one
              backward on every stage (forward of microbatch i on stage s at tick i + s,
              backward at tick i + 2(p-1) - s: on the last stage in the tick of its forward);
              p - 1 backward ticks drain it. Stage s keeps at most 2(p - s) - 1 inputs
              (the round trip to the last stage and back), not m.

Bubble fraction (idle share of the stage-ticks, a forward and a backward slot counted alike):
(p-1)/(m+p-1) for gpipe and 1f1b, (p-1)/(v·m+p-1) for circular.

    s = make_schedule("1f1b", p=4, m=8)
    s.bubble_fraction          # 3/11
    s.max_in_flight(stage=0)   # 7
    print(s.format_table())    # tick x stage: F3 (forward of microbatch 3), B0, idle '.'
"""

from __future__ import annotations

import dataclasses
from typing import Literal

__all__ = ["SCHEDULES", "Pipeline", "Schedule", "ScheduleName", "Task", "make_schedule"]

ScheduleName = Literal["gpipe", "circular", "1f1b"]
SCHEDULES: tuple[str, ...] = ("gpipe", "circular", "1f1b")


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """How a step runs its microbatches through the p stages (hashable: a jit cache key).

    ``Pipeline('1f1b', microbatches=8)``; from a config, ``train.pipeline_schedule``,
    ``train.microbatches`` and ``train.pipeline_repeats``."""

    schedule: ScheduleName = "gpipe"
    microbatches: int = 1
    repeats: int = 1

    def on(self, p: int) -> Schedule:
        """This pipeline's timetable over ``p`` stages."""
        return make_schedule(self.schedule, p, self.microbatches, self.repeats)

    def layer_order(self, p: int, n_layers: int) -> tuple[int, ...]:
        """The model's layer at each position of the stored stack over ``p`` stages.

        Stage s holds positions s·L/p to (s+1)·L/p - 1 (``'layers/p'``). The circular
        schedule's stage s runs, in round r, the model's block r·p + s of b = L/(p·v) layers,
        so it stores blocks s, s + p, ..., s + (v-1)·p: position s·v·b + r·b + j holds layer
        (r·p + s)·b + j. Every other pipeline (and p = 1) stores the model's order."""
        v = self.repeats if self.schedule == "circular" else 1
        if p == 1 or v == 1:
            return tuple(range(n_layers))
        if n_layers % (p * v):
            raise ValueError(
                f"model.n_layers={n_layers} does not split into mesh.p x "
                f"train.pipeline_repeats = {p} x {v} equal layer blocks."
            )
        b = n_layers // (p * v)
        return tuple((r * p + s) * b + j for s in range(p) for r in range(v) for j in range(b))


@dataclasses.dataclass(frozen=True, order=True)
class Task:
    """One stage's work in one tick: the forward or backward of ``microbatch`` through layer
    block ``block`` (its virtual stage: r·p + s for repeat r on stage s)."""

    microbatch: int
    block: int
    forward: bool

    def label(self, p: int, v: int) -> str:
        """``F3`` (forward of microbatch 3), ``B3``; with repeats ``F3.1`` (round 1)."""
        repeat = f".{self.block // p}" if v > 1 else ""
        return f"{'F' if self.forward else 'B'}{self.microbatch}{repeat}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """``ticks[t][s]``: the tasks stage s runs in tick t (none, a forward, a backward, or one
    of each), and ``kinds[t]``: what the program of tick t runs ('F', 'B' or 'FB')."""

    name: str
    p: int
    m: int
    v: int
    ticks: tuple[tuple[tuple[Task, ...], ...], ...]
    kinds: tuple[str, ...]

    @property
    def n_ticks(self) -> int:
        return len(self.ticks)

    @property
    def bubble_fraction(self) -> float:
        """Idle stage-slots over all: each tick offers each stage one slot per kind it runs."""
        slots = sum(len(k) for k in self.kinds) * self.p
        busy = sum(len(tasks) for tick in self.ticks for tasks in tick)
        return 1 - busy / slots

    def max_in_flight(self, stage: int) -> int:
        """The most microbatch inputs stage ``stage`` holds at once for backwards still to run
        (a forward's input is kept from its tick until its backward's, both included)."""
        held, most = 0, 0
        for tick in self.ticks:
            tasks = tick[stage]
            held += sum(t.forward for t in tasks)
            most = max(most, held)
            held -= sum(not t.forward for t in tasks)
        return most

    def format_table(self) -> str:
        """One row per tick, one column per stage: ``F3``, ``B0``, ``F4 B1``, ``.`` (idle)."""
        cells = [
            [" ".join(t.label(self.p, self.v) for t in tasks) or "." for tasks in tick]
            for tick in self.ticks
        ]
        width = max(len(f"stage {self.p - 1}"), *(len(c) for row in cells for c in row))
        head = "tick  " + " ".join(f"{f'stage {s}':>{width}}" for s in range(self.p))
        rows = [f"{t:>4}  " + " ".join(f"{c:>{width}}" for c in row) for t, row in enumerate(cells)]
        return "\n".join([head, *rows])


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The ``name`` schedule of ``m`` microbatches over ``p`` stages (``v`` repeats: circular).
    Raises ValueError naming the config key for a combination that cannot run."""
    if name not in SCHEDULES:
        raise ValueError(f"train.pipeline_schedule must be one of {SCHEDULES}, got {name!r}.")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(
            f"mesh.p, train.microbatches and train.pipeline_repeats must be >= 1; got {p}, {m}, {v}."
        )
    if name != "circular" and v != 1:
        raise ValueError(
            f"train.pipeline_repeats={v} needs train.pipeline_schedule=circular (got {name!r}): "
            f"only the circular schedule runs several layer blocks per stage."
        )
    if name == "circular" and v > 1 and m < p:
        raise ValueError(
            f"the circular schedule needs train.microbatches >= mesh.p (a microbatch must be "
            f"back at stage 0 when its next round starts); got {m} microbatches over p={p}."
        )
    if name == "1f1b":
        return _one_f_one_b(p, m)
    forward = [[[] for _ in range(p)] for _ in range(v * m + p - 1)]
    for r in range(v):
        for i in range(m):
            for s in range(p):
                forward[r * m + i + s][s].append(Task(i, r * p + s, True))
    backward = [
        [[Task(t.microbatch, t.block, False) for t in tasks] for tasks in tick]
        for tick in reversed(forward)
    ]
    ticks = forward + backward
    return Schedule(
        name,
        p,
        m,
        v,
        tuple(tuple(tuple(tasks) for tasks in tick) for tick in ticks),
        ("F",) * len(forward) + ("B",) * len(backward),
    )


def _one_f_one_b(p: int, m: int) -> Schedule:
    n = m + 2 * (p - 1)
    ticks: list[list[list[Task]]] = [[[] for _ in range(p)] for _ in range(n)]
    for i in range(m):
        for s in range(p):
            ticks[i + s][s].append(Task(i, s, True))
    for i in range(m):
        for s in range(p):
            ticks[i + 2 * (p - 1) - s][s].append(Task(i, s, False))
    kinds = tuple(
        "".join(
            k
            for k, f in (("F", True), ("B", False))
            if any(t.forward == f for ts in tick for t in ts)
        )
        for tick in ticks
    )
    return Schedule(
        "1f1b", p, m, 1, tuple(tuple(tuple(ts) for ts in tick) for tick in ticks), kinds
    )
