"""Products with AWQ INT4 weights on a CPU: the checkpoint's packed words, unpacked in registers.

qweight comes in column tiles [tiles, in, tile words] (ir.packing), eight output columns to a word (nibble slot i
holds column 8 * word + AWQ_ORDER[i]). A task owns a tile, one cache line of words a row, and streams it one
input row at a time, so every load is a whole vector of words of contiguous memory; each nibble slot, shifted and
masked (AVX-512: masked in place, 16 ** slot times its value, undone at the group's end), is a vector of one
column of each word, widened to float32 and multiplied by the broadcast x value. Zero
points and scales are applied once per group: over a group, sum x * (q - z) * s = s * (sum x * q - z * sum x), so
the accumulators hold sum x * q and the group's end subtracts z times the group's x sum and scales. The
accumulator tile (rows x slots x vectors) is the one with the fewest unpacks and loads per FMA that fits half the
SIMD registers; the passes of the other slots and rows find the group's strip in L1. The rows loop in passes too,
so the same kernel serves decode steps and prefill chunks.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ir.packing import AWQ_PACK, awq_column

from .written import packed_linear_func

PREFETCH_ROWS = 64  # input rows ahead the first pass over a tile asks for (into L2): 4 KiB, a page


def _nibble(word, slot, masked: bool = False):
    """Nibble `slot` of int32 words as float32 (the slot loops are unrolled: shifts and masks are constants):
    shifted down and masked, or (`masked`) masked where it lies, as unsigned, so 16 ** slot times its value: one
    integer op instead of two, and exact (four significant bits)."""
    if masked:
        return T.Cast("float32", T.bitwise_and(T.reinterpret("uint32", word), T.shift_left(T.uint32(15), 4 * slot)))
    return T.Cast("float32", T.bitwise_and(T.shift_right(word, 4 * slot), 15))


def _group_sum(acc, xsum, qz, sc, g, word, slot, masked: bool):
    """A group's sum of x * (q - z) * s for the column of `word` in nibble `slot`, from its sum of x * q (`acc`,
    scaled as `_nibble(..., masked)` scales it: by 16 ** slot when masked, undone here exactly) and of x (`xsum`)."""
    zero = _nibble(qz[g, word], slot)
    if masked:
        acc = acc * T.reinterpret("float32", T.shift_left(127 - 4 * slot, 23))  # 2 ** -(4 * slot)
    return T.Cast("float32", sc[g, word * AWQ_PACK + awq_column(slot)]) * (acc - xsum * zero)


def _tile(rows: int, vecs: int, budget: int) -> tuple[int, int, int]:
    """(rows, slots, vectors) of the accumulator tile: the fewest unpack ops (2 a slot vector), word loads and x
    broadcasts per FMA within `budget` accumulators."""
    options = [(r, s, v) for r in range(1, rows + 1) for s in (1, 2, 4, 8) for v in range(1, vecs + 1)
               if rows % r == 0 and vecs % v == 0 and r * s * v <= budget]
    return min(options, key=lambda t: ((2 * t[1] * t[2] + t[2] + t[0]) / (t[0] * t[1] * t[2]), -t[0], -t[1]))


def awq_linear(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """The packed product of `compiler.kernels.linear` as a weight-streaming loop, or None when the words do not
    split into whole SIMD vectors."""
    x_buf, q_buf, z_buf = func.params[:3]
    m, k = (int(d) for d in x_buf.shape)
    tiles, strip, groups = int(q_buf.shape[0]), int(q_buf.shape[2]), int(z_buf.shape[0])
    group = k // groups
    if strip % lanes:
        return None
    vecs = strip // lanes
    rows, slots, tile_vecs = _tile(m, vecs, 16 if lanes >= 16 else 8)
    masked = lanes >= 16  # AVX-512: eight mask constants fit beside the accumulators in 32 registers (AVX2: 16),
    # and it converts unsigned words to float32 in one instruction

    @T.macro
    def products(xs, qw, qz, sc, ys, first):
        flat = T.decl_buffer((tiles * k * strip,), "int32", data=qw.data)
        for task in T.parallel(tiles):
            sums = T.alloc_buffer((m, AWQ_PACK, vecs, lanes), "float32")
            acc = T.alloc_buffer((rows, slots, tile_vecs, lanes), "float32")  # on the stack: registers
            xsum = T.alloc_buffer((m,), "float32")
            for r, s, v, lane in T.grid(m, AWQ_PACK, vecs, lanes):
                sums[r, s, v, lane] = T.float32(0)
            for g in range(groups):
                for r in range(m):
                    xsum[r] = T.float32(0)
                    for i in range(group):
                        xsum[r] = xsum[r] + xs[r, g * group + i]
                for vt, rt in T.grid(vecs // tile_vecs, m // rows):
                    for st in T.unroll(AWQ_PACK // slots):  # slots known when compiled: masks, not shifts
                        for r in T.unroll(rows):
                            for s in T.unroll(slots):
                                for v in T.unroll(tile_vecs):
                                    for lane in T.vectorized(lanes):
                                        acc[r, s, v, lane] = T.float32(0)
                        for i in range(group):
                            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(flat[(
                                task * k + g * group + i + PREFETCH_ROWS) * strip]), 0, 2, 1))  # a hint: never faults
                            for r in T.unroll(rows):
                                for s in T.unroll(slots):
                                    for v in T.unroll(tile_vecs):
                                        for lane in T.vectorized(lanes):
                                            acc[r, s, v, lane] = acc[r, s, v, lane] + xs[rt * rows + r, g * group + i] \
                                                * _nibble(qw[task, g * group + i, (vt * tile_vecs + v) * lanes + lane],
                                                          st * slots + s, masked)
                        for r in T.unroll(rows):
                            for s in T.unroll(slots):
                                for v in T.unroll(tile_vecs):
                                    for lane in T.vectorized(lanes):
                                        sums[rt * rows + r, st * slots + s, vt * tile_vecs + v, lane] = sums[
                                            rt * rows + r, st * slots + s, vt * tile_vecs + v, lane] + _group_sum(
                                            acc[r, s, v, lane], xsum[rt * rows + r], qz, sc, g,
                                            task * strip + (vt * tile_vecs + v) * lanes + lane, st * slots + s,
                                            masked)
            for r, s, v, lane in T.grid(m, AWQ_PACK, vecs, lanes):
                ys[r, (task * strip + v * lanes + lane) * AWQ_PACK + awq_column(s)] = \
                    first((task * strip + v * lanes + lane) * AWQ_PACK + awq_column(s)) + sums[r, s, v, lane]

    return packed_linear_func(func, products)
