"""Products with AWQ INT4 weights on a CPU, for a few rows (decode steps): integer pair dot products on the packed
values, the activations split into two 16-bit integers each.

The weights come in the pairs layout (ir.packing awq_int4_pairs): a word holds input rows 2p and 2p + 1 of four
columns, and `(word >> 4n) & 0x000F000F` of a vector of words is a vector of 16-bit pairs of as many columns,
whose scales lie side by side. vpdpwssd (AVX512-VNNI; else pmaddwd and an add) multiplies it with a pair of
16-bit activations and adds both products to 32-bit sums: one instruction for 2 x `lanes` weights, where
unpacking each value to float32 for an FMA took three for `lanes`. A task's sums end in the layout's column order
and are written to their own columns (ir.packing.pair_column).

The activations are made integers once per call, per block of X_BLOCK input rows (an even divisor of the group):
with d = max |x| / 32767 over the block, x = d * (x1 + x2 / 2 ** 15) + e, x1 = round(x / d) and x2 = round((x / d
- x1) * 2 ** 15) both 16-bit, |e| <= d / 2 ** 16: within 5e-10 of the block's largest value, so the products stay
as close to float32 ones as float32 sums are to exact ones. Each of x1 and x2 has its own integer sums (at most
X_BLOCK * 32767 * 15 * 16 < 2 ** 31, nibble 1's factor below included: no overflow); at a block's end they become
float32, and with the block's x sum the zero points and scales are applied: over a group, sum x * (q - z) * s =
s * (sum x * q - z * sum x) (an affine weight's offsets: sum x * (q * s + m) = s * sum x * q + m * sum x).

Extracting the pairs of nibble n costs one operation for three of the four: nibble 0 is masked where it lies,
nibble 1 too (16 times its value, undone after the block), nibble 3 is a 16-bit shift alone; nibble 2 is shifted
and masked. A task owns a column tile, or two where the registers hold both tiles' sums and the tasks stay an
even number (one row: two contiguous streams of words a core, 1.04x faster from memory than one), and streams its
words, `tile` words a row pair; the accumulators (tiles x terms x rows x the four column vectors of a word x
vectors) are at most half the SIMD registers, and the rows loop in passes, so the same kernel serves any number
of rows. A weight of planes (ir.packing) streams all its packed rows, each block of them times its block of x.

A bf16 build on AVX512-BF16 (`--matmul-precision bfloat16`, `bf16_ir`) runs the same loop on bfloat16 dot
products instead, with its numerics: x rounded to bfloat16 once per call, one term. A pair of nibbles becomes a
pair of bfloat16 by setting the bits of 128 around it, `(words >> 4n) & 0x000F000F | 0x43004300`, each value q
read as 128 + q (exact: bfloat16 holds the integers up to 256), so a block's sum is C + 128 * sum x, and 128 * sum x
comes off before the scales. One `vdpbf16ps` multiplies 2 x 16 weights with an x pair, where the integer form
spends two instructions on them, one per term (on AMD Zen 4, which issues either at one 512-bit instruction a
cycle, the integer form's arithmetic is as slow as memory at Qwen2.5's shapes).
"""

from __future__ import annotations

from math import gcd

from tvm import tirx
from tvm.script import tirx as T

from ir.packing import PAIR_SLOTS, logical_row, pair_column

from .avx512_bf16 import DOT as BF16_DOT
from .written import PAIR_MASK, bf16_bits, group_product, packed_groups, packed_linear_func, prefetch, widened

PREFETCH_PAIRS = 64  # row pairs ahead the first pass over a tile asks for (into L2): 4 KiB of a 16-word tile
X_BLOCK = 128  # input rows per activation scale, at most
SPLIT = 1 << 15  # x2 holds the rest of x / d in units of 2 ** -15
DOT = "ruda_pmaddwd"


def pair_dot(lanes: int, vnni: bool) -> str:
    """The instruction of the pair dot products on a CPU of `lanes` float32 lanes, with AVX512-VNNI or not."""
    return "vpdpwssd" if vnni and lanes == 16 else "pmaddwd"


def dot_ir(lanes: int, vnni: bool) -> str:
    """LLVM IR of `acc + pmaddwd(a, b)` on `lanes` 32-bit lanes (AVX-512: 16, AVX2: 8): one vpdpwssd where the CPU
    has AVX512-VNNI, else pmaddwd and an add. vpdpwssd is written as inline assembly: LLVM turns its intrinsic
    into pmaddwd and an add, and on Intel CPUs fuses only some of them back (one more instruction per product on
    the port that the products are bound by; the Xeon of docs/performance.md: 1.3x slower in cache)."""
    pairs, sums = f"<{2 * lanes} x i16>", f"<{lanes} x i32>"
    if pair_dot(lanes, vnni) == "vpdpwssd":
        declare = ""
        body = f'%sum = call {sums} asm "vpdpwssd $2, $1, $0", "=v,v,v,0"({pairs} %a16, {pairs} %b16, {sums} %acc)'
    else:
        name = {16: "llvm.x86.avx512.pmaddw.d.512", 8: "llvm.x86.avx2.pmadd.wd"}[lanes]
        declare = f"declare {sums} @{name}({pairs}, {pairs})"
        body = f"%products = call {sums} @{name}({pairs} %a16, {pairs} %b16)\n  %sum = add {sums} %acc, %products"
    return f"""
{declare}

define linkonce_odr {sums} @{DOT}({sums} %acc, {sums} %a, {sums} %b) alwaysinline {{
  %a16 = bitcast {sums} %a to {pairs}
  %b16 = bitcast {sums} %b to {pairs}
  {body}
  ret {sums} %sum
}}
"""


IN_PLACE = 1  # nibbles up to this one are masked where they lie: 16 * 15 fits 16 bits, X_BLOCK rows' sums 32
BF16_BIAS = 128  # bf16_ir: each 4-bit value q enters as this plus q, ...
BF16_BIAS_PAIR = 0x43004300  # ... the bits of bfloat16 128 in each half of a word, q in the low bits of each


def _pair_values(words, n, lanes: int):
    """The 16-bit pairs of nibble n (an unrolled loop's variable: the selects fold away) of a vector of words, as
    the module docstring says: nibble IN_PLACE's 16 times their value."""
    top = T.reinterpret(f"int32x{lanes}", T.shift_right(T.reinterpret(f"uint16x{2 * lanes}", words),
                                                         T.broadcast(T.uint16(4 * (PAIR_SLOTS - 1)), 2 * lanes)))
    lowest = T.bitwise_and(T.shift_right(words, T.broadcast(4 * n, lanes)), T.broadcast(PAIR_MASK, lanes))
    in_place = T.bitwise_and(words, T.broadcast(T.Select(n == IN_PLACE, PAIR_MASK << 4 * IN_PLACE, PAIR_MASK), lanes))
    return T.Select(n == PAIR_SLOTS - 1, top, T.Select(n <= IN_PLACE, in_place, lowest))


def x_block(group: int) -> int:
    """Input rows per activation scale: the largest even divisor of the (even) group up to X_BLOCK."""
    return max(b for b in range(2, min(group, X_BLOCK) + 1, 2) if group % b == 0)


def _bf16_pair_values(words, n, lanes: int):
    """The 4-bit pairs of nibble n of a vector of `lanes` words as pairs of bfloat16 of 128 + q (bf16_ir)."""
    return T.bitwise_or(T.bitwise_and(T.shift_right(words, T.broadcast(4 * n, lanes)), T.broadcast(PAIR_MASK, lanes)),
                        T.broadcast(BF16_BIAS_PAIR, lanes))


def _accumulators(rows: int, vecs: int, terms: int) -> int:
    """SIMD registers the sums of one column tile take: terms x rows x PAIR_SLOTS x vectors."""
    return terms * rows * PAIR_SLOTS * vecs


def _tile(rows: int, vecs: int, budget: int, terms: int) -> tuple[int, int]:
    """(rows, vectors) of the accumulator tile: `_accumulators` within `budget`, the fewest loads (a word vector per
    vector, an activation pair per row and term) per dot product."""
    options = [(r, v) for r in range(1, rows + 1) for v in range(1, vecs + 1)
               if rows % r == 0 and vecs % v == 0 and _accumulators(r, v, terms) <= budget]
    return min(options, key=lambda t: ((t[1] + terms * t[0]) / (t[0] * t[1]), -t[0]))


def _integer_activations(block: int, lanes: int):
    """A macro (xs, xq, scale, xsum) writing xq[r, term, i]: x1 (term 0) and x2 (term 1) of x[r, i] as 16-bit
    integers, scale[r, b] = d and xsum[r, b] = the sum of x over block b (see the module docstring); in vectors of
    up to `lanes`."""
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


def _rounded_activations(block: int, lanes: int):
    """A macro (xs, xq, scale, xsum) writing xq[r, 0, i]: x[r, i] rounded to bfloat16 (its bits), and xsum[r, b] =
    the sum of the rounded x over block b; `scale`, which only the integer form has, is left alone."""
    chunk = gcd(block, lanes)

    @T.macro
    def rounded(xs, xq, scale, xsum):
        total = T.alloc_buffer((chunk,), "float32")
        for r, b in T.grid(xs.shape[0], scale.shape[1]):
            for lane in T.vectorized(chunk):
                total[lane] = T.float32(0)
            for i in range(block // chunk):
                for lane in T.vectorized(chunk):
                    xq[r, 0, b * block + i * chunk + lane] = bf16_bits(xs[r, b * block + i * chunk + lane])
                    total[lane] = total[lane] + widened(xq[r, 0, b * block + i * chunk + lane])
            xsum[r, b] = T.float32(0)
            for lane in range(chunk):
                xsum[r, b] = xsum[r, b] + total[lane]

    return rounded


def awq_linear(func: tirx.PrimFunc, lanes: int, vnni: bool = False,
               bf16_ir: str | None = None) -> tirx.PrimFunc | None:
    """The packed product of `compiler.kernels.linear` (weights in the pairs layout) as a weight-streaming loop of
    integer pair dot products (`vnni`: the CPU has AVX512-VNNI), or, given `bf16_ir` (the LLVM IR of the bfloat16
    dot product: `schedules.avx512_bf16.DPBF16PS_IR`), of bfloat16 dot products on x rounded to bfloat16, or None
    when a tile's words do not split into whole SIMD vectors."""
    x_buf, q_buf, z_buf, s_buf = func.params[:4]
    m, k = (int(d) for d in x_buf.shape)
    tiles, pairs, words = (int(d) for d in q_buf.shape)
    planes, _, group = packed_groups(x_buf, s_buf, pairs)
    bf16_dot = bf16_ir is not None
    depth = 2 * pairs  # packed rows: a weight of planes (ir.packing) has more than x has columns
    block = x_block(group)
    if words % lanes or lanes not in (8, 16) or (bf16_dot and lanes != 16):
        return None
    vecs, terms = words // lanes, 1 if bf16_dot else 2
    # SIMD registers for the sums, each term's in a buffer under 1 KiB (TVM keeps those on the stack, where LLVM
    # holds them in registers; a larger one goes to the heap and is stored at every step): one term, half as many
    budget = (16 if lanes >= 16 else 8) * terms // 2
    rows, tile_vecs = _tile(m, vecs, budget, terms)
    fits = 2 * _accumulators(rows, tile_vecs, terms) <= budget  # two tiles' sums in half the SIMD registers
    streams = 2 if fits and tiles % 4 == 0 else 1  # tasks of two tiles, still an even number: two cores stay balanced
    block_pairs = block // 2
    activations = (_rounded_activations if bf16_dot else _integer_activations)(block, lanes)
    dot, sums_type = (BF16_DOT, "float32") if bf16_dot else (DOT, "int32")
    pair_values = _bf16_pair_values if bf16_dot else _pair_values

    def x_block_of(b):
        """The block of x that packed block b multiplies."""
        return logical_row(b * block, group, planes) // block

    def block_sum(sum1, sum2, d, xs_sum, qz, sc, task, g, n, word):
        """A block's sum of x * W for the column of `word` in nibble n (written.group_product), from its integer
        sums of x1 * q and x2 * q (nibble IN_PLACE's 16 times too large) and x's scale and sum over the block
        (group g); with bf16_ir, from its one float32 sum of x * (128 + q) and x's sum."""
        if bf16_dot:
            return group_product(qz, sc, task, g, n, word, words, sum1 - T.float32(BF16_BIAS) * xs_sum, xs_sum,
                                 planes, group=group)
        unit = T.Select(n == IN_PLACE, T.float32(1 / 16), T.float32(1))  # 16 ** -n for n <= IN_PLACE
        sum_xq = d * unit * (T.Cast("float32", sum1) + T.Cast("float32", sum2) * T.float32(1 / SPLIT))
        return group_product(qz, sc, task, g, n, word, words, sum_xq, xs_sum, planes, group=group)

    @T.macro
    def dots(acc, xw, term, w, task, rt, vt, pair, x_pair):
        for u in T.unroll(streams):
            for v in T.unroll(tile_vecs):
                for n in T.unroll(PAIR_SLOTS):
                    for r in T.unroll(rows):
                        acc[u, r, n, v, T.ramp(0, 1, lanes)] = T.call_extern(
                            f"{sums_type}x{lanes}", dot, acc[u, r, n, v, T.ramp(0, 1, lanes)], pair_values(
                                w[task * streams + u, pair, T.ramp((vt * tile_vecs + v) * lanes, 1, lanes)], n, lanes),
                            T.broadcast(xw[rt * rows + r, term, x_pair], lanes))

    @T.macro
    def products(xs, qw, qz, sc, ys, first):
        xq = T.alloc_buffer((m, terms, k), "uint16" if bf16_dot else "int16")
        scale = T.alloc_buffer((m, k // block), "float32")
        xsum = T.alloc_buffer((m, k // block), "float32")
        activations(xs, xq, scale, xsum)
        xw = T.decl_buffer((m, terms, k // 2), "int32", data=xq.data)  # an activation pair: one word
        flat = T.decl_buffer((tiles * pairs * words,), "int32", data=qw.data)
        with T.attr(0, "pragma_import_llvm", bf16_ir if bf16_dot else dot_ir(lanes, vnni)):
            for task in T.parallel(tiles // streams):
                sums = T.alloc_buffer((streams, m, PAIR_SLOTS, vecs, lanes), "float32")
                # each term's sums in a buffer of its own, on the stack (see `budget`; one term: acc2 names acc1,
                # unused)
                acc1 = T.alloc_buffer((streams, rows, PAIR_SLOTS, tile_vecs, lanes), sums_type)
                acc2 = T.alloc_buffer((streams, rows, PAIR_SLOTS, tile_vecs, lanes), "int32") if terms == 2 else acc1
                for u, r, n, v, lane in T.grid(streams, m, PAIR_SLOTS, vecs, lanes):
                    sums[u, r, n, v, lane] = T.float32(0)
                for b, vt, rt in T.grid(depth // block, vecs // tile_vecs, m // rows):
                    for u, r, n, v in T.grid(streams, rows, PAIR_SLOTS, tile_vecs):
                        for lane in T.vectorized(lanes):
                            acc1[u, r, n, v, lane] = T.Cast(sums_type, 0)
                            if terms == 2:
                                acc2[u, r, n, v, lane] = 0
                    for p in range(block_pairs):
                        if vt == 0 and rt == 0:
                            for u in T.unroll(streams):
                                T.evaluate(prefetch(flat[T.min(
                                    ((task * streams + u) * pairs + b * block_pairs + p + PREFETCH_PAIRS) * words,
                                    tiles * pairs * words - 1)]))
                        dots(acc1, xw, 0, qw, task, rt, vt, b * block_pairs + p, x_block_of(b) * block_pairs + p)
                        if terms == 2:
                            dots(acc2, xw, 1, qw, task, rt, vt, b * block_pairs + p, x_block_of(b) * block_pairs + p)
                    for u, r, n, v in T.grid(streams, rows, PAIR_SLOTS, tile_vecs):
                        for lane in T.vectorized(lanes):
                            sums[u, rt * rows + r, n, vt * tile_vecs + v, lane] = sums[
                                u, rt * rows + r, n, vt * tile_vecs + v, lane] + block_sum(
                                acc1[u, r, n, v, lane], acc2[u, r, n, v, lane], scale[rt * rows + r, x_block_of(b)],
                                xsum[rt * rows + r, x_block_of(b)], qz, sc, task * streams + u, b * block // group, n,
                                (vt * tile_vecs + v) * lanes + lane)
                for u, r, n, v, lane in T.grid(streams, m, PAIR_SLOTS, vecs, lanes):
                    ys[r, pair_column(task * streams + u, n, v * lanes + lane, words)] = first(pair_column(
                        task * streams + u, n, v * lanes + lane, words)) + sums[u, r, n, v, lane]

    return packed_linear_func(func, products)
