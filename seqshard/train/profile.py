"""A profile of some training steps (``train.profile``), and where their time went by op kind.

    train.profile: {start_step: 10, steps: 3}   # trace steps 10, 11, 12

writes a ``jax.profiler`` trace of those steps to ``RUN_DIR/profile/`` (process 0's devices;
in a multi-process run each other process writes its own to ``profile/process-<i>/``).
TensorBoard's profile plugin reads it (``tensorboard --logdir RUN_DIR/profile``);
ui.perfetto.dev opens its ``plugins/profile/<session>/perfetto_trace.json.gz``. Each step is marked
(``StepTraceAnnotation`` "train" with its number); the device ops and the runtime's host
activity are traced, Python function calls are not (``python_tracer_level=0``: on CPU they
were 98% of the events and made writing the trace take 20 s for 3 tiny steps).

:func:`summarize` reads it back (``scripts/profile_summary.py RUN_DIR`` prints it); the tiny
model of the tests on 8 fake CPU devices, d=4 x t=2, steps 4-6::

    op kind             ms/step   share
    ------------------  -------  ------
    all-gather           21.823   43.7%
    reduce-scatter       16.325   32.7%
    all-reduce            6.251   12.5%
    fusion                4.541    9.1%
    dot/convolution       0.551    1.1%
    ...

Tracing costs time: on CPU, where each op is traced on the host, those steps took 0.6-0.8 s
instead of 0.03 s, so read the shares more than the times (and the window's lines' tok/s
show the slowdown).

Each XLA op in the trace (an event naming its ``hlo_op``) counts its self time: an op running
inside another (the body of a ``while``) is taken out of the outer one. Its kind comes from
the program's HLO, which the trace holds (``<host>.xplane.pb``): the opcode, not the name
(JAX names an all-reduce ``psum_invariant.14`` or ``pmax.7``); a fusion or an async wrapper
counts as a collective or a dot if it holds one (a fused matmul is a matmul's time,
and cuBLAS gemms are dots). ``ms/step`` is per device and step: the ops' time summed over the
devices and the traced steps, divided by both. The time between ops (the host, waiting for
data) is in no row; compare the total with the run's ``step_time_s``. On CPU a collective's
time includes waiting for the slowest device (the fake devices share the cores). A window
holding an evaluation holds its program's ops too: the table of programs says which.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import jax

from seqshard.shardlib import comms
from seqshard.shardlib.tables import format_table

PROFILE_DIR = "profile"
STEP_NAME = "train"  # the StepTraceAnnotation of each traced step

COLLECTIVES = comms.KINDS  # the HLO collectives, as the compiled-program audits name them
DOT = "dot/convolution"
OTHER = "other"
OP_KINDS = ("fusion", DOT, *COLLECTIVES, "copy", OTHER)
"""The rows of the summary. An op's kind (:func:`hlo_kinds`), first that applies: a
collective (``-start``/``-done`` halves and ``ragged-all-to-all`` included), a dot or
convolution (or a custom call to a gemm), a fusion (holding neither), a copy, other."""

__all__ = [
    "COLLECTIVES",
    "DOT",
    "OP_KINDS",
    "OTHER",
    "PROFILE_DIR",
    "ProfileSummary",
    "ProfileWindow",
    "hlo_kinds",
    "summarize",
    "trace_files",
]


class ProfileWindow:
    """Traces steps ``start_step .. start_step + steps - 1`` into ``directory`` (nothing when
    ``steps`` is 0, or the run starts past them): :meth:`run` runs each step, :meth:`close`
    ends a trace a stop cut short. ``log`` gets a note when the trace is written."""

    def __init__(self, start_step: int, steps: int, directory: Path, log: Callable[[str], None]):
        self.first, self.last = start_step, start_step + steps - 1
        self.directory, self.log = Path(directory), log
        self._tracing = False
        self._started = start_step  # the first step traced (a resumed run may start later)

    def run(self, step: int, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, the step ``step``: traced (and waited for) if in the window."""
        if not self.first <= step <= self.last:
            return fn(*args)
        if not self._tracing:
            jax.block_until_ready(args)  # the steps before run outside the trace
            self.directory.mkdir(parents=True, exist_ok=True)
            options = jax.profiler.ProfileOptions()
            options.python_tracer_level = 0  # see the module docstring
            jax.profiler.start_trace(
                self.directory, create_perfetto_trace=True, profiler_options=options
            )
            self._tracing, self._started = True, step
        with jax.profiler.StepTraceAnnotation(STEP_NAME, step_num=step):
            out = fn(*args)
        if step == self.last:
            jax.block_until_ready(out)  # the trace holds the whole step
            self._stop(finished=True)
        return out

    def close(self) -> None:
        if self._tracing:
            self._stop(finished=False)

    def _stop(self, finished: bool) -> None:
        jax.profiler.stop_trace()
        self._tracing = False
        steps = f"steps {self._started}-{self.last}" if finished else f"from step {self._started}"
        cut = "" if finished else " (cut short by the stop)"
        self.log(
            f"profile of {steps}{cut} written to {self.directory}; "
            f"scripts/profile_summary.py {self.directory.parent} sums it by op kind"
        )


def trace_files(run_dir: str | os.PathLike[str]) -> list[Path]:
    """The ``<host>.trace.json.gz`` files (one per host; each beside its ``.xplane.pb``) of the
    newest profile of ``run_dir``. FileNotFoundError naming what was looked for if none."""
    sessions = Path(run_dir) / PROFILE_DIR / "plugins" / "profile"
    found = sorted(sessions.glob("*/*.trace.json.gz")) if sessions.is_dir() else []
    if not found:
        raise FileNotFoundError(
            f"no profile in {run_dir}: expected {sessions}/<session>/<host>.trace.json.gz, "
            f"which a run with train.profile.steps > 0 writes (e.g. train.profile.start_step=10 "
            f"train.profile.steps=3)."
        )
    newest = max({p.parent for p in found}, key=lambda d: d.name)  # sessions are timestamps
    return [p for p in found if p.parent == newest]


@dataclasses.dataclass(frozen=True)
class ProfileSummary:
    """Where the traced steps' op time went: seconds (self time summed over the devices and
    steps) per op kind (every one of :data:`OP_KINDS`) and per program (``jit_step``, ...)."""

    files: tuple[Path, ...]
    kinds: Mapping[str, float]
    programs: Mapping[str, float]
    steps: int  # StepTraceAnnotation events found (0: the trace marks none)
    devices: int

    def table(self) -> str:
        """The programs, then the op kinds, most time first: ms per device and step, share."""
        per = max(self.steps, 1) * max(self.devices, 1)
        unit = "ms/step" if self.steps else "ms"

        def rows(seconds: Mapping[str, float]) -> list[list[str]]:
            total = sum(seconds.values())
            ordered = sorted(seconds.items(), key=lambda kv: -kv[1])
            out = [
                [k, f"{s / per * 1e3:.3f}", f"{s / total:.1%}" if total else "-"]
                for k, s in ordered
            ]
            return [*out, ["total", f"{total / per * 1e3:.3f}", "100.0%" if total else "-"]]

        where = ", ".join(str(f) for f in self.files)
        return "\n\n".join(
            [
                f"{self.steps} steps on {self.devices} devices ({where})",
                format_table(rows(self.programs), ["program", unit, "share"], right={1, 2}),
                format_table(rows(self.kinds), ["op kind", unit, "share"], right={1, 2}),
            ]
        )


def summarize(run_dir: str | os.PathLike[str]) -> ProfileSummary:
    """The op time of the newest profile in ``run_dir`` (:func:`trace_files`) by op kind and
    by program. ValueError naming the file if its HLO is missing (a trace taken with
    ``enable_hlo_proto`` off): without the opcodes the kinds would be guesses."""
    files = trace_files(run_dir)
    kinds = dict.fromkeys(OP_KINDS, 0.0)
    programs: dict[str, float] = {}
    steps, devices = 0, set()
    for path in files:
        kind_of = hlo_kinds(path.with_name(path.name.replace(".trace.json.gz", ".xplane.pb")))
        with gzip.open(path, "rt", encoding="utf-8") as f:
            events = json.load(f)["traceEvents"]
        host_steps = 0
        ops: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
        thread_names = {}
        for e in events:
            args = e.get("args") or {}
            if e.get("ph") == "M" and e.get("name") == "thread_name":
                thread_names[e.get("pid"), e.get("tid")] = args.get("name")
            if e.get("ph") != "X":
                continue
            if e.get("name") == STEP_NAME and "step_num" in args:
                host_steps += 1
            elif "hlo_op" in args:
                ops.setdefault((e.get("pid"), e.get("tid")), []).append(e)
                devices.add((path, e.get("pid"), args.get("device_ordinal")))
        steps = max(steps, host_steps)  # every host traces the same steps
        # An accelerator's trace may show each op twice: its kernels on the streams and the op
        # on the derived "XLA Ops" line. Where a device has that line, it alone counts.
        # (Measured here on CPU only, which has no such line.)
        summed = {pid for (pid, tid) in ops if thread_names.get((pid, tid)) == "XLA Ops"}
        ops = {
            (pid, tid): line
            for (pid, tid), line in ops.items()
            if pid not in summed or thread_names.get((pid, tid)) == "XLA Ops"
        }
        for line in ops.values():
            for e, self_us in _self_times(line):
                module, op = e["args"].get("hlo_module", ""), e["args"]["hlo_op"]
                kinds[kind_of.get((module, op), OTHER)] += self_us * 1e-6
                programs[module] = programs.get(module, 0.0) + self_us * 1e-6
    return ProfileSummary(tuple(files), kinds, programs, steps, len(devices))


def _self_times(events: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float]]:
    """Each event of one thread with its duration less its nested events' (microseconds)."""
    events = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
    self_us = [float(e["dur"]) for e in events]
    stack: list[int] = []  # indices of the events enclosing the current one
    for i, e in enumerate(events):
        while stack and events[stack[-1]]["ts"] + events[stack[-1]]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            self_us[stack[-1]] -= e["dur"]
        stack.append(i)
    return list(zip(events, self_us, strict=True))


# -- the programs' HLO, from the trace's .xplane.pb --------------------------------------------

_GEMM_TARGET = re.compile(r"gemm|matmul|conv", re.IGNORECASE)
_WRAPPERS = ("fusion", "async-start", "async-update", "async-done")  # kind: what they hold


def hlo_kinds(xplane: Path) -> dict[tuple[str, str], str]:
    """``{(program, op name): kind}`` of every instruction of every program in ``xplane`` (a
    ``.xplane.pb``: its ``/host:metadata`` plane holds each program's ``HloProto``)."""
    space = _messages()["XSpace"].FromString(xplane.read_bytes())
    out: dict[tuple[str, str], str] = {}
    found = False
    for plane in space.planes:
        hlo_stat = {k for k, v in plane.stat_metadata.items() if v.name == "Hlo Proto"}
        for meta in plane.event_metadata.values():
            for stat in meta.stats:
                if stat.metadata_id in hlo_stat:
                    found = True
                    module = _messages()["Hlo"].FromString(stat.bytes_value).hlo_module
                    for name, kind in _module_kinds(module).items():
                        out.setdefault((module.name, name), kind)
    if not found:
        raise ValueError(
            f"{xplane} holds no program's HLO (ProfileOptions.enable_hlo_proto was off?), so "
            f"the ops' kinds are unknown. Profile again with train.profile."
        )
    return out


def _module_kinds(module) -> dict[str, str]:
    computations = {c.id: c for c in module.computations}
    memo: dict[int, str | None] = {}

    def held(ids: Iterable[int]) -> str | None:
        """The strongest kind (a collective, then a dot) among called computations' ops."""
        found = [inner(i) for i in ids]
        for kind in (*COLLECTIVES, DOT):
            if kind in found:
                return kind
        return None

    def inner(comp_id: int) -> str | None:
        if comp_id not in memo:
            memo[comp_id] = None  # a computation never calls itself; guards a malformed proto
            kinds = (
                [kind(i) for i in computations[comp_id].instructions]
                if comp_id in computations
                else []
            )
            memo[comp_id] = next((k for k in (*COLLECTIVES, DOT) if k in kinds), None)
        return memo[comp_id]

    def kind(inst) -> str:
        op = inst.opcode.removesuffix("-start").removesuffix("-done")
        op = "all-to-all" if op == "ragged-all-to-all" else op
        if op in COLLECTIVES:
            return op
        if op in ("dot", "convolution") or (
            op == "custom-call" and _GEMM_TARGET.search(inst.custom_call_target)
        ):
            return DOT
        if inst.opcode in _WRAPPERS:
            return held(inst.called_computation_ids) or (
                "fusion" if inst.opcode == "fusion" else OTHER
            )
        if op == "copy":
            return "copy"
        return OTHER  # while / conditional / call: their ops are traced (and counted) themselves

    return {i.name: kind(i) for c in module.computations for i in c.instructions}


@functools.cache
def _messages() -> dict[str, Any]:
    """Protobuf classes for the parts of the trace read here: ``XSpace`` (tsl's
    ``profiler/protobuf/xplane.proto``) and ``Hlo`` (xla's ``HloProto``), with the fields used
    and their numbers from those files; the other fields are skipped when parsing."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    one, many = F.LABEL_OPTIONAL, F.LABEL_REPEATED
    i64, text, data, sub = F.TYPE_INT64, F.TYPE_STRING, F.TYPE_BYTES, F.TYPE_MESSAGE
    pkg = "seqshard_profile"
    file = descriptor_pb2.FileDescriptorProto(name=f"{pkg}.proto", package=pkg, syntax="proto3")

    def message(parent, name: str, fields) -> Any:
        m = parent.add(name=name)
        for field_name, number, kind, label, *of in fields:
            f = m.field.add(name=field_name, number=number, type=kind, label=label)
            if of:
                f.type_name = f".{pkg}.{of[0]}"
        return m

    types = file.message_type
    message(types, "XStat", [("metadata_id", 1, i64, one), ("bytes_value", 6, data, one)])
    message(types, "XStatMetadata", [("id", 1, i64, one), ("name", 2, text, one)])
    message(
        types,
        "XEventMetadata",
        [("id", 1, i64, one), ("name", 2, text, one), ("stats", 5, sub, many, "XStat")],
    )
    plane = message(types, "XPlane", [("name", 2, text, one)])
    for field_name, number, value in (
        ("event_metadata", 4, "XEventMetadata"),
        ("stat_metadata", 5, "XStatMetadata"),
    ):
        entry = f"{value}Entry"
        m = message(plane.nested_type, entry, [("key", 1, i64, one), ("value", 2, sub, one, value)])
        m.options.map_entry = True
        plane.field.add(
            name=field_name, number=number, type=sub, label=many, type_name=f".{pkg}.XPlane.{entry}"
        )
    message(types, "XSpace", [("planes", 1, sub, many, "XPlane")])
    message(
        types,
        "HloInstruction",
        [
            ("name", 1, text, one),
            ("opcode", 2, text, one),
            ("custom_call_target", 28, text, one),
            ("called_computation_ids", 38, i64, many),
        ],
    )
    message(
        types,
        "HloComputation",
        [
            ("name", 1, text, one),
            ("instructions", 2, sub, many, "HloInstruction"),
            ("id", 5, i64, one),
        ],
    )
    message(
        types,
        "HloModule",
        [("name", 1, text, one), ("computations", 3, sub, many, "HloComputation")],
    )
    message(types, "Hlo", [("hlo_module", 1, sub, one, "HloModule")])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{pkg}.{name}"))
        for name in ("XSpace", "Hlo")
    }
