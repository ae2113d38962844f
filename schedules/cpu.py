"""CPU schedules: rows across cores, inner loops as SIMD vectors, reductions split into vector lanes.

The compute definitions in `compiler.kernels` fix meaning. A schedule changes their loop structure; for some
ops and shapes a hand-written kernel of the same computation replaces the definition instead (`_written`:
the few-row products, the bfloat16 GEMMs on AMX tiles or AVX512-BF16 dot products, paged attention), tested
against the same numpy references.
"""

from __future__ import annotations

import math

import tvm.sym
from tvm import s_tir, tirx
from tvm.script import tirx as T

from . import stages
from .amx import amx_awq_gemm, amx_gemm
from .avx512_bf16 import DOT, DPBF16PS_IR, dpbf16_awq_gemm, dpbf16_gemm
from .cpu_attention import paged_attention
from .cpu_awq import awq_linear
from .cpu_conv import causal_conv
from .cpu_delta import delta_rule
from .loops import split_loops, static_extent
from .vector_math import vector_math
from .written import CACHE_LINE, bf16_bits, linear_func, packed_weight, paired_weight, prefetch


SERIAL_WORK = 1 << 14  # elements (times the loop each one runs) that a kernel leaves to one core


def _parallel(sch: s_tir.Schedule, loop, work: int | None) -> None:
    """Run `loop` across the cores, unless the kernel's whole work is known and at most SERIAL_WORK: waking the
    thread pool and joining it costs more than that much work saves, and on a host with other load a parallel
    kernel can wait a scheduler tick for a descheduled worker (a decode step runs a few hundred such small ops)."""
    if work is None or work > SERIAL_WORK:
        sch.parallel(loop)


def _work(sch: s_tir.Schedule, loops) -> int | None:
    """The product of the loops' static extents, or None when one is symbolic."""
    extents = [static_extent(sch, loop) for loop in loops]
    return None if None in extents else math.prod(extents)


def _spatial(sch: s_tir.Schedule, block, lanes: int) -> None:
    """Fuse all loops, run chunks of them on the cores, vectorise the innermost `lanes` (unless each
    iteration runs a loop of its own: the sequential scans of the recurrent ops)."""
    fused = sch.fuse(*sch.get_loops(block))
    ext = static_extent(sch, fused)
    simple = isinstance(sch.get(block).body, tirx.BufferStore)
    if simple and ext is not None and ext % lanes == 0 and ext > lanes:
        outer, inner = sch.split(fused, [None, lanes])
        _parallel(sch, outer, ext)
        sch.vectorize(inner)
    else:
        _parallel(sch, fused, ext if simple else None)


def _reduction(sch: s_tir.Schedule, block) -> None:
    """Run the spatial loops of a reduction on the cores; the reduction stays serial per row."""
    spatial, _ = split_loops(sch, block)
    if spatial:
        work = _work(sch, sch.get_loops(block))
        _parallel(sch, sch.fuse(*spatial) if len(spatial) > 1 else spatial[0], work)


def _generic(sch: s_tir.Schedule, lanes: int, done: tuple[str, ...] = ()) -> None:
    """Every block not named in `done` (or made from one by decompose_reduction): reductions parallel over their
    outputs, the rest fused, parallel and vectorised."""
    for block in stages.blocks(sch):
        if sch.get(block).name_hint.removesuffix("_init").removesuffix("_update") in done:
            continue
        if stages.is_reduction(sch, block):
            _reduction(sch, block)
        else:
            _spatial(sch, block, lanes)


def _delta_rule(sch: s_tir.Schedule, lanes: int) -> None:
    """The chunked gated delta rule's in-chunk dot products vectorised over the chunk's positions (the depth
    loop outside them); every other stage as `_generic` does it."""
    block = stages.find(sch, stages.DELTA_DOTS)
    if block is not None:
        which, heads, chunk, row, pos, depth = sch.get_loops(block)
        sch.reorder(which, heads, chunk, row, depth, pos)
        sch.parallel(sch.fuse(which, heads, chunk))
        if static_extent(sch, pos) % lanes == 0:
            sch.vectorize(sch.split(pos, [None, lanes])[1])
        sch.decompose_reduction(block, depth)
    _generic(sch, lanes, done=(stages.DELTA_DOTS,))


def _delta_inputs(sch: s_tir.Schedule, lanes: int) -> None:
    """The gated delta rule's inputs: per token row (across the cores), each q/k head's sum of squares as SIMD
    partial sums added up once (the reduction was a scalar chain per head), then the row normalised in vectors; the
    gates as `_spatial` does them. Qwen3.5-0.8B shape, 128 rows (Intel Xeon Ice Lake, alternating): 1.14 -> 0.55 ms."""
    sums = stages.only_reduction(sch)
    _, normed, gates = stages.blocks(sch)
    depth = sch.get_loops(sums)[-1]
    row, col = sch.get_loops(normed)
    if static_extent(sch, depth) % lanes or static_extent(sch, depth) < 2 * lanes or static_extent(sch, col) % lanes:
        _generic(sch, lanes)  # no whole vectors, or one: nothing to split
        return
    _parallel(sch, row, _work(sch, (row, col)))
    partial = sch.rfactor(sch.split(depth, [None, lanes])[1], factor_axis=2)
    sch.vectorize(sch.split(col, [None, lanes])[1])
    sch.compute_at(sums, row)
    sch.compute_at(partial, row)
    lane, head, step = sch.get_loops(partial)[1:]
    sch.reorder(head, step, lane)
    sch.vectorize(lane)
    sch.decompose_reduction(partial, step)
    _spatial(sch, gates, lanes)


def _linear(sch: s_tir.Schedule, lanes: int) -> None:
    """Matrix products: a GEMM schedule when the rows fill whole SIMD vectors (prefill), else a GEMV one."""
    block = stages.only_reduction(sch)
    rows = static_extent(sch, sch.get_loops(block)[0])
    unpack = stages.find(sch, stages.DEQUANT)  # a packed weight: unpacked a tile at a time by the GEMM, else inlined
    if rows % lanes == 0:
        _gemm(sch, block, lanes)
    elif unpack is not None:
        sch.compute_inline(unpack)
        _generic(sch, lanes)
    else:
        _gemv(sch, block, lanes)


GEMV_MAX_ROWS = 16  # activation rows a weight-streaming product takes (decode steps of up to this many sequences)
BF16_MIN_ROWS = 16  # a bf16 build's products from this many rows (one AMX tile of them) run on its bf16 GEMM
GEMV_X_BLOCK_BYTES = 16 * 1024  # x rows that outgrow L1 with a weight row are read in depth blocks of this many bytes
# of x (half of a 32 KiB L1: the weights stream through it too)
GEMV_TASK_ROWS = 16  # several x rows: weight rows per task, passed over depth block by depth block
STREAM_BYTES = 4096  # bytes of consecutive weights each stream of a one-pass product reads at least, if it can


def depth_block(m: int, n: int, k: int, step: int, x_bytes: int, w_bytes: int, l1_bytes: int) -> int:
    """The depth `_rows_gemv` passes over its weight rows at a time, for m x rows of depth k (`x_bytes` an element)
    and n weight rows (`w_bytes` an element): k, one pass, while the x rows and the weight row they meet fit in L1
    (`l1_bytes`) together; else the largest multiple of `step` dividing k whose slice of x fills at most
    GEMV_X_BLOCK_BYTES, unless that is under a quarter of it (a depth of few divisors: the partial sums would go to
    memory every few steps, so one pass instead)."""
    if (m * x_bytes + w_bytes) * k <= l1_bytes or n % GEMV_TASK_ROWS:
        return k
    widest = GEMV_X_BLOCK_BYTES // (x_bytes * m) // step * step
    block = next(b for b in range(widest, 0, -step) if k % b == 0)
    return block if 4 * block >= widest else k


def gemv_tile(m: int, n: int, halves: int, budget: int, blocked: bool) -> tuple[int, int]:
    """(x rows per group, weight rows per tile) of `_rows_gemv` for m x rows and n weight rows, `halves`
    accumulators per product and at most `budget` accumulators: one weight row a tile (one stream of weights) in
    one pass over the depth, else (`blocked`) the tile with the fewest loads per product."""
    return min(((g, c) for g in range(1, m + 1) for c in ((4, 2, 1) if blocked else (1,))
                if m % g == 0 and n % c == 0 and g * c * halves <= budget),
               key=lambda gc: ((gc[0] + gc[1]) / (gc[0] * gc[1]), -gc[0]))


def _rows_gemv(func: tirx.PrimFunc, target, prefetching: bool | None = None,
               dot_ir: str | None = None) -> tirx.PrimFunc | None:
    """The product x @ w.T (+ bias) of a few rows x (decode steps: one row per sequence) as a weight-streaming loop
    that reads each weight once for all rows, or None when the shape does not fit it.

    Tasks of weight rows run across the cores; each step reads `lanes` (one row: 2 x `lanes`) elements of a tile of
    weight rows, widened in registers, and adds their products with the same elements of a group of x rows into
    accumulators (group rows x weight rows x halves, at most `target.gemv_accumulators`), and prefetches (into L2)
    the same elements of the next tile's rows, which follow in memory (the hardware prefetcher alone leaves a core
    well short of its share of memory bandwidth on 16-bit weights). While the x rows and a weight row fit in L1, a
    tile is one weight row, so a core reads its weights as one stream, row after row: tiles of 4 rows, four streams
    at once with fewer loads per product, streamed [4864, 896] bf16 from memory at 28 GB/s with one x row and 13
    with eight, against 32.5 and 17 for one stream (two threads, the Xeon of docs/performance.md). Rows shorter than
    STREAM_BYTES go in runs of consecutive rows per task, so each prefetch reaches that far ahead. The groups take
    turns over a tile's weights, which stay in L1, so up to GEMV_MAX_ROWS rows fit whatever the register count. When
    the x rows and a weight row outgrow L1 together (`depth_block`, at the target's `l1_bytes`), a task holds
    GEMV_TASK_ROWS weight rows and passes over them one depth block at a time, so the block's slice of x stays in L1
    for all of them (the partial sums wait in memory between blocks); its tile is then the shape with the fewest
    loads per product (4 weight rows where the registers allow: 25 GB/s against 22 for one row, four x rows of
    [2048, 5632]). On AMD Zen 4 against one pass, bf16 weights: one float32 x row of [2048, 8192] 1.05 of numpy's
    rate against 0.87, [1536, 8960] 1.50 against 1.05; two of [2048, 4096] 0.94 against 0.75; float16 [2048, 11008]
    0.76 against 0.54; in dot products one row of [3584, 18944] 0.88 against 0.73, four of [2048, 3584] 0.93 against
    0.73. On an Intel core (`target.one_pass_row`) one x row reads its weights in one pass at any depth, x from L2:
    the Xeon with AMX streamed [1536, 8960], [3584, 18944] and [4096, 14336] 1.05-1.07x faster so. One row of float32
    weights is left to `_gemv`.

    With `dot_ir` (bfloat16 weights, a bf16 build on AVX512-BF16: `schedules.avx512_bf16`; which products take it:
    `rows_on_dot_products`), the x rows are rounded to bfloat16 once and a step's products are dot products of
    depth pairs: each instruction multiplies 32 weights of a row with 32 of an x row and adds them into 16 float32
    lanes, where the widening form spends a load, a conversion and an FMA on every 16 weights (one row of
    TinyLlama's [2048, 5632] from memory: 43.6 GB/s against 24.9 on AMD Zen 4; batch decode, where the widening form
    runs out of FMAs before memory runs out of bytes, more).

    On a CPU whose hardware prefetchers suffice (`target.hardware_prefetch`, AMD Zen 4), one x row streams without
    software prefetches where they slow it: the widening form where x and a weight row fit in half of L1 (896 x 896
    from memory: 31.6 GB/s against 28.5 with them; 4864-deep rows 20.0 against 30.4 without), the dot-product form,
    which reads 128 bytes a step, for rows longer than STREAM_BYTES, a page, which a prefetcher that stops at page
    ends enters cold row after row (2048 x 5632: 54.9 GB/s against 40.8 with them; 2048-deep rows of one page 36.3
    against 31.9 without, 896-deep ones 56.1 against 29.3); `prefetching` overrides that choice
    (benchmarks.decode_products). One x row of float16 weights takes four accumulators there: without prefetches
    LLVM unrolls the depth loop whole, and at depth 896 it scheduled that code with the weights read out of order and
    widened values spilled to the stack (0.48-0.81 of numpy's rate from memory, against 1.00-1.12 with four;
    512 to 1152 deep otherwise within 4% either way).
    On AMD Zen 5 and Intel (`target.eager_prefetch`) one x row of bfloat16 weights in the widening form prefetches
    eagerly: addresses not bounded to w, which LLVM then issues as plain instructions at the head of each unrolled
    group of steps (bounded, each took four integer instructions between the FMAs), and streams of half of
    STREAM_BYTES (1536-deep rows: the next row, not the one after). From memory, beside the bounded form, Zen 5: rows
    of 896 1.24-1.28x, [8960, 1536] 1.15-1.21x, the dot products' rate, deeper rows level, float16 weights, the
    dot-product form and several x rows slower so (0.81-0.93); the Xeon with AMX: 896 to 8960 deep 1.04-1.07x.
    Schedule primitives cannot insert prefetches, so this loop nest is written out; it computes the sums of
    `compiler.kernels.linear` in another order.
    """
    x_buf, w_buf = func.params[:2]
    m, lanes = int(x_buf.shape[0]), target.lanes
    n, k = (int(d) for d in w_buf.shape)
    dot = dot_ir is not None
    pair = 2 if dot else 1  # depth elements per lane of a step's product
    halves = 2 if m == 1 else 1  # one row: two accumulators per weight row, to hide the FMA latency
    if m == 1 and not dot and w_buf.dtype == "float16" and target.hardware_prefetch and k % (4 * lanes) == 0:
        halves = 4  # see the docstring: float16 rows on Zen 4
    step = halves * lanes * pair
    budget = target.gemv_accumulators
    if m > GEMV_MAX_ROWS or k % step or (m == 1 and w_buf.dtype not in ("bfloat16", "float16")) or \
            (dot and (w_buf.dtype != "bfloat16" or lanes != 16)):
        return None
    x_bytes = 4 // pair  # x as the products read it: float32, or rounded to bfloat16
    w_bytes = tvm.DataType(w_buf.dtype).bits // 8
    block = k if m == 1 and target.one_pass_row else depth_block(m, n, k, step, x_bytes, w_bytes, target.l1_bytes)
    blocked = block < k
    group, cols = gemv_tile(m, n, halves, budget, blocked)
    tiles = GEMV_TASK_ROWS // cols if blocked else 1  # weight-row tiles per task
    row_bytes = k * w_bytes
    if prefetching is None:
        hardware_suffices = _beyond_a_page(k) if dot else 4 * k + row_bytes <= GEMV_X_BLOCK_BYTES
        prefetching = not (target.hardware_prefetch and m == 1 and hardware_suffices and not blocked)
    eager = m == 1 and not dot and w_buf.dtype == "bfloat16" and target.eager_prefetch
    stream_bytes = STREAM_BYTES // 2 if eager else STREAM_BYTES
    run = 1 if blocked else max(p for p in range(1, -(-stream_bytes // row_bytes) + 1) if n % (cols * p) == 0)
    rows_per_task = tiles * cols * run
    line = max(1, CACHE_LINE // (step * w_bytes))  # steps per cache line of a row
    per_line = line if block % (step * line) == 0 else 1
    lines = max(1, step * w_bytes // CACHE_LINE)  # cache lines of a row per step
    tasks = T.parallel if m * n * k > SERIAL_WORK else T.serial  # as `_parallel` decides

    # Index arithmetic is written inline: a scalar bound by assignment in a macro becomes a one-element buffer on
    # the heap (TVM 0.27), which the loop then stores and reloads every step.
    def row(task, t, c, j):
        """Weight row c of tile t of a task, at step j of its run (a tile of several rows comes only with blocked
        tasks, whose run is 1; a one-row tile's run is `run` consecutive rows)."""
        return (task * tiles + t) * cols * run + c * run + j

    def at(kb, s, u):
        """The first depth element of step u of cache line s of depth block kb."""
        return kb * block + (s * per_line + u) * step

    def ahead(task, t, c, j, kb, s, p):
        """The element that prefetch p of cache line s reads: in the row one run of tiles ahead, bounded to w unless
        eager."""
        element = (row(task, t, c, j) + cols * run) * k + at(kb, s, 0) + p * CACHE_LINE // w_bytes
        return element if eager else T.min(element, n * k - 1)

    @T.macro
    def widened_products(acc, wide, xs, ws, task, t, j, g, kb, s, u):
        """A step's products as FMAs of x with the weights widened to float32."""
        for c in T.unroll(cols):
            for h in T.unroll(halves):
                for lane in T.vectorized(lanes):
                    wide[c, h, lane] = T.Cast("float32", ws[row(task, t, c, j), at(kb, s, u) + h * lanes + lane])
        for r in T.unroll(group):
            for c in T.unroll(cols):
                for h in T.unroll(halves):
                    for lane in T.vectorized(lanes):
                        acc[r, c, h, lane] = acc[r, c, h, lane] + \
                            xs[g * group + r, at(kb, s, u) + h * lanes + lane] * wide[c, h, lane]

    @T.macro
    def dot_products(acc, wide, xs, ws, task, t, j, g, kb, s, u):
        """A step's products as dot products of depth pairs (xs, ws: views of 32-bit words, a pair each)."""
        for r in T.unroll(group):
            for c in T.unroll(cols):
                for h in T.unroll(halves):
                    acc[r, c, h, T.ramp(0, 1, lanes)] = T.call_extern(
                        "float32x16", DOT, acc[r, c, h, T.ramp(0, 1, lanes)],
                        xs[g * group + r, T.ramp(at(kb, s, u) // 2 + h * lanes, 1, lanes)],
                        ws[row(task, t, c, j), T.ramp(at(kb, s, u) // 2 + h * lanes, 1, lanes)])

    step_products = dot_products if dot else widened_products

    @T.macro
    def streamed(xs, ws, ys, first, flat):
        """The loop nest over x (xs) and w (ws) as the step's products read them; `flat` w as one vector."""
        for task in tasks(n // rows_per_task):
            sums = T.alloc_buffer((tiles, run, m, cols, halves, lanes), "float32")  # partials between depth blocks
            acc = T.alloc_buffer((group, cols, halves, lanes), "float32")  # on the stack (see cpu_attention): registers
            wide = T.alloc_buffer((cols, halves, lanes), "float32")
            for t, j, r, c, h, lane in T.grid(tiles, run, m, cols, halves, lanes):
                sums[t, j, r, c, h, lane] = T.float32(0)
            for kb, t, j, g in T.grid(k // block, tiles, run, m // group):
                for r in T.unroll(group):
                    for c in T.unroll(cols):
                        for h in T.unroll(halves):
                            for lane in T.vectorized(lanes):
                                acc[r, c, h, lane] = sums[t, j, g * group + r, c, h, lane]
                for s in range(block // (step * per_line)):
                    if prefetching and g == 0:  # one prefetch per cache line of each of the next run of tiles' rows
                        for c in T.unroll(cols):
                            for p in T.unroll(lines):
                                T.evaluate(prefetch(flat[ahead(task, t, c, j, kb, s, p)]))
                    for u in T.unroll(per_line):
                        step_products(acc, wide, xs, ws, task, t, j, g, kb, s, u)
                for r in T.unroll(group):
                    for c in T.unroll(cols):
                        for h in T.unroll(halves):
                            for lane in T.vectorized(lanes):
                                sums[t, j, g * group + r, c, h, lane] = acc[r, c, h, lane]
            for t, j, r, c in T.grid(tiles, run, m, cols):
                ys[r, row(task, t, c, j)] = first(row(task, t, c, j))
                for h, lane in T.grid(halves, lanes):
                    ys[r, row(task, t, c, j)] = ys[r, row(task, t, c, j)] + sums[t, j, r, c, h, lane]

    @T.macro
    def widened(xs, ws, ys, first):
        flat = T.decl_buffer((n * k,), w_buf.dtype, data=ws.data)
        streamed(xs, ws, ys, first, flat)

    @T.macro
    def dots(xs, ws, ys, first):
        xp = T.alloc_buffer((m, k), "uint16")  # x rounded to bfloat16, once
        for r, d in T.grid(m, k // lanes):
            for lane in T.vectorized(lanes):
                xp[r, d * lanes + lane] = bf16_bits(xs[r, d * lanes + lane])
        x_pairs = T.decl_buffer((m, k // 2), "int32", data=xp.data)  # a depth pair: one 32-bit word
        w_pairs = T.decl_buffer((n, k // 2), "int32", data=ws.data)
        flat = T.decl_buffer((n * k,), w_buf.dtype, data=ws.data)
        with T.attr(0, "pragma_import_llvm", dot_ir):
            streamed(x_pairs, w_pairs, ys, first, flat)

    return linear_func(func, dots if dot else widened)


def rows_on_dot_products(func: tirx.PrimFunc, target) -> bool:
    """Whether a bf16 build on AVX512-BF16 runs this few-row product (`_rows_gemv`) on dot products: always, but for
    one x row of short weight rows. On a CPU whose hardware prefetchers suffice (AMD Zen 4) rows up to STREAM_BYTES
    long take the widening form, which streams them from memory without software prefetches as fast as the dot
    products do with them, or faster (`benchmarks.decode_products`, two builds side by side: 1024-deep rows, all of
    Qwen3.5's projections but two, 0.71-0.85x for the dot products, Qwen3.5's vocabulary head 0.77-0.81x; 896-deep
    0.86-1.09x, 2048-deep 0.90-1.00x), while longer rows, which both forms stream without them, go 1.04-1.12x faster
    on dot products (3584 to 5632 deep). On AMD Zen 5 (`target.short_rows_widened`), whose widening form prefetches
    eagerly, rows shorter than STREAM_BYTES take it: Qwen3.5-0.8B's bf16 build decoded 1.21x faster so (its 1024-deep
    rows), Qwen2.5-0.5B's level (896); rows of a page were level in both forms, and stay on dot products."""
    m, k = (int(d) for d in func.params[0].shape)
    if m != 1 or not (target.hardware_prefetch or target.short_rows_widened):
        return True
    return _beyond_a_page(k) if target.hardware_prefetch else 2 * k >= STREAM_BYTES


def _beyond_a_page(k: int) -> bool:
    """Whether a row of k bfloat16 weights is longer than STREAM_BYTES: where the hardware prefetchers stream the
    dot-product form of `_rows_gemv` without software prefetches, and where `rows_on_dot_products` keeps it."""
    return 2 * k > STREAM_BYTES


def _gemv(sch: s_tir.Schedule, block, lanes: int) -> None:
    """Tiles of output rows x columns across cores; each dot product accumulates `lanes` partial sums in
    registers, so one loaded activation vector serves every column of the tile and one loaded weight
    vector every row."""
    i, j, k = sch.get_loops(block)
    rows, cols, depth = static_extent(sch, i), static_extent(sch, j), static_extent(sch, k)
    if depth % lanes:
        _generic(sch, lanes)
        return
    tile_rows = next(t for t in (2, 1) if rows % t == 0)
    tile_cols = next(t for t in (4, 1) if cols % t == 0)
    sch.split(i, [None, tile_rows])
    sch.split(j, [None, tile_cols])
    _, k_lane = sch.split(k, [None, lanes])
    partial = sch.rfactor(k_lane, factor_axis=0)
    p_io, p_ii, p_jo, p_ji, p_ko, p_ki = sch.get_loops(partial)
    sch.reorder(p_io, p_jo, p_ko, p_ii, p_ji, p_ki)
    sch.unroll(p_ii)
    sch.unroll(p_ji)
    sch.vectorize(p_ki)
    tiles = sch.fuse(p_io, p_jo)
    _parallel(sch, tiles, rows * cols * depth)
    sch.reverse_compute_at(block, tiles)
    for consumer in sch.get_consumers(block):
        sch.reverse_compute_at(consumer, tiles)
    sch.decompose_reduction(partial, p_ko)


GEMM_MAX_DEPTH_BLOCK = 1024  # reduction steps per pass over the activations, so a pass stays in L2
GEMM_MIN_TASKS = 8  # column blocks per product at least, to spread over the cores


def _gemm(sch: s_tir.Schedule, block, lanes: int) -> None:
    """Register-blocked GEMM: a task is a block of output columns that every token row passes over.

    Each step multiplies vectors of consecutive rows (of a transposed copy of x) by one broadcast weight
    per column, so no horizontal sums; the task's weights, widened once per depth block, stay in cache
    for all rows, and the [columns, rows] accumulators stay in registers across a depth block.
    """
    i, j, k = sch.get_loops(block)
    rows, cols, depth = (static_extent(sch, loop) for loop in (i, j, k))
    accumulators = 16 if lanes >= 16 else 8  # half the SIMD registers: AVX-512 has 32, AVX2 16
    row_vecs = 2 if rows % (2 * lanes) == 0 else 1
    tile_rows = row_vecs * lanes
    tile_cols = next(t for t in (16, 8, 4, 2, 1) if t * row_vecs <= accumulators and cols % t == 0)
    task_cols = next((t for t in (64, 32, 16) if cols % t == 0 and t % tile_cols == 0
                      and cols // t >= GEMM_MIN_TASKS), tile_cols)
    depth_block = depth
    while depth_block > GEMM_MAX_DEPTH_BLOCK and depth_block % 2 == 0:
        depth_block //= 2
    i_tile, i_vec, i_lane = sch.split(i, [None, row_vecs, lanes])
    j_task, j_tile, j_col = sch.split(j, [None, task_cols // tile_cols, tile_cols])
    k_block, k_step = sch.split(k, [None, depth_block])
    sch.reorder(j_task, k_block, j_tile, i_tile, k_step, i_vec, j_col, i_lane)
    sch.parallel(j_task)
    sch.unroll(i_vec)
    sch.unroll(j_col)
    sch.vectorize(i_lane)
    out = sch.cache_write(block, 0, "local")
    sch.transform_layout(block, ("write", 0), lambda r, c: (c, r))
    sch.reverse_compute_at(out, j_task)
    for consumer in sch.get_consumers(out):
        if sch.get(consumer).name_hint == stages.PAIR_COLUMNS:  # a whole pass of its own, after the product
            for later in sch.get_consumers(consumer):
                sch.reverse_compute_inline(later)
            _spatial(sch, consumer, lanes)
        else:
            sch.reverse_compute_at(consumer, j_task)
    _transposed_activations(sch, block, tile_rows, lanes)
    unpack = stages.find(sch, stages.DEQUANT)
    if unpack is not None:
        _unpacked_weights(sch, unpack, k_block, lanes)
    elif sch.get(block).reads[1].source.dtype == "bfloat16":
        _widened_weights(sch, block, k_block, lanes)
    sch.decompose_reduction(block, k_block)


def _transposed_activations(sch: s_tir.Schedule, block, tile_rows: int, lanes: int) -> None:
    """Copy x to [rows / tile_rows, depth, tile_rows], lanes x lanes at a time: one stream per row tile."""
    copy = sch.cache_read(block, 0, "global")
    sch.transform_layout(block, ("read", 0), lambda r, d: (r // tile_rows, d, r % tile_rows))
    r, d = sch.get_loops(copy)
    r_outer, r_inner = sch.split(r, [None, lanes])
    d_outer, d_inner = sch.split(d, [None, lanes])
    sch.reorder(d_outer, r_outer, r_inner, d_inner)
    sch.parallel(d_outer)
    sch.unroll(r_inner)
    sch.vectorize(d_inner)


def _widened_weights(sch: s_tir.Schedule, block, k_block, lanes: int) -> None:
    """Widen a task's bfloat16 weights to float32 once per depth block, for every row to reuse."""
    # The product then reads float32(bfloat16(w)) of a float32 w that bfloat16 holds exactly; TVM's bfloat16
    # legalisation drops that round trip, leaving a plain float32 load. (float16 has no such pass: not widened.)
    copy = sch.cache_read(block, 1, "global")
    sch.compute_at(copy, k_block)
    sch.unsafe_set_dtype(copy, 0, "float32")
    sch.vectorize(sch.split(sch.get_loops(copy)[-1], [None, lanes])[1])


def _unpacked_weights(sch: s_tir.Schedule, unpack, k_block, lanes: int) -> None:
    """Unpack a task's packed weights (ir.packing) to float32 once per depth block, for every row to reuse, a vector
    of neighbouring columns at a time (of the pairs layout: in its order, so their words are neighbours too, one
    vector load)."""
    sch.transform_layout(unpack, ("write", 0), lambda col, depth: (depth, col))  # columns contiguous: vector stores
    sch.compute_at(unpack, k_block)
    col, depth = sch.get_loops(unpack)[-2:]
    sch.reorder(depth, col)
    sch.vectorize(sch.split(col, [None, math.gcd(lanes, static_extent(sch, col))])[1])


def _norm(sch: s_tir.Schedule, lanes: int) -> None:
    """RMSNorm (with or without a fused residual add) and LayerNorm: one row per task, vectorised over features; the
    residual sum before it across the cores."""
    block = sch.get_sblock(stages.NORM)
    row, col = sch.get_loops(block)
    work = _work(sch, (row, col))
    if (static_extent(sch, col) or 1) % lanes == 0:
        sch.vectorize(sch.split(col, [None, lanes])[1])
    _parallel(sch, row, work)
    for producer in reversed(sch.get_producers(block)):  # the last first: LayerNorm's variance needs its mean
        if stages.is_reduction(sch, producer):  # the row's sums: per row, right before the row is scaled
            _row_sums(sch, producer, row, lanes)
        else:  # add_rms_norm's residual sum: an output of its own, over all rows
            _spatial(sch, producer, lanes)


def _row_sums(sch: s_tir.Schedule, sums, row, lanes: int) -> None:
    """A norm's per-row (per-group) sums computed under `row`: as `lanes` partial sums in one vector, then added
    up, where the group is whole vectors; one serial chain of scalar adds was 4 cycles an element (add_rms_norm
    [1024, 896]: 0.809 -> 0.320 ms, Intel Xeon with AMX)."""
    depth = sch.get_loops(sums)[-1]
    if (static_extent(sch, depth) or 1) % lanes:
        sch.compute_at(sums, row)
        return
    rank = len(sch.get(sums).writes[0].region)
    partial = sch.rfactor(sch.split(depth, [None, lanes])[1], factor_axis=rank)  # the lanes last: one vector
    sch.compute_at(sums, row)
    sch.compute_at(partial, row, preserve_unit_loops=True)
    lane, *rows, step = _by_iter(sch, partial)  # iters: lane, the row (and its group), depth step
    sch.reorder(*rows, step, lane)
    sch.vectorize(lane)
    sch.decompose_reduction(partial, step)


def _attention(sch: s_tir.Schedule, lanes: int) -> None:
    """One task per query head, every softmax stage computed where it is consumed; query-key dot products as
    vector FMAs over the head dimension (one horizontal sum per score), the weighted sum of values
    vectorised over the head dimension too."""
    sch.compute_inline(sch.get_sblock(stages.MASKED))
    out = sch.get_sblock(stages.ATTENTION)
    row, col = sch.get_loops(out)
    head_dim = static_extent(sch, col) // static_extent(sch, sch.get_loops(sch.get_sblock(stages.ROW_MAX))[0])
    head, lane = sch.split(col, [None, head_dim])
    sch.reorder(head, row, lane)
    sch.parallel(head)
    vector = head_dim % lanes == 0
    if vector:
        scores = sch.get_sblock(stages.SCORES)
        partial = sch.rfactor(sch.split(sch.get_loops(scores)[-1], [None, lanes])[1], factor_axis=3)
    for stage in (stages.WEIGHTED, stages.ROW_SUM, stages.EXP, stages.ROW_MAX, stages.SCORES) + (
            (stages.SCORES + "_rf",) if vector else ()):
        sch.compute_at(sch.get_sblock(stage), head, preserve_unit_loops=True)
    if vector:
        _vector_dots(sch, scores, partial)
        sch.vectorize(sch.split(lane, [None, lanes])[1])
    _vector_exp(sch, lanes)
    weighted = sch.get_sblock(stages.WEIGHTED)
    w_col, w_ctx = sch.get_loops(weighted)[-2:]
    sch.reorder(w_ctx, w_col)
    if vector:
        sch.vectorize(sch.split(w_col, [None, lanes])[1])
    sch.decompose_reduction(weighted, w_ctx)


def _vector_exp(sch: s_tir.Schedule, lanes: int) -> None:
    """Softmax exponentials vectorised over positions, when their count is known to be whole vectors."""
    position = sch.get_loops(sch.get_sblock(stages.EXP))[-1]
    if tvm.sym.Analyzer().can_prove_equal(sch.get(position).extent % lanes, 0):
        sch.vectorize(sch.split(position, [None, lanes])[1])


def _by_iter(sch: s_tir.Schedule, block) -> list:
    """The block's innermost loops, one per block iter in iter order (valid after compute_at with unit loops kept)."""
    iters = sch.get(block).iter_vars
    return sch.get_loops(block)[-len(iters):]


def _vector_dots(sch: s_tir.Schedule, scores, partial) -> None:
    """Each score's `lanes` partial sums computed right before the score adds them (in registers, not memory)."""
    lane, _, row, position = _by_iter(sch, scores)  # iters: lanes reduced, head, row, position
    sch.reorder(row, position, lane)
    sch.compute_at(partial, position, preserve_unit_loops=True)
    simd, _, _, _, step = _by_iter(sch, partial)  # iters: lane, head, row, position, depth step
    sch.reorder(step, simd)
    sch.vectorize(simd)
    sch.decompose_reduction(partial, step)


SCHEDULES = {"linear": _linear, "rms_norm": _norm, "add_rms_norm": _norm, "layer_norm": _norm,
             "paged_attention": _attention, "padded_attention": _attention, "image_attention": _attention,
             "batch_gated_delta_rule": _delta_rule, "delta_inputs": _delta_inputs}


BF16_GEMMS = {"amx": amx_gemm, "avx512bf16": dpbf16_gemm}
BF16_AWQ_GEMMS = {"amx": amx_awq_gemm, "avx512bf16": dpbf16_awq_gemm}


def _written(func: tirx.PrimFunc, kind: str, target, attrs: dict | None) -> tirx.PrimFunc | None:
    """A hand-written kernel for this op and shape on `target`, or None when schedule primitives handle it."""
    lanes, bf16_products, vnni = target.lanes, target.bf16_products, "avx512vnni" in target.features
    if kind == "linear" and packed_weight(func):
        rows = int(func.params[0].shape[0])
        few = rows <= GEMV_MAX_ROWS or rows % lanes  # else the GEMM, on a tile unpacked at a time
        if not paired_weight(func):
            return None  # the GPU layout: the definition
        if few:
            return awq_linear(func, lanes, vnni, DPBF16PS_IR if bf16_products == "avx512bf16" else None)
        return BF16_AWQ_GEMMS[bf16_products](func) if bf16_products else None
    if kind == "linear":
        rows = int(func.params[0].shape[0])
        gemm = BF16_GEMMS[bf16_products](func) if bf16_products and rows >= BF16_MIN_ROWS else None
        if gemm is None and bf16_products == "avx512bf16" and rows_on_dot_products(func, target):
            gemm = _rows_gemv(func, target, dot_ir=DPBF16PS_IR)
        return gemm if gemm is not None else _rows_gemv(func, target)
    if kind == "paged_attention" and attrs is not None:
        return paged_attention(func, attrs, lanes, target.bf16_attention)
    if kind == "batch_gated_delta_rule" and attrs is not None:
        return delta_rule(func, attrs, lanes, target.scan_lanes)
    if kind == "batch_causal_conv1d":
        return causal_conv(func, lanes)
    return None


def schedule(func: tirx.PrimFunc, kind: str, attrs: dict, target) -> tirx.PrimFunc:
    """The kernel of an op of `kind` (with the op's `attrs`) for a CPU target (`compiler.target.CpuTarget`: its
    float32 SIMD `lanes`, and where prefill products of bfloat16 weights run in bfloat16: `bf16_products`); exp and
    sigmoid as vectorisable arithmetic."""
    lanes = target.lanes
    written = _written(func, kind, target, attrs)
    if written is None:
        sch = s_tir.Schedule(func)
        SCHEDULES.get(kind, _generic)(sch, lanes)
        written = sch.mod["main"]
    return vector_math(written.with_attr("tirx.noalias", True))  # as the definitions: no two buffers overlap
