"""Prefill matrix products as AVX512-BF16 dot products: bfloat16 weights times activations rounded to bfloat16.

For CPUs with AVX512-BF16 but no AMX (AMD Zen 4 and 5, Intel Cooper Lake), under `--matmul-precision bfloat16`,
with the numerics of the AMX kernel: activations rounded to bfloat16 (ties to even) once per call, products
exact, sums float32.

`vdpbf16ps acc, a, b` adds, in each of 16 float32 lanes i, a[2i] * b[2i] + a[2i + 1] * b[2i + 1]. Here the lanes
are 16 token rows: `a` holds one depth pair of each, from the activations packed once per call into
[rows / 16, depth / 2, 16, 2] (as the AMX kernel packs them), and `b` is one depth pair of one weight row read in
place (w is [out, in], so a pair is one 32-bit word) and broadcast to every lane. A register tile of up to
4 x 16 token rows by up to 8 weight rows (at most 16 accumulators; 4 x 4 where the shape allows: 8 loads per 16
dot products) keeps its sums in registers; a task is a block of output columns that every tile of token rows
passes over, one depth block at a time (so the block's weights and activations stay in L2). Between depth blocks
the task keeps its sums in a buffer of its own, a column's token rows side by side as the registers hold them, and
writes them to y once at the end, each 16 x 16 block transposed in registers: kept in y, each register's 16 token
rows of one column were 16 scattered accesses at every block, which cost the kernel 1.6-4.2x on a Zen 5
(docs/performance.md).

Products of fewer rows (decode steps) run on the same instruction along the depth (`schedules.cpu._rows_gemv` with
`DPBF16PS_IR`): each lane adds the products of one depth pair of an x row and of a weight row.

TVM's LLVM backend stores bfloat16 as 16-bit integers and computes on it in float32, so no TVM expression has
LLVM's `<32 x bfloat>` type that the intrinsic takes. The kernel calls a small LLVM IR function instead
(`DPBF16PS_IR`, imported into the module with `pragma_import_llvm`) that reinterprets two words-vectors as
bfloat16 pairs and calls the intrinsic; LLVM inlines it, folding the broadcast into the instruction.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ir.packing import PAIR_SLOTS, pair_column

from .written import (PAIR_ROWS, group_product, group_value_pairs, linear_func, nibble_table,
                      pack_activation_pairs, packed_groups, packed_linear_func, transpose, widened)

LANES = PAIR_ROWS  # float32 lanes of a zmm register (16): token rows per vector
DEPTH_BLOCK_PAIRS = 512  # depth pairs per pass (1024 depth): a tile's activations and a task's weights stay in L2
MIN_DEPTH_BLOCK_PAIRS = 128  # shorter blocks cost more in reloaded sums than L2 reuse buys
MIN_TASKS = 8  # column blocks per product at least, to spread over the cores
ACCUMULATORS = 16  # of the 32 zmm registers: token vectors x weight rows per register tile
DOT = "ruda_dpbf16ps"

DPBF16PS_IR = f"""
declare <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float>, <32 x bfloat>, <32 x bfloat>)

define linkonce_odr <16 x float> @{DOT}(<16 x float> %acc, <16 x i32> %a, <16 x i32> %b) alwaysinline {{
  %pairs_a = bitcast <16 x i32> %a to <32 x bfloat>
  %pairs_b = bitcast <16 x i32> %b to <32 x bfloat>
  %sum = call <16 x float> @llvm.x86.avx512bf16.dpbf16ps.512(<16 x float> %acc, <32 x bfloat> %pairs_a,
                                                              <32 x bfloat> %pairs_b)
  ret <16 x float> %sum
}}
"""


def _register_tile(vectors: int) -> tuple[int, int]:
    """(token vectors, weight rows) of a register tile over `vectors` vectors of token rows: at most ACCUMULATORS
    sums, the fewest loads per dot product."""
    shapes = [(v, c) for v in (4, 2, 1) for c in (8, 4, 2) if vectors % v == 0 and v * c <= ACCUMULATORS]
    return min(shapes, key=lambda vc: ((vc[0] + vc[1]) / (vc[0] * vc[1]), -vc[0]))


def _tiles(m: int, n: int) -> tuple[int, int, int] | None:
    """(token vectors, weight rows) per register tile and columns per task, or None when m or n do not divide."""
    if m % LANES or n % LANES:
        return None
    vecs, cols = _register_tile(m // LANES)
    task = next((t for t in (64, 32) if n % t == 0 and n // t >= MIN_TASKS), LANES)
    return vecs, cols, task


def _dot_tile(weights: int, vecs: int):
    """A macro adding one depth pair's dot products into sums acc[weights, vecs, LANES]: token vector v's pair is
    xw[tv * vecs + v, pair] (LANES words), weight row c's the word wf[w_at + c * w_step], broadcast."""
    @T.macro
    def dots(acc, xw, tv, pair, wf, w_at, w_step):
        for c in T.unroll(weights):
            for v in T.unroll(vecs):
                acc[c, v, T.ramp(0, 1, LANES)] = T.call_extern(
                    "float32x16", DOT, acc[c, v, T.ramp(0, 1, LANES)], xw[tv * vecs + v, pair, T.ramp(0, 1, LANES)],
                    T.broadcast(wf[w_at + c * w_step], LANES))

    return dots


@T.macro
def _to_y(part, t0, t1, y, first, rows, col0, cols):
    """y[:rows, col0:col0 + cols] = part[:cols, :rows] (a task's sums, a column's token rows side by side) plus each
    column's first value, in 16 x 16 blocks turned in registers (t0, t1)."""
    for tr, tc in T.grid(rows // LANES, cols // LANES):
        for c in T.unroll(LANES):
            t0[c, T.ramp(0, 1, LANES)] = part[tc * LANES + c, T.ramp(tr * LANES, 1, LANES)]
        transpose(t0, t1)
        for r in T.unroll(LANES):
            for lane in T.vectorized(LANES):
                y[tr * LANES + r, col0 + tc * LANES + lane] = t0[r, lane] + first(col0 + tc * LANES + lane)


def dpbf16_gemm(func: tirx.PrimFunc, dot_ir: str = DPBF16PS_IR) -> tirx.PrimFunc | None:
    """x @ w.T (+ bias) for float32 x and bfloat16 w as AVX512-BF16 dot products, or None when the shape does not
    fit (token rows and outputs multiples of 16, depth even). `dot_ir` defines the dot product (tests pass a
    plain-IR one of the same arithmetic, to run the kernel on CPUs without the instruction)."""
    x_buf, w_buf = func.params[:2]
    m, k = (int(d) for d in x_buf.shape)
    n = int(w_buf.shape[0])
    tiles = _tiles(m, n)
    if w_buf.dtype != "bfloat16" or x_buf.dtype != "float32" or k % 2 or tiles is None:
        return None
    vecs, cols, task_cols = tiles
    pairs = k // 2
    block = next((b for b in range(min(pairs, DEPTH_BLOCK_PAIRS), MIN_DEPTH_BLOCK_PAIRS - 1, -1) if pairs % b == 0),
                 pairs)  # no divisor that large: one pass over the whole depth

    half = cols // 2

    # Tile offsets as functions, not names bound in the macro (TVM 0.27 would make those heap buffers).
    def row(tv):
        """The first token row of token tile tv."""
        return tv * vecs * LANES

    def local(ct, h):
        """The first column, within its task, of half h of register tile ct."""
        return ct * cols + h * half

    def col(task, ct, h):
        """The first weight row of half h of a task's register tile ct."""
        return task * task_cols + local(ct, h)

    @T.macro
    def start(acc, part, kb, tv, ct, h):
        for c, v in T.grid(half, vecs):
            for lane in T.vectorized(LANES):
                acc[c, v, lane] = T.if_then_else(kb == 0, T.float32(0),
                                                 part[local(ct, h) + c, row(tv) + v * LANES + lane])

    dots = _dot_tile(half, vecs)

    @T.macro
    def finish(acc, part, tv, ct, h):
        for c, v in T.grid(half, vecs):
            for lane in T.vectorized(LANES):
                part[local(ct, h) + c, row(tv) + v * LANES + lane] = acc[c, v, lane]

    @T.macro
    def products(x, w, y, first):
        xp = T.alloc_buffer((m // LANES, pairs, LANES, 2), "uint16")
        pack_activation_pairs(x, xp)
        xw = T.decl_buffer((m // LANES, pairs, LANES), "int32", data=xp.data)  # a depth pair of 16 rows: 16 words
        ww = T.decl_buffer((n * pairs,), "int32", data=w.data)  # a depth pair of a weight row: one word
        with T.attr(0, "pragma_import_llvm", dot_ir):
            for task in T.parallel(n // task_cols):
                # the tile's sums in two buffers of half its weight rows: each under 1 KiB, so on the stack (TVM
                # puts larger ones on the heap), where LLVM keeps them in registers
                acc0 = T.alloc_buffer((half, vecs, LANES), "float32")
                acc1 = T.alloc_buffer((half, vecs, LANES), "float32")
                # the task's sums between depth blocks, a column's token rows side by side (as the registers hold
                # them): whole vectors in and out, where y's layout would scatter 16 rows of one column
                part = T.alloc_buffer((task_cols, m), "float32")
                t0 = T.alloc_buffer((LANES, LANES), "float32")  # a block being transposed: in registers
                t1 = T.alloc_buffer((LANES, LANES), "float32")
                for kb, tv, ct in T.grid(pairs // block, m // LANES // vecs, task_cols // cols):
                    start(acc0, part, kb, tv, ct, 0)
                    start(acc1, part, kb, tv, ct, 1)
                    for d in range(block):
                        dots(acc0, xw, tv, kb * block + d, ww, col(task, ct, 0) * pairs + kb * block + d, pairs)
                        dots(acc1, xw, tv, kb * block + d, ww, col(task, ct, 1) * pairs + kb * block + d, pairs)
                    finish(acc0, part, tv, ct, 0)
                    finish(acc1, part, tv, ct, 1)
                _to_y(part, t0, t1, y, first, m, task * task_cols, task_cols)

    return linear_func(func, products)


def dpbf16_awq_gemm(func: tirx.PrimFunc, dot_ir: str = DPBF16PS_IR) -> tirx.PrimFunc | None:
    """x @ W.T (+ bias) for float32 x and a weight in the pairs layout (ir.packing: AWQ's awq_int4_pairs or an
    affine kind's) as AVX512-BF16 dot products, or None when the shape does not fit (16-word column tiles, token
    rows a multiple of 16).

    The numerics of `schedules.amx.amx_awq_gemm`: the 4-bit values enter as their exact bfloat16, a group's sums
    C = sum of x * q are scaled once the group ends, s * (C - z * sum of x over the group), so only the activations
    are rounded. A task owns a column tile (64 columns); group by group it unpacks the tile's words into pairs of
    bfloat16 (`nibble_pairs`: 16 KiB for a group of 128, in L1), then every register tile of token rows passes over
    them as in `dpbf16_gemm`, the weight pair broadcast to 16 token rows. A weight of two planes (ir.packing: values
    16 h + l of up to 8 bits, exact in bfloat16) is unpacked as those values (`byte_pairs`), so it takes the dot
    products of a 4-bit weight, not one set per plane (a [5632, 2048] product of 64 rows of a Q8_0 file on Zen 4:
    8.15 ms as two planes)."""
    x_buf, q_buf, s_buf = func.params[0], func.params[1], func.params[3]
    m, k = (int(d) for d in x_buf.shape)
    tiles, pairs, words = (int(d) for d in q_buf.shape)
    planes, groups, group = packed_groups(x_buf, s_buf, pairs)
    groups *= planes  # packed groups: planes (ir.packing) of each group of x
    group_pairs, columns = pairs // groups, PAIR_SLOTS * words
    if words != LANES or m % LANES or pairs % groups or x_buf.dtype != "float32":
        return None
    vecs, cols = _register_tile(m // LANES)
    half = cols // 2
    dots = _dot_tile(half, vecs)

    def column(ct, h, c):
        """Weight column c of half h of register tile ct, in the order the unpacked words hold them (nibble-major)."""
        return ct * cols + h * half + c

    def nibble(ct, h, c):
        """The nibble of its word that holds that column."""
        return column(ct, h, c) // words

    def word(ct, h, c):
        """The word of the tile that holds it."""
        return column(ct, h, c) % words

    def placed(ct, h, c):
        """Its column within the task's columns of y (ir.packing.pair_column of tile 0)."""
        return pair_column(0, nibble(ct, h, c), word(ct, h, c), words)

    @T.macro
    def fold(acc, part, qz, sc, xsum, task, g, tv, ct, h):
        """A group's sums into the task's: scaled, less the zero point times the group's x (written.group_product)."""
        for c, v in T.grid(half, vecs):
            for lane in T.vectorized(LANES):
                part[placed(ct, h, c), (tv * vecs + v) * LANES + lane] = part[
                    placed(ct, h, c), (tv * vecs + v) * LANES + lane] + group_product(
                    qz, sc, task, g, nibble(ct, h, c), word(ct, h, c), words, acc[c, v, lane],
                    xsum[tv * vecs + v, g, lane], planes, whole=planes == 2, group=group)

    @T.macro
    def products(x, qw, qz, sc, ys, first):
        xp = T.alloc_buffer((m // LANES, k // 2, LANES, 2), "uint16")
        pack_activation_pairs(x, xp)
        xw = T.decl_buffer((m // LANES, k // 2, LANES), "int32", data=xp.data)  # a depth pair of 16 rows: 16 words
        xsum = T.alloc_buffer((m // LANES, groups // planes, LANES), "float32")  # the rounded x's sum over a group
        for tv in T.parallel(m // LANES):
            for g in range(groups // planes):
                for lane in T.vectorized(LANES):
                    xsum[tv, g, lane] = T.float32(0)
                for p in range(group_pairs):
                    for lane in T.vectorized(LANES):
                        xsum[tv, g, lane] = xsum[tv, g, lane] + (widened(xw[tv, g * group_pairs + p, lane])
                                                                 + widened(xw[tv, g * group_pairs + p, lane] >> 16))
        with T.attr(0, "pragma_import_llvm", dot_ir):
            for task in T.parallel(tiles):
                table = T.alloc_buffer((2 * LANES,), "uint16")
                unpacked = T.alloc_buffer((group_pairs, columns), "uint32")  # a group's pairs of the tile's columns
                uw = T.decl_buffer((group_pairs * columns,), "int32", data=unpacked.data)
                acc0 = T.alloc_buffer((half, vecs, LANES), "float32")  # in registers, as in dpbf16_gemm
                acc1 = T.alloc_buffer((half, vecs, LANES), "float32")
                part = T.alloc_buffer((columns, m), "float32")  # the task's sums, a column's token rows side by side
                t0 = T.alloc_buffer((LANES, LANES), "float32")
                t1 = T.alloc_buffer((LANES, LANES), "float32")
                nibble_table(table)
                for j, r in T.grid(columns, m):
                    part[j, r] = T.float32(0)
                for g in range(groups // planes):
                    for p in range(group_pairs):
                        for n in T.unroll(PAIR_SLOTS):
                            unpacked[p, T.ramp(n * words, 1, words)] = group_value_pairs(
                                table, qw, task, g, p, n, planes, group_pairs, words)
                    for tv, ct in T.grid(m // LANES // vecs, columns // cols):
                        for c, v in T.grid(half, vecs):
                            for lane in T.vectorized(LANES):
                                acc0[c, v, lane] = T.float32(0)
                                acc1[c, v, lane] = T.float32(0)
                        for p in range(group_pairs):
                            dots(acc0, xw, tv, g * group_pairs + p, uw, p * columns + column(ct, 0, 0), 1)
                            dots(acc1, xw, tv, g * group_pairs + p, uw, p * columns + column(ct, 1, 0), 1)
                        fold(acc0, part, qz, sc, xsum, task, g, tv, ct, 0)
                        fold(acc1, part, qz, sc, xsum, task, g, tv, ct, 1)
                _to_y(part, t0, t1, ys, first, m, task * columns, columns)

    return packed_linear_func(func, products)
