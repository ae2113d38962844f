"""What the CPU and GPU schedules both need to know about loops."""

from __future__ import annotations

from tvm import s_tir, tirx


def static_extent(sch: s_tir.Schedule, loop) -> int | None:
    """Static trip count of a loop, or None when symbolic."""
    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, tirx.IntImm) else None
