"""Products with AWQ INT4 weights on a CPU, for a few rows (decode steps): integer pair dot products on the packed
values, the activations split into two 16-bit integers each.

The weights come in the pairs layout (ir.packing awq_int4_pairs): a word holds input rows 2p and 2p + 1 of four
columns, and `(word >> 4n) & 0x000F000F` is a vector of 16-bit pairs of `tile` neighbouring columns. pmaddwd
(vpdpwssd where LLVM prefers it, as on AMD Zen 4 and 5) multiplies such a vector with a pair of 16-bit activations
and adds both products to 32-bit sums: two instructions for 2 x `lanes` weights, where unpacking each value to
float32 for an FMA took three for `lanes`.

The activations are made integers once per call, per block of X_BLOCK input rows (an even divisor of the group):
with d = max |x| / 32767 over the block, x = d * (x1 + x2 / 2 ** 15) + e, x1 = round(x / d) and x2 = round((x / d
- x1) * 2 ** 15) both 16-bit, |e| <= d / 2 ** 16: within 5e-10 of the block's largest value, so the products stay
as close to float32 ones as float32 sums are to exact ones. Each of x1 and x2 has its own integer sums (at most
X_BLOCK * 32767 * 15 < 2 ** 31: no overflow); at a block's end they become float32, and with the block's x sum
the zero points and scales are applied: over a group, sum x * (q - z) * s = s * (sum x * q - z * sum x).

A task owns a column tile and streams its words, one contiguous block of `tile` words a row pair; the
accumulators (terms x rows x the four column vectors of a word x vectors) are at most half the SIMD registers,
and the rows loop in passes, so the same kernel serves any number of rows.
"""

from __future__ import annotations

from math import gcd

from tvm import tirx
from tvm.script import tirx as T

from ir.packing import PAIR_SLOTS

from .written import packed_linear_func

PREFETCH_PAIRS = 64  # row pairs ahead the first pass over a tile asks for (into L2): 4 KiB of a 16-word tile
X_BLOCK = 128  # input rows per activation scale, at most
SPLIT = 1 << 15  # x2 holds the rest of x / d in units of 2 ** -15
PAIR_MASK = 0x000F000F  # one 4-bit value in each 16-bit half of a word
DOT = "ruda_pmaddwd"


def dot_ir(lanes: int) -> str:
    """LLVM IR of `acc + pmaddwd(a, b)` on `lanes` 32-bit lanes (AVX-512: 16, AVX2: 8); LLVM fuses the add into
    vpdpwssd where the CPU has it and runs it fast."""
    name = {16: "llvm.x86.avx512.pmaddw.d.512", 8: "llvm.x86.avx2.pmadd.wd"}[lanes]
    pairs = f"<{2 * lanes} x i16>"
    return f"""
declare <{lanes} x i32> @{name}({pairs}, {pairs})

define linkonce_odr <{lanes} x i32> @{DOT}(<{lanes} x i32> %acc, <{lanes} x i32> %a, <{lanes} x i32> %b) alwaysinline {{
  %a16 = bitcast <{lanes} x i32> %a to {pairs}
  %b16 = bitcast <{lanes} x i32> %b to {pairs}
  %products = call <{lanes} x i32> @{name}({pairs} %a16, {pairs} %b16)
  %sum = add <{lanes} x i32> %acc, %products
  ret <{lanes} x i32> %sum
}}
"""


def x_block(group: int) -> int:
    """Input rows per activation scale: the largest even divisor of the (even) group up to X_BLOCK."""
    return max(b for b in range(2, min(group, X_BLOCK) + 1, 2) if group % b == 0)


def _tile(rows: int, vecs: int, budget: int) -> tuple[int, int]:
    """(rows, vectors) of the accumulator tile: two terms x rows x PAIR_SLOTS x vectors within `budget`, the fewest
    loads (a word vector per vector, two activation pairs per row) per dot product."""
    options = [(r, v) for r in range(1, rows + 1) for v in range(1, vecs + 1)
               if rows % r == 0 and vecs % v == 0 and 2 * r * PAIR_SLOTS * v <= budget]
    return min(options, key=lambda t: ((t[1] + 2 * t[0]) / (t[0] * t[1]), -t[0]))


def _integer_activations(block: int, lanes: int):
    """A macro (xs, xq, scale, xsum) writing xq[r, term, i]: x1 (term 0) and x2 (term 1) of x[r, i] as 16-bit integers, scale[r, b] = d
    and xsum[r, b] = the sum of x over block b (see the module docstring); in vectors of up to `lanes`."""
    chunk = gcd(block, lanes)

    @T.macro
    def integers(xs, xq, scale, xsum):
        most = T.alloc_buffer((chunk,), "float32")
        total = T.alloc_buffer((chunk,), "float32")
        for r, b in T.grid(xs.shape[0], scale.shape[1]):
            for lane in T.vectorized(chunk):
                most[lane] = T.float32(0)
                total[lane] = T.float32(0)
            for i in range(block // chunk):
                for lane in T.vectorized(chunk):
                    most[lane] = T.max(most[lane], T.abs(xs[r, b * block + i * chunk + lane]))
                    total[lane] = total[lane] + xs[r, b * block + i * chunk + lane]
            scale[r, b] = T.float32(0)
            xsum[r, b] = T.float32(0)
            for lane in range(chunk):
                scale[r, b] = T.max(scale[r, b], most[lane])
                xsum[r, b] = xsum[r, b] + total[lane]
            scale[r, b] = T.if_then_else(scale[r, b] > T.float32(0), scale[r, b] / T.float32(32767), T.float32(1))
            for i in range(block // chunk):
                for lane in T.vectorized(chunk):
                    xq[r, 0, b * block + i * chunk + lane] = T.Cast("int16", T.round(
                        xs[r, b * block + i * chunk + lane] / scale[r, b]))
                    xq[r, 1, b * block + i * chunk + lane] = T.Cast("int16", T.round((
                        xs[r, b * block + i * chunk + lane] / scale[r, b]
                        - T.Cast("float32", xq[r, 0, b * block + i * chunk + lane])) * T.float32(SPLIT)))

    return integers


def awq_linear(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """The packed product of `compiler.kernels.linear` (weights in the pairs layout) as a weight-streaming loop of
    integer pair dot products, or None when a tile's words do not split into whole SIMD vectors."""
    x_buf, q_buf, z_buf, s_buf = func.params[:4]
    m, k = (int(d) for d in x_buf.shape)
    tiles, pairs, words = (int(d) for d in q_buf.shape)
    groups = int(s_buf.shape[0])
    group, block = k // groups, x_block(k // groups)
    if words % lanes or lanes not in (8, 16):
        return None
    vecs = words // lanes
    rows, tile_vecs = _tile(m, vecs, 16 if lanes >= 16 else 8)
    block_pairs = block // 2
    activations = _integer_activations(block, lanes)

    def column(task, n, v, lane):
        """The output column of lane `lane` of vector v of the columns in nibble n of a tile's words."""
        return (task * PAIR_SLOTS + n) * words + v * lanes + lane

    @T.macro
    def dots(acc, xw, term, w, task, rt, vt, pair):
        for v in T.unroll(tile_vecs):
            for n in T.unroll(PAIR_SLOTS):
                for r in T.unroll(rows):
                    acc[r, n, v, T.ramp(0, 1, lanes)] = T.call_extern(
                        f"int32x{lanes}", DOT, acc[r, n, v, T.ramp(0, 1, lanes)], T.bitwise_and(
                            T.shift_right(w[task, pair, T.ramp((vt * tile_vecs + v) * lanes, 1, lanes)],
                                          T.broadcast(4 * n, lanes)), T.broadcast(PAIR_MASK, lanes)),
                        T.broadcast(xw[rt * rows + r, term, pair], lanes))

    @T.macro
    def products(xs, qw, qz, sc, ys, first):
        xq = T.alloc_buffer((m, 2, k), "int16")
        scale = T.alloc_buffer((m, k // block), "float32")
        xsum = T.alloc_buffer((m, k // block), "float32")
        activations(xs, xq, scale, xsum)
        xw = T.decl_buffer((m, 2, k // 2), "int32", data=xq.data)  # an activation pair: one word
        flat = T.decl_buffer((tiles * pairs * words,), "int32", data=qw.data)
        with T.attr(0, "pragma_import_llvm", dot_ir(lanes)):
            for task in T.parallel(tiles):
                sums = T.alloc_buffer((m, PAIR_SLOTS, vecs, lanes), "float32")
                # the two terms' sums in buffers of their own, each at most 1 KiB: on the stack, so in registers
                acc1 = T.alloc_buffer((rows, PAIR_SLOTS, tile_vecs, lanes), "int32")
                acc2 = T.alloc_buffer((rows, PAIR_SLOTS, tile_vecs, lanes), "int32")
                for r, n, v, lane in T.grid(m, PAIR_SLOTS, vecs, lanes):
                    sums[r, n, v, lane] = T.float32(0)
                for b, vt, rt in T.grid(k // block, vecs // tile_vecs, m // rows):
                    for r, n, v in T.grid(rows, PAIR_SLOTS, tile_vecs):
                        for lane in T.vectorized(lanes):
                            acc1[r, n, v, lane] = 0
                            acc2[r, n, v, lane] = 0
                    for p in range(block_pairs):
                        if vt == 0 and rt == 0:
                            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(flat[T.min(
                                (task * pairs + b * block_pairs + p + PREFETCH_PAIRS) * words, tiles * pairs * words
                                - 1)]), 0, 2, 1))
                        dots(acc1, xw, 0, qw, task, rt, vt, b * block_pairs + p)
                        dots(acc2, xw, 1, qw, task, rt, vt, b * block_pairs + p)
                    for r, n, v in T.grid(rows, PAIR_SLOTS, tile_vecs):
                        for lane in T.vectorized(lanes):
                            sums[rt * rows + r, n, vt * tile_vecs + v, lane] = sums[
                                rt * rows + r, n, vt * tile_vecs + v, lane] + T.Cast("float32", sc[
                                    b * block // group, column(task, n, vt * tile_vecs + v, lane)]) * (
                                scale[rt * rows + r, b] * (T.Cast("float32", acc1[r, n, v, lane]) + T.Cast(
                                    "float32", acc2[r, n, v, lane]) * T.float32(1.0 / SPLIT))
                                - xsum[rt * rows + r, b] * T.Cast("float32", T.bitwise_and(T.shift_right(
                                    qz[task, b * block // group // 2, (vt * tile_vecs + v) * lanes + lane],
                                    4 * n + b * block // group % 2 * 16), 15)))
                for r, n, v, lane in T.grid(m, PAIR_SLOTS, vecs, lanes):
                    ys[r, column(task, n, v, lane)] = first(column(task, n, v, lane)) + sums[r, n, v, lane]

    return packed_linear_func(func, products)
