"""GPU schedules: elementwise work one element per thread; reductions over long rows split across threads
(partial sums through shared memory); prefill GEMMs tiled through shared memory. A packed (ir.packing) weight is
unpacked in registers by decode GEMVs and into the shared-memory weight tiles by prefill GEMMs, never in global memory.

Threads communicate only through shared memory and block barriers, never warp shuffles or
warp-synchronous code: TVM's NVPTX backend (the default direct-PTX path) cannot emit those, and
one schedule for all three CUDA paths keeps them identical.
"""

from __future__ import annotations

from math import gcd

from tvm import s_tir, tirx

from ir.packing import AWQ_PACK, scale_groups, two_level

from . import stages
from .gpu_attention import paged_attention
from .gpu_wmma import tensor_core_shape, wmma_gemm
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
# Packed decode GEMV: a thread block covers DECODE_WORDS packed words of a weight row (one 32-byte sector), a thread
# keeps up to DECODE_ROWS rows of its word's columns in registers, and up to WARP threads split each column's depth
# (the block's partial sums, at most WARP x DECODE_ROWS x 8 x DECODE_WORDS floats, take 32 KiB of shared memory).
DECODE_WORDS, DECODE_ROWS = 8, 4
NORM_THREADS = 128  # a norm's threads per row: as many partial sums, which one thread then adds


def _bind_spatial(sch: s_tir.Schedule, loops: list) -> None:
    """Fuse loops and spread them over blocks of THREADS threads."""
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    blocks, threads = sch.split(fused, [None, THREADS])
    sch.bind(blocks, "blockIdx.x")
    sch.bind(threads, "threadIdx.x")


def _thread_per_output(sch: s_tir.Schedule, block) -> None:
    """One thread per output element; its reduction, if any, runs inside the thread."""
    _bind_spatial(sch, split_loops(sch, block)[0])


def _split_reduction(sch: s_tir.Schedule, block, vector: int = 1, max_outputs: int | None = SPLIT_MAX_OUTPUTS) -> int:
    """Spread each output's reduction over up to a warp of threads of one thread block (several outputs per block).

    Thread t of an output sums terms t*v .. t*v+v-1 of every stride of lanes*v terms (neighbouring
    threads read neighbouring memory; with v > 1 each input's v terms come in one vector load), keeps
    its partial sum in a register and stores it to shared memory; after a block barrier one thread per
    output adds the partials. Returns the threads of a thread block, or 0 (leaving the block untouched) unless the
    block has one reduction loop worth splitting and at most `max_outputs` outputs (None: any number).
    """
    spatial, reduction = split_loops(sch, block)
    outputs = 1
    for loop in spatial:
        outputs *= static_extent(sch, loop) or SPLIT_MAX_OUTPUTS + 1
    if len(reduction) != 1 or (max_outputs is not None and outputs > max_outputs):
        return 0
    depth = static_extent(sch, reduction[0])
    if depth is None:  # a length known at run time (the valid context): a warp of lanes, the last step masked
        lanes, vector = WARP, 1
    elif depth < SPLIT_MIN_DEPTH:
        return 0
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
    return per_block * lanes


def _generic(sch: s_tir.Schedule) -> None:
    for block in stages.blocks(sch):
        if not _split_reduction(sch, block):
            _thread_per_output(sch, block)


def _linear(sch: s_tir.Schedule) -> None:
    """Decode GEMV: each dot product split over threads (a packed weight unpacked in registers); prefill: a
    shared-memory tiled GEMM."""
    block = stages.only_reduction(sch)
    dequant = stages.find(sch, stages.DEQUANT)  # a packed weight's unpacking stage
    i, j, k = sch.get_loops(block)
    rows, cols, depth = static_extent(sch, i), static_extent(sch, j), static_extent(sch, k)
    consumers = sch.get_consumers(block)  # the bias add, if any
    if rows % 16 == 0 and cols % TILE == 0 and depth % DEPTH_STEP == 0:  # 16: `_gemm`'s smallest row tile
        _gemm(sch, block, dequant)
    elif dequant is not None:
        _packed_gemv(sch, block, dequant)
    # Whatever the number of outputs: a thread per output would read its own weight row, 32 rows a warp load (a
    # 151,936-row vocabulary head ran so).
    elif not _split_reduction(sch, block, LOAD_BYTES // sch.get(block).reads[1].source.dtype.itemsize,
                              max_outputs=None):
        _thread_per_output(sch, block)
    # The bias add is a kernel of its own. In the split-reduction GEMV's kernel it would sit under the thread block
    # of outputs, where TVM sizes its loop from the predicated thread loop that sums the outputs (all THREADS of it,
    # clipped to the tensor): threads past the block's outputs would overwrite other blocks' outputs.
    for consumer in consumers:
        _bind_spatial(sch, sch.get_loops(consumer))


def _packed_gemv(sch: s_tir.Schedule, block, dequant) -> None:
    """Decode GEMV of a packed weight: a thread takes one packed word's AWQ_PACK columns for a few rows, unpacks the
    word in registers once per depth step and keeps its sums in registers. A thread block's words are neighbouring
    ones (a warp reads whole 32-byte sectors of qweight), and its WARP (or fewer) lanes split the depth into chunks
    that each lie in one group (a chunk's zero points and scales are read once); partial sums meet in shared memory."""
    i, j, k = sch.get_loops(block)
    rows, words, depth = static_extent(sch, i), static_extent(sch, j) // AWQ_PACK, static_extent(sch, k)
    zeros, scales = sch.mod["main"].params[2:4]
    group = depth // scale_groups(int(zeros.shape[0]), depth, two_level(zeros, scales))  # qzeros or offsets
    row_tile = next(r for r in range(DECODE_ROWS, 0, -1) if rows % r == 0)
    word_tile = next(w for w in (DECODE_WORDS, 4, 2, 1) if words % w == 0)
    lanes = next(n for n in (WARP, 16, 8, 4, 2, 1) if depth % n == 0)
    chunk = gcd(group, depth // lanes)  # depth index (step * lanes + lane) * chunk + offset
    sch.split(i, [None, row_tile])
    sch.split(j, [None, word_tile, AWQ_PACK])
    sch.split(k, [None, lanes, chunk])
    partial = sch.rfactor(sch.get_loops(block)[-2], factor_axis=0)  # partial[lane, i, j]
    i_block, i_row, j_block, j_word, j_column, step, lane, offset = sch.get_loops(partial)
    sch.reorder(i_block, j_block, lane, j_word, step, offset, i_row, j_column)
    sch.bind(i_block, "blockIdx.y")
    sch.bind(j_block, "blockIdx.x")
    sch.compute_at(dequant, offset, preserve_unit_loops=True)
    sch.set_scope(dequant, 0, "local")
    # the zero-point word (or offsets) and scales, where a chunk reads one of each (not two-level ones: a block's
    # float and a group's word, rows apart)
    chunk_constants = [sch.cache_read(dequant, index, "local") for index, part in ((1, zeros), (2, scales))
                       if not two_level(part, scales)]
    for stage in chunk_constants:
        sch.compute_at(stage, step, preserve_unit_loops=True)
    sch.bind(lane, "threadIdx.y")  # not fused with the word: buffer compaction still sees a chunk's one group
    sch.bind(j_word, "threadIdx.x")
    sch.set_scope(partial, 0, "shared")
    sch.reverse_compute_at(sch.cache_write(partial, 0, "local"), j_word)
    for stage in (dequant, *chunk_constants):
        for loop in sch.get_loops(stage)[-2:]:  # the loops compute_at made: over a word's columns, one group or row
            sch.unroll(loop)
    sch.unroll(i_row)
    sch.unroll(j_column)
    sch.decompose_reduction(partial, step)
    sch.reverse_compute_at(block, j_block)
    final_lane, *outputs = sch.get_loops(block)[2:]  # loops in block-iter order: the partials' lane first
    final = sch.fuse(*outputs)
    sch.reorder(final, final_lane)
    _, ty, tx = sch.split(final, [None, lanes, word_tile])
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")


def _gemm(sch: s_tir.Schedule, block, dequant=None) -> None:
    """Shared-memory tiled GEMM: per depth step, all threads of a block copy its rows of x and columns of w (in
    their own dtype, depth-major so neighbouring threads read nearby banks) to shared memory, then each
    thread accumulates a MICRO x MICRO patch of outputs in registers. A packed weight is unpacked (to f32) as its
    tile is copied, neighbouring threads taking neighbouring columns (the packed words' order)."""
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
    tiles = [sch.cache_read(block, index, "shared") for index in (0, 1)]
    if dequant is not None:
        sch.compute_inline(dequant)  # the w tile unpacks the packed weight as it copies it
    for tile in tiles:
        sch.compute_at(tile, k_step)
        sch.transform_layout(tile, ("write", 0), lambda r, d: (d, r))
        if tile is tiles[1] and dequant is not None:  # packed words lie along the columns: threads take columns
            sch.reorder(*reversed(sch.get_loops(tile)[-2:]))
        fused = sch.fuse(*sch.get_loops(tile)[-2:])
        _, ty, tx = sch.split(fused, [None, tile_rows // MICRO, TILE // MICRO])
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
    sch.unroll(k_inner)
    sch.unroll(i_micro)
    sch.unroll(j_micro)
    sch.decompose_reduction(block, k_step)


def _rope(sch: s_tir.Schedule) -> None:
    """Rotary embedding as one kernel: each thread computes the cos and sin of its element's angle itself (the CPU
    shares them across a row's heads; here a kernel per stage would cost more than the trigonometry)."""
    *tables, rotate = stages.blocks(sch)
    for table in tables:
        sch.compute_inline(table)
    _thread_per_output(sch, rotate)


def _norm(sch: s_tir.Schedule) -> None:
    """RMSNorm (and the residual sum before it) as one kernel: a thread block per row (per group of a grouped norm).
    Its threads write the group's residual sum, add their squares into partial sums in shared memory, each adds up
    the partials, and all of them scale the group. Every stage maps element e of the group to thread
    e % threads, so a thread reads back only the sums it wrote itself; the partials pass between threads through
    shared memory, behind a block barrier."""
    *adds, sumsq, norm = stages.blocks(sch)
    group = static_extent(sch, sch.get_loops(sumsq)[-1])
    threads = next(t for t in (NORM_THREADS, 64, 32, 16, 8, 4, 2, 1) if group % t == 0)
    step, lane = sch.split(sch.get_loops(sumsq)[-1], [None, threads])
    partial = sch.rfactor(lane, factor_axis=0)  # partial[lane, row, group]: lane t sums terms t, t + threads, ...
    if adds:  # the residual sum is an output: the other stages hang from its loops
        (add,) = adds
        i, h = sch.get_loops(add)
        row = sch.fuse(i, sch.split(h, [None, group])[0])
        _spread(sch, add, threads)
        sch.reverse_compute_at(partial, row)
        loops = sch.get_loops(partial)[1:]  # reverse_compute_at's loops, in block-var order (none of extent 1)
        lane, step = loops if len(loops) == 2 else (loops[0], sch.add_unit_loop(partial))
    else:
        i, g, step, lane = sch.get_loops(partial)
        row = sch.fuse(i, g)
    sch.bind(row, "blockIdx.x")
    sch.reorder(lane, step)
    sch.bind(lane, "threadIdx.x")
    sch.set_scope(partial, 0, "shared")
    sch.reverse_compute_at(sch.cache_write(partial, 0, "local"), lane)  # summed in a register, then stored
    sch.decompose_reduction(partial, step)
    sch.reverse_compute_at(sumsq, row)
    sch.reverse_compute_at(norm, row)
    step, thread = sch.split(sch.get_loops(norm)[-1], [None, threads])
    sch.reorder(thread, step)
    sch.bind(thread, "threadIdx.x")
    # Every thread adds the partials itself, in a register: one thread summing them for the others would need a
    # predicated stage, and TVM sizes the write-back of such a stage's register from the unpredicated loop (every
    # thread would store its unset sum).
    sch.compute_at(sumsq, thread)
    sch.set_scope(sumsq, 0, "local")


def _attention(sch: s_tir.Schedule) -> None:
    """Softmax attention of the legacy and image paths in five kernels, not seven: the scores; their maximum, and
    their sum of exponentials, each masking and exponentiating the scores as it reads them; the weighted values
    (recomputing the exponentials: on a GPU an exp costs less than a kernel of its own); the division by the sum
    (it reads the sums of another kernel, so it cannot join the weighted values' kernel as the bias joins a
    GEMV's)."""
    for name in (stages.MASKED, stages.EXP):
        sch.compute_inline(stages.find(sch, name))
    _generic(sch)


def _spread(sch: s_tir.Schedule, block, threads: int) -> None:
    """The block's innermost loop over `threads` threads: element e to thread e % threads."""
    sch.bind(sch.split(sch.get_loops(block)[-1], [None, threads])[1], "threadIdx.x")


def _on_tensor_cores(func: tirx.PrimFunc, target) -> bool:
    """Whether a `linear` kernel is a prefill product of a (plain) bfloat16 weight that a bfloat16-products build
    runs on tensor cores: one whose sizes fit the WMMA kernel's tiles (others, and decode GEMVs, stay float32)."""
    x, w = func.params[0], func.params[1]
    return (getattr(target, "bf16_products", None) == "wmma" and w.dtype == "bfloat16" and len(w.shape) == 2
            and tensor_core_shape(int(x.shape[0]), int(w.shape[0]), int(x.shape[1])))


SCHEDULES = {"linear": _linear, "rope": _rope, "rms_norm": _norm, "add_rms_norm": _norm,
             "padded_attention": _attention, "image_attention": _attention}


def schedule(func: tirx.PrimFunc, kind: str, attrs: dict, target) -> tirx.PrimFunc:
    """The kernel of an op of `kind`, scheduled for an NVIDIA GPU (the same signature as `schedules.cpu.schedule`;
    one schedule serves every arch and CUDA path). Paged attention is a written kernel (schedules.gpu_attention).
    The target matters only to a `--matmul-precision bfloat16` build: its prefill products of bfloat16 weights run
    on tensor cores (schedules.gpu_wmma)."""
    if kind == "linear" and _on_tensor_cores(func, target):
        return wmma_gemm(func)
    if kind == "paged_attention":
        return paged_attention(func, attrs)
    sch = s_tir.Schedule(func)
    SCHEDULES.get(kind, _generic)(sch)
    return sch.mod["main"]
