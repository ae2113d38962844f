"""Prefill attention's two products on AMX tiles, in a `--matmul-precision bfloat16` build on a CPU with AMX: a
block of 32 query rows of one sequence, for the heads that share one KV head.

Numerics, as torch's bf16 attention and llama.cpp's F16 flash attention round their operands: q (scaled), keys,
the softmax's probabilities and values are rounded to bfloat16; scores, the softmax and the sums stay float32, and
each row is divided by the sum of its rounded probabilities (so its weights sum to one).

Scores S[row, position] = q . k: A is the block's q rows (bfloat16, row-major), B the keys in pairs of head
dimensions, transposed (kt[position / 16, dim / 2, 16]: each 16 x 16 block of pairs turned in registers as the keys
are rounded, once per task for all its heads). Weighted sums O[row, dim] = P @ V: A is the probabilities (bfloat16,
row-major), B the values in pairs of consecutive positions (vp[position / 2, dim]). Both products keep 2 x 2
accumulator tiles (two of rows, two of positions or of head dimensions), as `amx_gemm` does.
"""

from __future__ import annotations

import operator

from tvm.script import tirx as T

from .amx import DEPTH, TILE, store, tile_config, two_by_two, zero_accumulators
from .vector_math import softmax_exp
from .written import bf16_bits, bf16_pair, horizontal, transpose, widened

ROWS = 2 * TILE  # query rows per block: two A tiles
STEP = 2 * TILE  # positions per step of the scores: two B tiles (and one A tile's depth in the weighted sum)


def _steps(seen):
    """Steps of STEP positions that cover `seen` positions."""
    return (seen + STEP - 1) // STEP


def fits(dim: int, block: int) -> bool:
    """Whether a block of `block` rows with head dimension `dim` runs on tiles: whole depths, two row tiles."""
    return dim % DEPTH == 0 and block == ROWS


@T.macro
def _store_accumulators(c, column):
    """Accumulators 4..7 into c[:2 TILE, column:column + 2 TILE] (float32): [row tile, column tile]."""
    store(4, T.address_of(c[0, column]), c.shape[1] * 4)
    store(5, T.address_of(c[0, column + TILE]), c.shape[1] * 4)
    store(6, T.address_of(c[TILE, column]), c.shape[1] * 4)
    store(7, T.address_of(c[TILE, column + TILE]), c.shape[1] * 4)


def amx_block_macro(shape):
    """The macro computing a block of ROWS rows of one sequence for `shape.head_block` heads sharing one KV head:
    row r0 + r of q sees positions [0, min(first + r, seen - 1)]; `base(j)` is the flat offset of position j's
    key/value row."""
    dim, heads, scale, lanes = shape.dim, shape.head_block, shape.scale, TILE
    span = (shape.history + STEP - 1) // STEP * STEP
    pitch = span + STEP  # a row of scores: not a multiple of 4 KiB, so that a tile's rows fall in different L1 sets
    lowest = T.min_value("float32")

    @T.macro
    def heads_block(q, out, keys, values, h0, kv, r0, first, seen, base):
        cfg = T.alloc_buffer((64,), "uint8")  # on the stack
        kb = T.alloc_buffer((span, dim), "uint16")  # keys rounded, row-major
        kb_pairs = T.decl_buffer((span, dim // 2), "uint32", data=kb.data)
        kt = T.alloc_buffer((span // TILE, dim // 2, TILE), "uint32")  # B of the scores: pairs of dimensions,
        # transposed, a block per 16 positions
        vp = T.alloc_buffer((span // 2, dim), "uint32")  # B of the weighted sums: pairs of positions
        qb = T.alloc_buffer((ROWS, dim), "uint16")  # A of the scores: q rows, scaled, rounded
        s = T.alloc_buffer((ROWS, pitch), "float32")  # scores
        pb = T.alloc_buffer((ROWS, pitch), "uint16")  # A of the weighted sums: probabilities, rounded
        o = T.alloc_buffer((ROWS, dim), "float32")
        total = T.alloc_buffer((ROWS,), "float32")
        best = T.alloc_buffer((lanes,), "float32")
        sums = T.alloc_buffer((lanes,), "float32")
        top = T.alloc_buffer((1,), "float32")
        t0 = T.alloc_buffer((TILE, TILE), "float32")  # a block of key pairs being transposed: in registers
        t1 = T.alloc_buffer((TILE, TILE), "float32")
        tile_config(cfg, DEPTH)
        for j, c in T.grid(_steps(seen) * STEP, dim // lanes):  # positions past the last seen one
            for lane in T.vectorized(lanes):  # read it again: their probabilities are 0
                kb[j, c * lanes + lane] = bf16_bits(keys[base(T.min(j, seen - 1)) + kv + c * lanes + lane])
        for j2, c in T.grid(_steps(seen) * TILE, dim // lanes):
            for lane in T.vectorized(lanes):
                vp[j2, c * lanes + lane] = bf16_pair(
                    bf16_bits(values[base(T.min(2 * j2, seen - 1)) + kv + c * lanes + lane]),
                    bf16_bits(values[base(T.min(2 * j2 + 1, seen - 1)) + kv + c * lanes + lane]))
        for g, c in T.grid(_steps(seen) * 2, dim // DEPTH):  # 16 positions x 16 pairs at a time
            for p in T.unroll(TILE):
                t0[p, T.ramp(0, 1, TILE)] = T.reinterpret(f"float32x{TILE}",
                                                          kb_pairs[g * TILE + p, T.ramp(c * TILE, 1, TILE)])
            transpose(t0, t1)
            for i in T.unroll(TILE):
                kt[g, c * TILE + i, T.ramp(0, 1, TILE)] = T.reinterpret(f"uint32x{TILE}", t0[i, T.ramp(0, 1, TILE)])
        for i in range(heads):
            for r, c in T.grid(ROWS, dim // lanes):
                for lane in T.vectorized(lanes):
                    qb[r, c * lanes + lane] = bf16_bits(q[r0 + r, (h0 + i) * dim + c * lanes + lane] * T.float32(scale))
            for step in range(_steps(seen)):
                zero_accumulators()
                for c in range(dim // DEPTH):
                    two_by_two(T.address_of(qb[0, c * DEPTH]), T.address_of(qb[TILE, c * DEPTH]), dim * 2,
                               T.address_of(kt[2 * step, c * TILE, 0]), T.address_of(kt[2 * step + 1, c * TILE, 0]),
                               TILE * 4)
                _store_accumulators(s, step * STEP)
            for r in range(ROWS):  # the softmax of row r over its visible positions
                for lane in T.vectorized(lanes):
                    best[lane] = lowest
                    sums[lane] = T.float32(0)
                for jv in range(_steps(seen) * 2):
                    for lane in T.vectorized(lanes):
                        best[lane] = T.max(best[lane], T.Select(jv * lanes + lane <= T.min(first + r, seen - 1),
                                                                s[r, jv * lanes + lane], lowest))
                top[0] = horizontal(best[T.ramp(0, 1, lanes)], lanes, T.max)
                for jv in range(_steps(seen) * 2):
                    for lane in T.vectorized(lanes):
                        pb[r, jv * lanes + lane] = bf16_bits(T.Select(
                            jv * lanes + lane <= T.min(first + r, seen - 1),
                            softmax_exp(s[r, jv * lanes + lane] - top[0]), T.float32(0)))
                        sums[lane] = sums[lane] + widened(pb[r, jv * lanes + lane])
                total[r] = horizontal(sums[T.ramp(0, 1, lanes)], lanes, operator.add)
            for c in range(dim // STEP):  # a pass per 32 head dimensions: 2 x 2 tiles of [row, dimension]
                zero_accumulators()
                for step in range(_steps(seen)):
                    two_by_two(T.address_of(pb[0, step * STEP]), T.address_of(pb[TILE, step * STEP]), pitch * 2,
                               T.address_of(vp[step * TILE, c * STEP]), T.address_of(vp[step * TILE, c * STEP + TILE]),
                               dim * 4)
                _store_accumulators(o, c * STEP)
            for r, c in T.grid(ROWS, dim // lanes):
                for lane in T.vectorized(lanes):
                    out[r0 + r, (h0 + i) * dim + c * lanes + lane] = o[r, c * lanes + lane] / total[r]
        T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))

    return heads_block
