"""Communication of a compiled program, read off its optimized HLO: what moves, where, how often.

Each collective instruction becomes a :class:`Collective` with its kind, the mesh axes it runs
over (from its replica groups), its result shapes, the phase of the training step it belongs
to (from the op name JAX records: ``jvp`` forward, ``transpose`` backward, ``rematted``
recomputation, neither: the optimizer update), and how many times a step runs it: a ``lax.scan`` body appears once in the
HLO but runs ``known_trip_count`` times.

Bytes sent per device per call assume ring algorithms over a group of n devices:

    all-gather       (n-1)/n x result          reduce-scatter   (n-1) x result (the shard)
    all-reduce       2 (n-1)/n x result        all-to-all       (n-1)/n x result
    collective-permute   result
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re

import numpy as np

from seqshard.shardlib.tables import format_bytes, format_table

__all__ = [
    "Collective",
    "called_computations",
    "collectives",
    "format_comm_table",
    "hlo_computations",
    "ring_bytes_sent",
]

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%(?P<name>[\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(
    r"=\s*(?P<type>.*?)\s(?P<op>all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)"
    r"(?P<start>-start)?\("
)
_CALLEES = re.compile(
    r"(?:calls|to_apply|body|condition)=%([\w.\-]+)|branch_computations=\{([^}]*)\}"
)
_WHILE_BODY = re.compile(r"\swhile\(.*body=%([\w.\-]+)")
_TRIP_COUNT = re.compile(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)')
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[\d,\s]*\}(?:,\s*\{[\d,\s]*\})*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
# mesh['axis_0'=2,'axis_1'=4] {'axis_1'}: the devices as a mesh (optionally permuted by a
# device_ids iota), grouped over the axes in braces (all of them when there are none).
_GROUPS_MESH = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\(\[(?P<ids>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?\))?"
    r"(?:\s*\{(?P<over>[^}]*)\})?"
)
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# An HLO array type: pred, s32, bf16, ... and FP8's f8e4m3fn, f8e5m2 (format after the width).
_ARRAY = re.compile(r"\b(pred|[a-z]+\d+(?:e\d+m\d+(?:fnuz|fn)?)?)\[([\d,]*)\]")
_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,  # FP8 (seqshard.shardlib.fp8): weights gathered in e4m3
    "f8e5m2": 1,
    "f8e4m3fnuz": 1,
    "f8e5m2fnuz": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program."""

    kind: str
    result_type: str  # as printed in the HLO, e.g. 'f32[4,16,32]{1,0,2}'
    replica_groups: str  # as printed, e.g. '{{0,1,2,3},{4,5,6,7}}'
    axes: tuple[str, ...] = ()  # mesh axes it runs over, major to minor (empty without a mesh)
    group_size: int = 0
    phase: str = "update"  # 'forward', 'backward', 'recompute' or 'update' (optimizer, metrics)
    in_loop: bool = False  # inside a while loop (a scanned layer body)
    calls_per_step: int = 1  # times one execution of the program runs it
    op_name: str = ""

    @property
    def result_arrays(self) -> list[tuple[str, tuple[int, ...]]]:
        """(dtype, shape) of each array of the result (an async all-gather start's: the gathered one)."""
        arrays = [
            (dt, tuple(int(d) for d in dims.split(",") if d))
            for dt, dims in _ARRAY.findall(self.result_type)
        ]
        return (
            arrays[-1:]
            if self.result_type.startswith("(") and self.kind == "all-gather"
            else arrays
        )

    @property
    def result_shapes(self) -> list[tuple[int, ...]]:
        """The shapes of the result's arrays (several for a tuple-shaped, combined collective)."""
        return [shape for _, shape in self.result_arrays]

    @property
    def result_bytes(self) -> int:
        return sum(_BYTES.get(dt, 4) * math.prod(shape) for dt, shape in self.result_arrays)

    @property
    def bytes_sent(self) -> float:
        """Bytes one device sends per call (ring algorithms; see the module docstring)."""
        return ring_bytes_sent(self.kind, self.group_size, self.result_bytes)

    @property
    def shape_text(self) -> str:
        counts = collections.Counter(
            f"{dt}[{','.join(map(str, s))}]" for dt, s in self.result_arrays
        )
        return " ".join(a if n == 1 else f"{n} x {a}" for a, n in counts.items())


def ring_bytes_sent(kind: str, group_size: int, result_bytes: float) -> float:
    """Bytes one device sends for one ``kind`` collective over ``group_size`` devices whose
    per-device result is ``result_bytes`` (ring algorithms; see the module docstring).

    The one formula for both the compiled program's collectives (:class:`Collective`) and the
    planner's (:mod:`seqshard.plan.planner`)."""
    n, r = group_size, result_bytes
    if n <= 1:
        return 0.0
    return {
        "all-gather": (n - 1) / n * r,
        "reduce-scatter": (n - 1) * r,
        "all-reduce": 2 * (n - 1) / n * r,
        "all-to-all": (n - 1) / n * r,
        "collective-permute": r,
    }[kind]


def _ring_groups(pairs_text: str) -> list[list[int]]:
    """A collective-permute's devices grouped by the pairs that connect them (one ring each),
    each group in ring order from its lowest device."""
    pairs = [tuple(map(int, p)) for p in re.findall(r"\{(\d+),(\d+)\}", pairs_text)]
    after = dict(pairs)
    groups, seen = [], set()
    for start in sorted(after):
        if start in seen:
            continue
        group, device = [], start
        while device not in seen and device in after:
            seen.add(device)
            group.append(device)
            device = after[device]
        groups.append(group)
    return groups


def _groups(line: str) -> list[list[int]]:
    m = _PAIRS.search(line)
    if m:
        return _ring_groups(m.group(1))
    m = _GROUPS_LIST.search(line)
    if m:
        return [
            [int(x) for x in g.split(",") if x.strip()]
            for g in re.findall(r"\{([\d,\s]*)\}", m.group(1))
        ]
    m = _GROUPS_IOTA.search(line)
    if m:
        n_groups, size = int(m.group(1)), int(m.group(2))
        dims = [int(x) for x in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(x) for x in m.group(4).split(",")])
        return ids.reshape(n_groups, size).tolist()
    m = _GROUPS_MESH.search(line)
    if m:
        names = re.findall(r"'([^']+)'=\d+", m["axes"])
        sizes = [int(n) for n in re.findall(r"=(\d+)", m["axes"])]
        ids = np.arange(math.prod(sizes))
        if m["ids"]:
            ids = ids.reshape([int(x) for x in m["ids"].split(",")])
            if m["perm"]:
                ids = ids.transpose([int(x) for x in m["perm"].split(",")])
        ids = ids.reshape(sizes)
        over_names = re.findall(r"'([^']+)'", m["over"] or "")
        over = [names.index(a) for a in over_names] if over_names else list(range(len(sizes)))
        rest = [i for i in range(len(sizes)) if i not in over]
        return ids.transpose(rest + over).reshape(-1, math.prod(sizes[i] for i in over)).tolist()
    return []


def _groups_text(line: str) -> str:
    m = _GROUPS_LIST.search(line) or _GROUPS_IOTA.search(line) or _GROUPS_MESH.search(line)
    if m is None:
        m = _PAIRS.search(line)
        return m.group(0).removeprefix("source_target_pairs=") if m else ""
    return m.group(0).removeprefix("replica_groups=") if m else ""


def _axes_of(
    group: list[int], mesh_shape: tuple[int, ...], axis_names: tuple[str, ...]
) -> tuple[str, ...]:
    """The mesh axes along which a group's devices differ, the slowest-changing first."""
    if len(group) <= 1:
        return ()
    coords = np.array(np.unravel_index(group, mesh_shape)).T  # [group, n_axes]
    varying = [a for a in range(len(mesh_shape)) if len(set(coords[:, a])) > 1]
    # The minor axis changes between consecutive members; a major one changes least often.
    changes = {a: int(np.sum(coords[1:, a] != coords[:-1, a])) for a in varying}
    return tuple(axis_names[a] for a in sorted(varying, key=lambda a: changes[a]))


def _phase(op_name: str) -> str:
    if "rematted_computation" in op_name:
        return "recompute"
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return "update"  # outside the differentiated function: the optimizer step, metrics


def hlo_computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
    """An HLO module's computations: ({name: its instruction lines}, the entry's name)."""
    body_of: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m["name"]
            body_of[current] = []
            if m.group(1):
                entry = current
        elif current is not None:
            if line.strip() == "}":
                current = None
            else:
                body_of[current].append(line)
    return body_of, entry


def called_computations(line: str) -> list[str]:
    """The computations an HLO instruction line calls (fusions, reductions, a while's body and
    condition, a conditional's branches)."""
    return [
        name
        for callee, branches in _CALLEES.findall(line)
        for name in ([callee] if callee else re.findall(r"%([\w.\-]+)", branches))
    ]


def collectives(hlo_text: str, mesh=None) -> list[Collective]:
    """Every collective of an optimized HLO module, with calls per execution and mesh axes.

    ``mesh`` (a ``jax.sharding.Mesh``) maps replica groups to axis names; device ids in the
    groups are positions in ``mesh.devices.flat`` (SPMD partition ids).
    """
    body_of, entry = hlo_computations(hlo_text)

    # How many times each computation runs per execution: ENTRY once; a while body its trip
    # count times its caller's; anything else called (fusions, reductions) as its caller.
    runs: dict[str, int] = collections.defaultdict(int)
    looped: set[str] = set()

    def visit(name: str, times: int, in_loop: bool) -> None:
        runs[name] += times
        if in_loop:
            looped.add(name)
        for line in body_of.get(name, []):
            body = _WHILE_BODY.search(line)
            trip = _TRIP_COUNT.search(line)
            for c in called_computations(line):
                if body and c == body.group(1):
                    visit(c, times * (int(trip.group(1)) if trip else 1), True)
                elif c in body_of and c != name:
                    visit(c, times, in_loop)

    if entry is not None:
        visit(entry, 1, False)
    mesh_shape = tuple(mesh.devices.shape) if mesh is not None else ()
    names = tuple(mesh.axis_names) if mesh is not None else ()
    found = []
    for name, body in body_of.items():
        for line in body:
            m = _INSTRUCTION.search(line)
            if not m:
                continue
            groups = _groups(line)
            group = groups[0] if groups else []
            op = _OP_NAME.search(line)
            found.append(
                Collective(
                    kind=m["op"],
                    result_type=m["type"],
                    replica_groups=_groups_text(line),
                    axes=_axes_of(group, mesh_shape, names) if mesh is not None else (),
                    group_size=len(group),
                    phase=_phase(op.group(1) if op else ""),
                    in_loop=name in looped,
                    calls_per_step=runs.get(name, 0) or 1,
                    op_name=op.group(1) if op else "",
                )
            )
    return found


def format_comm_table(calls: list[Collective]) -> str:
    """One row per (phase, place, kind, axes, shape): calls per step and bytes sent per device."""
    rows = collections.OrderedDict()
    order = {"forward": 0, "recompute": 1, "backward": 2, "update": 3}
    for c in sorted(
        calls, key=lambda c: (order[c.phase], not c.in_loop, KINDS.index(c.kind), c.axes)
    ):
        key = (
            c.phase,
            "layers" if c.in_loop else "outside",
            c.kind,
            "/".join(c.axes) or "-",
            c.shape_text,
        )
        count, sent = rows.get(key, (0, 0.0))
        rows[key] = (count + c.calls_per_step, sent + c.calls_per_step * c.bytes_sent)
    header = (
        "phase",
        "where",
        "collective",
        "axes",
        "result per device",
        "calls",
        "sent per device",
    )
    body = [(*k, str(n), format_bytes(b)) for k, (n, b) in rows.items()]
    total = sum(b for _, b in rows.values())
    by_axis = collections.Counter()
    for c in calls:
        by_axis["/".join(c.axes) or "-"] += c.calls_per_step * c.bytes_sent
    out = format_table(body, header).split("\n")
    out.append(
        f"total sent per device per step: {format_bytes(total)} ("
        + ", ".join(f"over {a}: {format_bytes(b)}" for a, b in sorted(by_axis.items()))
        + ")"
    )
    return "\n".join(out)
