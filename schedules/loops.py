"""What the CPU and GPU schedules both need to know about loops."""

from __future__ import annotations

from tvm import s_tir, tirx


def static_extent(sch: s_tir.Schedule, loop) -> int | None:
    """Static trip count of a loop, or None when symbolic."""
    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, tirx.IntImm) else None


def split_loops(sch: s_tir.Schedule, block) -> tuple[list, list]:
    """The block's (spatial, reduction) loops, from a compute definition (loops in iter-var order)."""
    iters = sch.get(block).iter_vars
    loops = sch.get_loops(block)
    spatial = [lp for lp, iv in zip(loops, iters) if iv.iter_type != tirx.IterVar.CommReduce]
    return spatial, [lp for lp in loops if lp not in spatial]
