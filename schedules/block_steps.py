"""The steps that the float32 block attention kernel (`schedules.cpu_attention`) and its AVX512-BF16 dot-product form
(`schedules.avx512_bf16_attention`) share: scores of POSITIONS positions a step with the block's rows in the lanes,
each row's running maximum over the positions it sees, weighted sums carried between passes in a buffer of the whole
block, and the division by each row's sum."""

from __future__ import annotations

from types import SimpleNamespace

from tvm.script import tirx as T

POSITIONS = 7  # positions scored per step, each with its own accumulators (7 x 2 row vectors)


def steps(seen):
    """Steps of POSITIONS positions that cover `seen` positions."""
    return (seen + POSITIONS - 1) // POSITIONS


def block_steps(shape) -> SimpleNamespace:
    """The shared macros for blocks of `shape` (`schedules.cpu_attention._Shape`). Every loop that indexes an
    accumulator tile is unrolled (so the tile stays in registers)."""
    lanes, vecs, out_rows, out_vecs, dim = shape.lanes, shape.vecs, shape.out_rows, shape.out_vecs, shape.dim
    lowest = T.min_value("float32")

    @T.macro
    def zero_scores(acc):
        """acc[POSITIONS, vecs, lanes] = 0."""
        for p in T.unroll(POSITIONS):
            for v in T.unroll(vecs):
                for lane in T.vectorized(lanes):
                    acc[p, v, lane] = T.float32(0)

    @T.macro
    def keep_scores(acc, s, top, step, first):
        """A step's scores into s, and each row's maximum over the positions it sees (row r: up to first + r)."""
        for p in T.unroll(POSITIONS):
            for v in T.unroll(vecs):
                for lane in T.vectorized(lanes):
                    s[step * POSITIONS + p, v * lanes + lane] = acc[p, v, lane]
                    top[v, lane] = T.max(top[v, lane], T.Select(step * POSITIONS + p <= first + v * lanes + lane,
                                                                acc[p, v, lane], lowest))

    @T.macro
    def load_sums(out_acc, o, r2):
        """The weighted sums of rows [r2 * out_rows, (r2 + 1) * out_rows) into the accumulator tile."""
        for r in T.unroll(out_rows):
            for c in T.unroll(out_vecs):
                for lane in T.vectorized(lanes):
                    out_acc[r, c, lane] = o[r2 * out_rows + r, c, lane]

    @T.macro
    def keep_sums(out_acc, o, r2):
        """The accumulator tile back into the block's weighted sums."""
        for r in T.unroll(out_rows):
            for c in T.unroll(out_vecs):
                for lane in T.vectorized(lanes):
                    o[r2 * out_rows + r, c, lane] = out_acc[r, c, lane]

    @T.macro
    def divide(out, o, total, r0, h, c0):
        """out's head h, head-dimension vectors [c0 * out_vecs, (c0 + 1) * out_vecs): the weighted sums of pass c0
        divided by each row's sum of weights."""
        for r, c in T.grid(o.shape[0], out_vecs):
            for lane in T.vectorized(lanes):
                out[r0 + r, h * dim + (c0 * out_vecs + c) * lanes + lane] = o[r, c, lane] / total[r // lanes,
                                                                                                  r % lanes]

    return SimpleNamespace(zero_scores=zero_scores, keep_scores=keep_scores, load_sums=load_sums,
                           keep_sums=keep_sums, divide=divide)
