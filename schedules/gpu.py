"""GPU schedules: elementwise work one element per thread; reductions over long rows split across threads
(partial sums through shared memory); prefill GEMMs tiled through shared memory.

Threads communicate only through shared memory and block barriers, never warp shuffles or
warp-synchronous code: TVM's NVPTX backend (the default direct-PTX path) cannot emit those, and
one schedule for all three CUDA paths keeps them identical.
"""

from __future__ import annotations

from tvm import s_tir, tirx

from . import stages
from .loops import split_loops, static_extent

THREADS = 256
WARP = 32
# A reduction is split across threads when each output sums at least this many terms and there are
# few enough outputs that one thread per output would leave the GPU idle.
SPLIT_MIN_DEPTH = 64
SPLIT_MAX_OUTPUTS = 64 * 1024
LOAD_BYTES = 16  # one vector load per thread per step (ld.global.v4)
# Prefill GEMM: a thread block computes TILE x TILE outputs, each thread MICRO x MICRO of them in
# registers, stepping through the depth DEPTH_STEP at a time via shared memory.
TILE, MICRO, DEPTH_STEP = 64, 4, 16


def _bind_spatial(sch: s_tir.Schedule, loops: list) -> None:
    """Fuse loops and spread them over blocks of THREADS threads."""
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    blocks, threads = sch.split(fused, [None, THREADS])
    sch.bind(blocks, "blockIdx.x")
    sch.bind(threads, "threadIdx.x")


def _thread_per_output(sch: s_tir.Schedule, block) -> None:
    """One thread per output element; its reduction, if any, runs inside the thread."""
    _bind_spatial(sch, split_loops(sch, block)[0])


def _split_reduction(sch: s_tir.Schedule, block, vector: int = 1) -> bool:
    """Spread each output's reduction over up to a warp of threads of one thread block (several outputs per block).

    Thread t of an output sums terms t*v .. t*v+v-1 of every stride of lanes*v terms (neighbouring
    threads read neighbouring memory; with v > 1 each input's v terms come in one vector load), keeps
    its partial sum in a register and stores it to shared memory; after a block barrier one thread per
    output adds the partials. Returns False (leaving the block untouched) unless the block has one
    reduction loop worth splitting and few enough outputs.
    """
    spatial, reduction = split_loops(sch, block)
    outputs = 1
    for loop in spatial:
        outputs *= static_extent(sch, loop) or SPLIT_MAX_OUTPUTS + 1
    if len(reduction) != 1 or outputs > SPLIT_MAX_OUTPUTS:
        return False
    depth = static_extent(sch, reduction[0])
    if depth is None:  # a length known at run time (the valid context): a warp of lanes, the last step masked
        lanes, vector = WARP, 1
    elif depth < SPLIT_MIN_DEPTH:
        return False
    else:
        lanes, vector = max(((n, v) for n in (WARP, 16, 8, 4, 2, 1) for v in (vector, vector // 2, vector // 4, 1)
                             if v >= 1 and depth % (n * v) == 0), key=lambda nv: (nv[0] * nv[1], nv[0]))
    per_block = next(n for n in (THREADS // lanes, 4, 2, 1) if outputs % n == 0)
    if len(spatial) > 1:
        sch.fuse(*spatial)
    sch.split(reduction[0], [None, lanes, vector])
    partial = sch.rfactor(sch.get_loops(block)[-2], factor_axis=0)  # partial[lane, outputs...]
    out, step, lane, element = sch.get_loops(partial)
    block_of_outputs, out_in_block = sch.split(out, [None, per_block])
    sch.reorder(block_of_outputs, out_in_block, lane, step, element)
    sch.bind(block_of_outputs, "blockIdx.x")
    sch.bind(sch.fuse(out_in_block, lane), "threadIdx.x")
    if vector > 1:
        for index in range(len(sch.get(partial).reads)):
            loads = sch.cache_read(partial, index, "local")
            sch.compute_at(loads, step)
            sch.vectorize(sch.get_loops(loads)[-1])
    sch.set_scope(partial, 0, "shared")
    sch.reverse_compute_at(sch.cache_write(partial, 0, "local"), sch.get_loops(partial)[1])
    sch.decompose_reduction(partial, step)
    sch.reverse_compute_at(block, block_of_outputs)
    final_lane, *final_outputs = sch.get_loops(block)[1:]  # loops in block-iter order: the partials' lane first
    final_outputs = final_outputs or [sch.add_unit_loop(block)]  # one output per block: a loop to bind anyway
    final = sch.fuse(*final_outputs) if len(final_outputs) > 1 else final_outputs[0]
    sch.reorder(final, final_lane)
    sch.bind(sch.split(final, [None, per_block * lanes])[1], "threadIdx.x")
    return True


def _generic(sch: s_tir.Schedule) -> None:
    for block in stages.blocks(sch):
        if not _split_reduction(sch, block):
            _thread_per_output(sch, block)


def _linear(sch: s_tir.Schedule) -> None:
    """Decode GEMV: each dot product split over a warp of vector loads; prefill: a shared-memory tiled GEMM."""
    block = stages.only_reduction(sch)
    i, j, k = sch.get_loops(block)
    rows, cols, depth = static_extent(sch, i), static_extent(sch, j), static_extent(sch, k)
    vector = LOAD_BYTES // (2 if sch.get(block).reads[1].source.dtype in ("bfloat16", "float16") else 4)
    consumers = sch.get_consumers(block)  # the bias add, if any
    if rows >= 16 and rows % MICRO == 0 and cols % TILE == 0 and depth % DEPTH_STEP == 0:
        _gemm(sch, block)
    elif not _split_reduction(sch, block, vector):
        _thread_per_output(sch, block)
    for consumer in consumers:
        _bind_spatial(sch, sch.get_loops(consumer))


def _gemm(sch: s_tir.Schedule, block) -> None:
    """Shared-memory tiled GEMM: per depth step, all threads of a block copy its rows of x and columns of w (in
    their own dtype, depth-major so neighbouring threads read nearby banks) to shared memory, then each
    thread accumulates a MICRO x MICRO patch of outputs in registers."""
    i, j, k = sch.get_loops(block)
    rows = static_extent(sch, i)
    tile_rows = next(t for t in (TILE, 32, 16) if rows % t == 0)
    i_block, i_thread, i_micro = sch.split(i, [None, tile_rows // MICRO, MICRO])
    j_block, j_thread, j_micro = sch.split(j, [None, TILE // MICRO, MICRO])
    k_step, k_inner = sch.split(k, [None, DEPTH_STEP])
    sch.reorder(i_block, j_block, i_thread, j_thread, k_step, k_inner, i_micro, j_micro)
    sch.bind(i_block, "blockIdx.y")
    sch.bind(j_block, "blockIdx.x")
    sch.bind(i_thread, "threadIdx.y")
    sch.bind(j_thread, "threadIdx.x")
    register = sch.cache_write(block, 0, "local")
    sch.reverse_compute_at(register, j_thread)
    for index in (0, 1):
        tile = sch.cache_read(block, index, "shared")
        sch.compute_at(tile, k_step)
        sch.transform_layout(tile, ("write", 0), lambda r, d: (d, r))
        fused = sch.fuse(*sch.get_loops(tile)[-2:])
        _, ty, tx = sch.split(fused, [None, tile_rows // MICRO, TILE // MICRO])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
    sch.unroll(k_inner)
    sch.unroll(i_micro)
    sch.unroll(j_micro)
    sch.decompose_reduction(block, k_step)


SCHEDULES = {"linear": _linear}


def schedule(func: tirx.PrimFunc, kind: str, attrs: dict, target) -> tirx.PrimFunc:
    """The kernel of an op of `kind`, scheduled for an NVIDIA GPU (the same signature as `schedules.cpu.schedule`;
    one schedule serves every arch and CUDA path, so `attrs` and `target` are not consulted)."""
    sch = s_tir.Schedule(func)
    SCHEDULES.get(kind, _generic)(sch)
    return sch.mod["main"]
