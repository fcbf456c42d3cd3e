"""Text tables and byte counts, as every report of seqshard prints them (``seqshard show``, the
collective tables, the planner, the benchmarks, error messages)."""

from __future__ import annotations

from collections.abc import Collection, Sequence

__all__ = ["format_bytes", "format_table"]


def format_table(
    rows: Sequence[Sequence[str]], header: Sequence[str], right: Collection[int] = ()
) -> str:
    """A text table: columns padded to their widest cell, two spaces apart, a dashed line under
    the header; the columns numbered in ``right`` (numbers) aligned right, the others left."""
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        cells = (
            c.rjust(w) if i in right else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        return "  ".join(cells).rstrip()

    lines = [line(r) for r in (header, *rows)]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_bytes(n: float) -> str:
    """``1536 -> '1.50 KiB'``: binary units, two decimals; ``'512 B'`` below 1 KiB."""
    if n < 0:
        return "-" + format_bytes(-n)
    if n < 1024:
        return f"{int(n)} B"
    units = ("KiB", "MiB", "GiB", "TiB", "PiB")
    i = 0
    n /= 1024
    while n >= 1024 and i < len(units) - 1:
        n /= 1024
        i += 1
    return f"{n:.2f} {units[i]}"
