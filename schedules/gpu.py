"""GPU schedules: one output element (or a small tile) per thread, every reduction inside one thread.

No schedule here communicates between threads (no shared memory, no barriers, no warp shuffles):
TVM's NVPTX backend, the default direct-PTX path, cannot emit those with the LLVM it ships, and
one schedule for all three CUDA paths keeps them identical. Long dot products are split across
threads with `rfactor` (partial sums in a global buffer, then a second kernel adds them), so a
decode GEMV still spreads over the whole GPU.
"""

from __future__ import annotations

from tvm import s_tir, tirx

from .loops import static_extent

THREADS = 256
WARP = 32
# Decode GEMV: split each dot product over up to MAX_SPLIT threads until about TARGET_THREADS run.
TARGET_THREADS = 64 * 1024
MAX_SPLIT = 256


def _bind_spatial(sch: s_tir.Schedule, loops: list) -> None:
    """Fuse loops and spread them over blocks of THREADS threads."""
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    blocks, threads = sch.split(fused, [None, THREADS])
    sch.bind(blocks, "blockIdx.x")
    sch.bind(threads, "threadIdx.x")


def _thread_per_output(sch: s_tir.Schedule, block) -> None:
    """Bind the spatial loops of a block straight from a compute definition (loops in iter-var order)."""
    iters = sch.get(block).iter_vars
    loops = sch.get_loops(block)
    spatial = [lp for lp, iv in zip(loops, iters) if iv.iter_type != tirx.IterVar.CommReduce]
    _bind_spatial(sch, spatial)


def _generic(sch: s_tir.Schedule) -> None:
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        _thread_per_output(sch, block)


def _split_count(depth: int, outputs: int) -> int:
    """Threads sharing one dot product: a multiple of a warp dividing `depth`, grown until the GPU is full."""
    if depth % WARP:
        return 1
    split = WARP
    while split < MAX_SPLIT and depth % (2 * split) == 0 and outputs * split < TARGET_THREADS:
        split *= 2
    return split


def _linear(sch: s_tir.Schedule) -> None:
    """Decode GEMV: split-K over a warp of neighbouring elements (coalesced), partial sums then a sum.

    Prefill GEMM: one output per thread, neighbouring threads on neighbouring token rows, so a
    warp reads each weight element once and shares it.
    """
    block = sch.get_sblock("matmul")
    i, j, k = sch.get_loops(block)
    rows, cols, depth = static_extent(sch, i), static_extent(sch, j), static_extent(sch, k)
    split = _split_count(depth, cols) if rows == 1 else 1
    if split > 1:
        _, lane = sch.split(k, [None, split])  # k = step * split + lane: lanes read adjacent elements
        partial = sch.rfactor(lane, factor_axis=0)
        pi, pj, step, plane = sch.get_loops(partial)
        sch.reorder(pi, pj, plane, step)
        _bind_spatial(sch, [pi, pj, plane])
        fi, fj, _ = sch.get_loops(block)
        _bind_spatial(sch, [fi, fj])
    else:
        sch.reorder(j, i, k)
        _bind_spatial(sch, [j, i])
    for consumer in sch.get_consumers(block):
        _bind_spatial(sch, sch.get_loops(consumer))


SCHEDULES = {"linear": _linear}


def schedule(func: tirx.PrimFunc, kind: str) -> tirx.PrimFunc:
    """The kernel of an op of `kind`, scheduled for an NVIDIA GPU."""
    sch = s_tir.Schedule(func)
    SCHEDULES.get(kind, _generic)(sch)
    return sch.mod["main"]
