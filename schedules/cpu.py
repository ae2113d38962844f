"""CPU schedules: rows across cores, inner loops as SIMD vectors, reductions split into vector lanes.

Schedules change loop structure only; the compute definitions in `compiler.kernels` fix meaning.
"""

from __future__ import annotations

from tvm import s_tir, tirx


def _extent(sch: s_tir.Schedule, loop) -> int | None:
    """Static trip count of a loop, or None when symbolic."""
    ext = sch.get(loop).extent
    return int(ext) if isinstance(ext, tirx.IntImm) else None


def _is_reduction(sch: s_tir.Schedule, block) -> bool:
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(block).iter_vars)


def _spatial(sch: s_tir.Schedule, block, lanes: int) -> None:
    """Fuse all loops, run chunks of them on the cores, vectorise the innermost `lanes`."""
    fused = sch.fuse(*sch.get_loops(block))
    ext = _extent(sch, fused)
    if ext is not None and ext % lanes == 0 and ext > lanes:
        outer, inner = sch.split(fused, [None, lanes])
        sch.parallel(outer)
        sch.vectorize(inner)
    else:
        sch.parallel(fused)


def _reduction(sch: s_tir.Schedule, block) -> None:
    """Run the spatial loops of a reduction on the cores; the reduction stays serial per row."""
    block_iters = sch.get(block).iter_vars
    loops = sch.get_loops(block)
    spatial = [lp for lp, iv in zip(loops, block_iters) if iv.iter_type != tirx.IterVar.CommReduce]
    if spatial:
        sch.parallel(sch.fuse(*spatial) if len(spatial) > 1 else spatial[0])


def _generic(sch: s_tir.Schedule, lanes: int) -> None:
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        if _is_reduction(sch, block):
            _reduction(sch, block)
        else:
            _spatial(sch, block, lanes)


def _linear(sch: s_tir.Schedule, lanes: int) -> None:
    """GEMV/GEMM: output columns across cores; the dot product accumulates `lanes` partial sums."""
    block = sch.get_sblock("matmul")
    i, j, k = sch.get_loops(block)
    if (_extent(sch, k) or 1) % lanes:
        _generic(sch, lanes)
        return
    _, ki = sch.split(k, [None, lanes])
    partial = sch.rfactor(ki, factor_axis=0)
    i_rf, j_rf, _, ki_rf = sch.get_loops(partial)
    sch.vectorize(ki_rf)
    rows = sch.fuse(i_rf, j_rf)
    sch.parallel(rows)
    sch.reverse_compute_at(block, rows)
    consumers = sch.get_consumers(block)
    if consumers:
        sch.reverse_compute_at(consumers[0], rows)


def _norm(sch: s_tir.Schedule, lanes: int) -> None:
    """RMSNorm (with or without a fused residual add): one row per task, vectorised over features."""
    block = sch.get_sblock("rms_norm")
    row, col = sch.get_loops(block)
    if (_extent(sch, col) or 1) % lanes == 0:
        sch.vectorize(sch.split(col, [None, lanes])[1])
    sch.parallel(row)
    for producer in ("rms_norm_sumsq", "residual_add"):
        try:
            sch.compute_at(sch.get_sblock(producer), row)
        except s_tir.ScheduleError:
            continue


SCHEDULES = {"linear": _linear, "rms_norm": _norm, "add_rms_norm": _norm}


def schedule(func: tirx.PrimFunc, kind: str, lanes: int) -> tirx.PrimFunc:
    """The kernel of an op of `kind`, scheduled for a CPU with `lanes` float32 SIMD lanes."""
    sch = s_tir.Schedule(func)
    SCHEDULES.get(kind, _generic)(sch, lanes)
    return sch.mod["main"]
