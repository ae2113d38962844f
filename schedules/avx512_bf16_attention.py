"""Prefill attention's two products as AVX512-BF16 dot products, in a `--matmul-precision bfloat16` build on a CPU
with AVX512-BF16 and no AMX (AMD Zen 4 and 5): a block of query rows of one sequence, for the heads that share one
KV head.

Numerics, as the AMX kernel's (`schedules.amx_attention`): q (scaled), keys, the softmax's probabilities and values
are rounded to bfloat16; scores, the softmax and the sums stay float32, and each row is divided by the sum of its
rounded probabilities.

The float32 block kernel's layout (`schedules.cpu_attention`), with pairs where it has single elements (`vdpbf16ps`
adds a[2i] b[2i] + a[2i + 1] b[2i + 1] into lane i, `schedules.avx512_bf16`): scores S[position, row] with the
block's rows in lanes, each dot product a pair of q's head dimensions for 16 rows (qp[dim / 2, row]) by the same pair
of one key, broadcast (the keys rounded once per task for all its heads, their row-major bits already pairs);
weighted sums O[row, dim] with the head dimension in lanes, each dot product the probabilities of a pair of positions
for one row, broadcast (pp[position / 2, row]), by the values of those two positions (vp[position / 2, dim]). So a
dot product does the work of two FMAs: on a Zen 5, which issues `vdpbf16ps` as fast as its FMAs, half the
instructions of the float32 kernel.
"""

from __future__ import annotations

from tvm.script import tirx as T

from .avx512_bf16 import DOT, DPBF16PS_IR
from .block_steps import POSITIONS, block_steps, steps
from .vector_math import softmax_exp
from .written import bf16_bits, bf16_pair, widened

WEIGHTED_PAIRS = 32  # pairs of positions whose values a block's rows sum in one pass: the values stay in L1


def fits(dim: int, lanes: int) -> bool:
    """Whether blocks with head dimension `dim` run as dot products: whole vectors of 16 float32 lanes."""
    return lanes == 16 and dim % lanes == 0


def _probability(s, top, first, j, v, lane):
    """The bits of the softmax's numerator for position j and row v * 16 + lane of a block whose first row is at
    position `first`, rounded to bfloat16: 0 past the row's position."""
    lanes = top.shape[1]
    return bf16_bits(T.Select(j <= first + v * lanes + lane, softmax_exp(s[j, v * lanes + lane] - top[v, lane]),
                              T.float32(0)))


def dpbf16_block_macro(shape):
    """The macro computing a block of `shape.block` rows of one sequence for `shape.head_block` heads sharing one
    KV head: row r0 + r of q sees positions [0, first + r]; `base(j)` is the flat offset of position j's key/value
    row."""
    lanes, vecs, block, dim, heads = shape.lanes, shape.vecs, shape.block, shape.dim, shape.head_block
    out_rows, out_vecs, scale, do = shape.out_rows, shape.out_vecs, shape.scale, block_steps(shape)
    span = (shape.history + 2 * POSITIONS - 1) // (2 * POSITIONS) * 2 * POSITIONS  # whole steps and whole pairs
    pairs = dim // 2
    lowest = T.min_value("float32")

    def seen_pairs(seen):
        """Pairs of positions that cover `seen` positions."""
        return (seen + 1) // 2

    @T.macro
    def heads_block(q, out, keys, values, h0, kv, r0, first, seen, base):
        kb = T.alloc_buffer((span, dim), "uint16")  # keys rounded, row-major: a row is its dim / 2 pairs
        kp = T.decl_buffer((span, pairs), "uint32", data=kb.data)
        vp = T.alloc_buffer((span // 2, dim), "uint32")  # values of a pair of positions, rounded
        qb = T.alloc_buffer((block, dim), "uint16")  # q rows, scaled, rounded
        qb_pairs = T.decl_buffer((block, pairs), "uint32", data=qb.data)
        qp = T.alloc_buffer((pairs, block), "uint32")  # the same, a pair of head dimensions of every row side by side
        s = T.alloc_buffer((span, block), "float32")  # scores
        pp = T.alloc_buffer((span // 2, block), "uint32")  # probabilities of a pair of positions
        offsets = T.alloc_buffer((POSITIONS,), "int32")
        acc = T.alloc_buffer((POSITIONS, vecs, lanes), "float32")
        top = T.alloc_buffer((vecs, lanes), "float32")
        total = T.alloc_buffer((vecs, lanes), "float32")
        out_acc = T.alloc_buffer((out_rows, out_vecs, lanes), "float32")
        o = T.alloc_buffer((block, out_vecs, lanes), "float32")  # the block's weighted sums of one pass
        with T.attr(0, "pragma_import_llvm", DPBF16PS_IR):
            for j, c in T.grid(seen_pairs(seen) * 2, dim // lanes):  # positions past the last seen one read it
                for lane in T.vectorized(lanes):  # again: their probabilities are 0
                    kb[j, c * lanes + lane] = bf16_bits(keys[base(T.min(j, seen - 1)) + kv + c * lanes + lane])
            for j2, c in T.grid(seen_pairs(seen), dim // lanes):
                for lane in T.vectorized(lanes):
                    vp[j2, c * lanes + lane] = bf16_pair(
                        bf16_bits(values[base(2 * j2) + kv + c * lanes + lane]),
                        bf16_bits(values[base(T.min(2 * j2 + 1, seen - 1)) + kv + c * lanes + lane]))
            for i in range(heads):
                for r, c in T.grid(block, dim // lanes):
                    for lane in T.vectorized(lanes):
                        qb[r, c * lanes + lane] = bf16_bits(q[r0 + r, (h0 + i) * dim + c * lanes + lane]
                                                            * T.float32(scale))
                for d2, r in T.grid(pairs, block):
                    qp[d2, r] = qb_pairs[r, d2]
                for v in T.unroll(vecs):
                    for lane in T.vectorized(lanes):
                        top[v, lane] = lowest
                for step in range(steps(seen)):
                    for p in T.unroll(POSITIONS):  # positions past the pairs converted score garbage; masked
                        offsets[p] = T.min(step * POSITIONS + p, seen_pairs(seen) * 2 - 1)
                    do.zero_scores(acc)
                    for d2 in range(pairs):
                        for p in T.unroll(POSITIONS):
                            for v in T.unroll(vecs):
                                acc[p, v, T.ramp(0, 1, lanes)] = T.call_extern(
                                    f"float32x{lanes}", DOT, acc[p, v, T.ramp(0, 1, lanes)],
                                    qp[d2, T.ramp(v * lanes, 1, lanes)], T.broadcast(kp[offsets[p], d2], lanes))
                    do.keep_scores(acc, s, top, step, first)
                for v in T.unroll(vecs):
                    for lane in T.vectorized(lanes):
                        total[v, lane] = T.float32(0)
                    for j2 in range(seen_pairs(seen)):  # rounded probabilities, a pair a word; their sum
                        for lane in T.vectorized(lanes):
                            pp[j2, v * lanes + lane] = bf16_pair(_probability(s, top, first, 2 * j2, v, lane),
                                                                 _probability(s, top, first, 2 * j2 + 1, v, lane))
                            total[v, lane] = total[v, lane] + widened(pp[j2, v * lanes + lane]) + widened(
                                T.shift_right(pp[j2, v * lanes + lane], T.uint32(16)))
                for c0 in range(dim // lanes // out_vecs):  # a pass per out_vecs vectors of the head dimension
                    for r, c in T.grid(block, out_vecs):
                        for lane in T.vectorized(lanes):
                            o[r, c, lane] = T.float32(0)
                    for jb in range((seen_pairs(seen) + WEIGHTED_PAIRS - 1) // WEIGHTED_PAIRS):
                        for r2 in range(block // out_rows):  # the pass's values stay in L1 while every row sums them
                            do.load_sums(out_acc, o, r2)
                            for j2 in range(T.min(seen_pairs(seen) - jb * WEIGHTED_PAIRS, WEIGHTED_PAIRS)):
                                for r in T.unroll(out_rows):
                                    for c in T.unroll(out_vecs):
                                        out_acc[r, c, T.ramp(0, 1, lanes)] = T.call_extern(
                                            f"float32x{lanes}", DOT, out_acc[r, c, T.ramp(0, 1, lanes)],
                                            vp[jb * WEIGHTED_PAIRS + j2, T.ramp((c0 * out_vecs + c) * lanes, 1, lanes)],
                                            T.broadcast(pp[jb * WEIGHTED_PAIRS + j2, r2 * out_rows + r], lanes))
                            do.keep_sums(out_acc, o, r2)
                    do.divide(out, o, total, r0, h0 + i, c0)

    return heads_block
