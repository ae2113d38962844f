"""Prefill attention on a CPU as two register-blocked matrix products per head and block of query rows.

The compute definition (`compiler.kernels.attention`) scores one query row against one position at a time,
a dot product that ends in a horizontal sum; here a task (one head, `lanes` or 2 x `lanes` query rows)
instead computes S[position, row] = k . q with the rows in SIMD lanes (q transposed once, each key element
broadcast), so every step is a vector FMA; the softmax runs over positions with the rows still in lanes, and
O[row, :] = sum over positions of p * v with the head dimension in lanes. Positions after the block's last
visible one are skipped (causal), and unwritten cache rows are never read into a sum.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

# Accumulator tiles are plain (global-scope) buffers under 1 KiB: TVM puts those on the stack, where LLVM keeps them
# in registers; larger ones, and any in "local" scope, become heap workspace that every FMA reads and writes.
POSITIONS = 7  # positions scored per step, each with its own accumulators (7 x 2 row vectors)
OUT_ROWS = 2  # query rows summed per step of the weighted sum, times up to 4 vectors of the head dimension


def prefill_attention(func: tirx.PrimFunc, attrs: dict, lanes: int) -> tirx.PrimFunc | None:
    """The `attention` op's kernel (contiguous KV cache) for prefill chunks, or None for shapes it does not
    cover (rows or head_dim not whole SIMD vectors, or a single row: decode)."""
    q_buf, k_buf = func.params[0], func.params[1]
    rows, ctx, kv_width = int(q_buf.shape[0]), int(k_buf.shape[0]), int(k_buf.shape[1])
    heads, dim, scale = attrs["num_heads"], attrs["head_dim"], float(attrs["scale"])
    group = heads // attrs["num_kv_heads"]
    if rows % lanes or dim % lanes or rows == 1:
        return None
    vecs = 2 if rows % (2 * lanes) == 0 else 1  # row vectors per task
    out_vecs = next(c for c in (4, 3, 2, 1) if dim // lanes % c == 0)  # head-dimension vectors per output tile
    block = vecs * lanes
    blocks = rows // block
    span = (ctx + POSITIONS - 1) // POSITIONS * POSITIONS

    @T.prim_func(check_well_formed=False)
    def attention(q: T.Buffer((rows, heads * dim), "float32"), kc: T.Buffer((ctx, kv_width), "float32"),
                  vc: T.Buffer((ctx, kv_width), "float32"), pos: T.int32, n: T.int32,
                  out: T.Buffer((rows, heads * dim), "float32")):
        for task in T.parallel(heads * blocks):
            h = task // blocks
            r0 = task % blocks * block
            kv = h // group * dim
            seen = T.min(pos + n, pos + r0 + block)  # positions any row of this block sees: [0, seen)
            steps = (seen + POSITIONS - 1) // POSITIONS
            qt = T.alloc_buffer((dim, block), "float32")  # q of the block's rows, transposed, scaled
            s = T.alloc_buffer((span, block), "float32")  # scores, then probabilities
            acc = T.alloc_buffer((POSITIONS, vecs, lanes), "float32")
            top = T.alloc_buffer((vecs, lanes), "float32")
            total = T.alloc_buffer((vecs, lanes), "float32")
            out_acc = T.alloc_buffer((OUT_ROWS, out_vecs, lanes), "float32")
            for r, d in T.grid(block, dim):
                qt[d, r] = q[r0 + r, h * dim + d] * T.float32(scale)
            for step in range(steps):
                for p in T.unroll(POSITIONS):  # every loop that indexes an accumulator tile is unrolled
                    for v in T.unroll(vecs):
                        for lane in T.vectorized(lanes):
                            acc[p, v, lane] = T.float32(0)
                for d in range(dim):
                    for p in T.unroll(POSITIONS):
                        for v in T.unroll(vecs):
                            for lane in T.vectorized(lanes):  # rows past the cache's end read its last row
                                acc[p, v, lane] = acc[p, v, lane] + qt[d, v * lanes + lane] * kc[
                                    T.min(step * POSITIONS + p, ctx - 1), kv + d]
                for p in T.unroll(POSITIONS):
                    for v in T.unroll(vecs):
                        for lane in T.vectorized(lanes):
                            s[step * POSITIONS + p, v * lanes + lane] = acc[p, v, lane]
            for v in T.unroll(vecs):
                for lane in T.vectorized(lanes):
                    top[v, lane] = T.min_value("float32")
                    total[v, lane] = T.float32(0)
                for j in range(steps * POSITIONS):
                    for lane in T.vectorized(lanes):
                        top[v, lane] = T.max(top[v, lane], T.Select(
                            j <= T.min(pos + r0 + v * lanes + lane, pos + n - 1), s[j, v * lanes + lane],
                            T.min_value("float32")))
                for j in range(steps * POSITIONS):
                    for lane in T.vectorized(lanes):
                        s[j, v * lanes + lane] = T.Select(j <= T.min(pos + r0 + v * lanes + lane, pos + n - 1),
                                                          T.exp(s[j, v * lanes + lane] - top[v, lane]), T.float32(0))
                        total[v, lane] = total[v, lane] + s[j, v * lanes + lane]
            for r2, c0 in T.grid(block // OUT_ROWS, dim // lanes // out_vecs):
                for r in T.unroll(OUT_ROWS):
                    for c in T.unroll(out_vecs):
                        for lane in T.vectorized(lanes):
                            out_acc[r, c, lane] = T.float32(0)
                for j in range(seen):  # written cache rows only: unwritten ones may hold NaN
                    for r in T.unroll(OUT_ROWS):
                        for c in T.unroll(out_vecs):
                            for lane in T.vectorized(lanes):
                                out_acc[r, c, lane] = out_acc[r, c, lane] + s[j, r2 * OUT_ROWS + r] * vc[
                                    j, kv + (c0 * out_vecs + c) * lanes + lane]
                for r in T.unroll(OUT_ROWS):
                    for c in T.unroll(out_vecs):
                        for lane in T.vectorized(lanes):
                            out[r0 + r2 * OUT_ROWS + r, h * dim + (c0 * out_vecs + c) * lanes + lane] = out_acc[
                                r, c, lane] / total[(r2 * OUT_ROWS + r) // lanes, (r2 * OUT_ROWS + r) % lanes]

    return attention
