"""Paged attention on a CPU: blocks of query rows of one sequence as two register-blocked matrix products per
head, and single rows of a kernel of several (decodes of different sequences, a chunk's ragged end) as dot products
over the head dimension for a block of heads that share a KV head (`_row_macro`); a kernel of one row (one
sequence's decode step) is `schedules.cpu_decode_attention`'s. A task is a block of rows for a block of heads
sharing a KV head: its keys and values are read once for all of them (GQA; decode of a 1024-position context,
Intel Xeon with AMX: attention's time in a step 0.57-0.77x, with prefetches of the positions AHEAD, which the
256-byte rows of a KV head, a page row apart, leave to the hardware prefetcher otherwise).

The compute definition (`compiler.kernels.paged_attention`) scores one query row against one
position at a time, a dot product that ends in a horizontal sum. For a block of `lanes` or 2 x `lanes`
consecutive rows of one sequence, a task (one head, one block) instead computes S[position, row] = k . q with
the rows in SIMD lanes (q transposed once, each key element broadcast), so every step is a vector FMA, and keeps
each row's running maximum as it goes; the softmax runs over positions with the rows still in lanes, and O[row, :]
= sum over positions of p * v with the head dimension in lanes, in passes of WEIGHTED_POSITIONS positions whose
values stay in L1 while every row of the block sums them (a 256-row chunk at 1024 positions, Qwen2.5-0.5B heads,
Intel Xeon with AMX, alternating: 13.4 -> 10.5 ms; Qwen3.5's 256-wide heads 33.6 -> 22.1 ms). Positions after the
block's last visible one are skipped (causal), and unwritten cache rows are never read into a sum. Keys and values
are found through a base offset per position: a slot of a page that the sequence's block table names.
"""

from __future__ import annotations

import operator

from tvm import tirx
from tvm.script import tirx as T

from . import amx_attention, avx512_bf16_attention
from .block_steps import POSITIONS, block_steps, steps
from .cpu_decode_attention import decode_attention
from .vector_math import softmax_exp
from .written import FLOATS_PER_LINE, horizontal, prefetch, register_budget, slot_base

# Scalars are written inline, never bound by assignment: TVM 0.27 makes such a name a one-element heap buffer that
# every use stores and reloads.
# Accumulator tiles are plain (global-scope) buffers under 1 KiB: TVM puts those on the stack, where LLVM keeps them
# in registers; larger ones, and any in "local" scope, become heap workspace that every FMA reads and writes.
WEIGHTED_POSITIONS = 32  # positions whose values a block's rows sum in one pass: the values stay in L1
ROW_POSITIONS = 8  # positions a single row scores per step at most, each with its own accumulators
AHEAD = 16  # positions ahead whose keys (values) a single row asks for while it scores (sums) one
WEIGHTED_SETS = 2  # independent sums of a single row's weighted values, for short head dimensions


class _Shape:
    """The sizes one attention kernel is specialised for."""

    def __init__(self, q_buf, history: int, attrs: dict, lanes: int):
        self.rows, self.history, self.lanes = int(q_buf.shape[0]), history, lanes
        self.heads, self.dim, self.scale = attrs["num_heads"], attrs["head_dim"], float(attrs["scale"])
        self.group = self.heads // attrs["num_kv_heads"]
        self.vecs = 2 if self.rows % (2 * lanes) == 0 else 1  # row vectors per block
        self.block = self.vecs * lanes
        self.out_vecs = next(c for c in (4, 3, 2, 1) if self.dim // lanes % c == 0)  # head-dim vectors per out tile
        self.out_rows = 4 if lanes >= 16 else 2  # query rows per step of the weighted sum: out_rows x out_vecs sums,
        # half of AVX-512's 32 registers or of AVX2's 16
        self.span = (history + POSITIONS - 1) // POSITIONS * POSITIONS
        self.budget = register_budget(lanes)  # a single row's accumulators (under 1 KiB)
        self.head_block = max(b for b in range(1, self.group + 1) if self.group % b == 0 and b <= self.budget)

    @property
    def blocked(self) -> bool:
        """Whether blocks of rows fit: rows and head_dim whole SIMD vectors, more than one row."""
        return self.rows % self.lanes == 0 and self.dim % self.lanes == 0 and self.rows > 1


def _block_macro(shape: _Shape):
    """The macro computing one head of one block of rows: row r0 + r of q sees positions [0, min(first + r,
    seen - 1)]; `base(j)` is the flat offset of position j's key/value row."""
    lanes, vecs, block, dim, span = shape.lanes, shape.vecs, shape.block, shape.dim, shape.span
    out_rows, out_vecs = shape.out_rows, shape.out_vecs
    scale, do = shape.scale, block_steps(shape)

    @T.macro
    def rows_block(q, out, keys, values, h, kv, r0, first, seen, base):
        qt = T.alloc_buffer((dim, block), "float32")  # q of the block's rows, transposed, scaled
        s = T.alloc_buffer((span, block), "float32")  # scores, then probabilities
        offsets = T.alloc_buffer((POSITIONS,), "int32")
        acc = T.alloc_buffer((POSITIONS, vecs, lanes), "float32")
        top = T.alloc_buffer((vecs, lanes), "float32")
        total = T.alloc_buffer((vecs, lanes), "float32")
        out_acc = T.alloc_buffer((out_rows, out_vecs, lanes), "float32")
        o = T.alloc_buffer((block, out_vecs, lanes), "float32")  # the block's weighted sums of one pass
        rows_at = T.alloc_buffer((WEIGHTED_POSITIONS,), "int32")  # where the values of a pass's positions start
        for r, d in T.grid(block, dim):
            qt[d, r] = q[r0 + r, h * dim + d] * T.float32(scale)
        for v in T.unroll(vecs):
            for lane in T.vectorized(lanes):
                top[v, lane] = T.min_value("float32")
        for step in range(steps(seen)):
            for p in T.unroll(POSITIONS):  # positions past the last seen one read it again; the mask drops them
                offsets[p] = base(T.min(step * POSITIONS + p, seen - 1)) + kv
            do.zero_scores(acc)
            for d in range(dim):
                for p in T.unroll(POSITIONS):
                    for v in T.unroll(vecs):
                        for lane in T.vectorized(lanes):
                            acc[p, v, lane] = acc[p, v, lane] + qt[d, v * lanes + lane] * keys[offsets[p] + d]
            do.keep_scores(acc, s, top, step, first)
        for v in T.unroll(vecs):
            for lane in T.vectorized(lanes):
                total[v, lane] = T.float32(0)
            for j in range(steps(seen) * POSITIONS):
                for lane in T.vectorized(lanes):
                    s[j, v * lanes + lane] = T.Select(j <= T.min(first + v * lanes + lane, seen - 1),
                                                      softmax_exp(s[j, v * lanes + lane] - top[v, lane]), T.float32(0))
                    total[v, lane] = total[v, lane] + s[j, v * lanes + lane]
        for c0 in range(dim // lanes // out_vecs):  # a pass per out_vecs vectors of the head dimension
            for r, c in T.grid(block, out_vecs):
                for lane in T.vectorized(lanes):
                    o[r, c, lane] = T.float32(0)
            for jb in range((seen + WEIGHTED_POSITIONS - 1) // WEIGHTED_POSITIONS):  # their values stay in L1
                for j in range(WEIGHTED_POSITIONS):
                    rows_at[j] = base(T.min(jb * WEIGHTED_POSITIONS + j, seen - 1)) + kv + c0 * out_vecs * lanes
                for r2 in range(block // out_rows):
                    do.load_sums(out_acc, o, r2)
                    for j in range(T.min(seen - jb * WEIGHTED_POSITIONS, WEIGHTED_POSITIONS)):  # written rows only:
                        for r in T.unroll(out_rows):  # unwritten ones may hold NaN
                            for c in T.unroll(out_vecs):
                                for lane in T.vectorized(lanes):
                                    out_acc[r, c, lane] = out_acc[r, c, lane] + s[
                                        jb * WEIGHTED_POSITIONS + j, r2 * out_rows + r] * values[
                                        rows_at[j] + c * lanes + lane]
                    do.keep_sums(out_acc, o, r2)
            do.divide(out, o, total, r0, h, c0)

    return rows_block


def _row_macro(shape: _Shape):
    """The macro computing one query row t, seeing positions [0, last], for `head_block` heads that share one KV
    head: their scores as dot products of `positions` positions at a time, each (head, position) with its own
    accumulators (the head dimension in lanes, each sum of lanes a tree of halves), so a key serves every head of
    the block; the softmax of each head over vectors of positions; then the weighted sum, a pass over the values
    for every `pass_vecs` vectors of the head dimension, with `sets` independent sums (one chain of FMAs waits on
    each one's latency). Positions past `last` read position `last` again; the mask drops them."""
    lanes, dim, scale, heads, budget = shape.lanes, shape.dim, shape.scale, shape.head_block, shape.budget
    chunks = dim // lanes
    span = (shape.history // lanes + 1) * lanes  # whole vectors of positions, one more for the weighted sum's sets
    positions = max(p for p in (1, 2, 4, 8) if p <= ROW_POSITIONS and lanes % p == 0 and heads * p <= budget)
    pass_vecs = max(c for c in range(1, chunks + 1) if chunks % c == 0 and heads * c <= budget)
    sets = WEIGHTED_SETS if heads * pass_vecs < 8 and WEIGHTED_SETS * heads * pass_vecs <= budget else 1
    lowest = T.min_value("float32")

    @T.macro
    def rows(q, out, keys, values, h0, kv, t, last, base):
        s = T.alloc_buffer((heads, span), "float32")
        qs = T.alloc_buffer((heads, chunks, lanes), "float32")
        acc = T.alloc_buffer((heads, positions, lanes), "float32")  # under 1 KiB, in unrolled loops: registers
        offsets = T.alloc_buffer((positions,), "int32")
        best = T.alloc_buffer((lanes,), "float32")
        sums = T.alloc_buffer((lanes,), "float32")
        out_acc = T.alloc_buffer((sets, heads, pass_vecs, lanes), "float32")
        top = T.alloc_buffer((1,), "float32")
        total = T.alloc_buffer((heads,), "float32")
        for i, c in T.grid(heads, chunks):
            for lane in T.vectorized(lanes):
                qs[i, c, lane] = q[t, (h0 + i) * dim + c * lanes + lane] * T.float32(scale)
        for step in range((last + lanes) // lanes * (lanes // positions)):
            for p in T.unroll(positions):
                offsets[p] = base(T.min(step * positions + p, last)) + kv
                for line in T.unroll(-(-dim // FLOATS_PER_LINE)):
                    T.evaluate(prefetch(keys[base(T.min(step * positions + p + AHEAD, last)) + kv
                                             + line * FLOATS_PER_LINE], into_l1=True))
            for i in T.unroll(heads):
                for p in T.unroll(positions):
                    for lane in T.vectorized(lanes):
                        acc[i, p, lane] = T.float32(0)
            for c in range(chunks):
                for i in T.unroll(heads):
                    for p in T.unroll(positions):
                        for lane in T.vectorized(lanes):
                            acc[i, p, lane] = acc[i, p, lane] + qs[i, c, lane] * keys[offsets[p] + c * lanes + lane]
            for i in T.unroll(heads):
                for p in T.unroll(positions):
                    s[i, step * positions + p] = T.Select(step * positions + p <= last, horizontal(
                        acc[i, p, T.ramp(0, 1, lanes)], lanes, operator.add), lowest)
        for i in range(heads):
            for lane in T.vectorized(lanes):
                best[lane] = lowest
                sums[lane] = T.float32(0)
            for j in range((last + lanes) // lanes):
                for lane in T.vectorized(lanes):
                    best[lane] = T.max(best[lane], s[i, j * lanes + lane])
            top[0] = horizontal(best[T.ramp(0, 1, lanes)], lanes, T.max)
            for j in range((last + lanes) // lanes):
                for lane in T.vectorized(lanes):
                    s[i, j * lanes + lane] = softmax_exp(s[i, j * lanes + lane] - top[0])  # masked: e^-87, lost
                    sums[lane] = sums[lane] + s[i, j * lanes + lane]
            total[i] = horizontal(sums[T.ramp(0, 1, lanes)], lanes, operator.add)
        for c0 in range(chunks // pass_vecs):
            for e, i, c in T.grid(sets, heads, pass_vecs):
                for lane in T.vectorized(lanes):
                    out_acc[e, i, c, lane] = T.float32(0)
            for j in range((last + sets) // sets):
                for e in T.unroll(sets):
                    for line in T.unroll(-(-pass_vecs * lanes // FLOATS_PER_LINE)):
                        T.evaluate(prefetch(values[base(T.min(j * sets + e + AHEAD, last)) + kv
                                                   + c0 * pass_vecs * lanes + line * FLOATS_PER_LINE], into_l1=True))
                    for i in T.unroll(heads):
                        for c in T.unroll(pass_vecs):
                            for lane in T.vectorized(lanes):
                                out_acc[e, i, c, lane] = out_acc[e, i, c, lane] + T.Select(
                                    j * sets + e <= last, s[i, j * sets + e], T.float32(0)) * values[
                                    base(T.min(j * sets + e, last)) + kv + (c0 * pass_vecs + c) * lanes + lane]
            for i, c in T.grid(heads, pass_vecs):
                for e in range(1, sets):
                    for lane in T.vectorized(lanes):
                        out_acc[0, i, c, lane] = out_acc[0, i, c, lane] + out_acc[e, i, c, lane]
                for lane in T.vectorized(lanes):
                    out[t, (h0 + i) * dim + (c0 * pass_vecs + c) * lanes + lane] = out_acc[0, i, c, lane] / total[i]

    return rows


def _bf16_block_macro(shape: _Shape, bf16_products: str | None):
    """The macro of a block's heads with bfloat16 products on the path `bf16_products` names (AMX tiles or AVX512-BF16
    dot products) where the block fits it, else None."""
    if bf16_products == "amx" and amx_attention.fits(shape.dim, shape.block):
        return amx_attention.amx_block_macro(shape)
    if bf16_products == "avx512bf16" and avx512_bf16_attention.fits(shape.dim, shape.lanes):
        return avx512_bf16_attention.dpbf16_block_macro(shape)
    return None


def paged_attention(func: tirx.PrimFunc, attrs: dict, lanes: int,
                    bf16_products: str | None = None) -> tirx.PrimFunc | None:
    """The `paged_attention` op's kernel: each block of rows that is a run of consecutive positions of one
    sequence (a prefill chunk) as a block (its products in bfloat16 on the path `bf16_products` names, where the
    block fits it: `schedules.amx_attention`, `schedules.avx512_bf16_attention`), every other row (decodes,
    padding, a chunk's ragged end) on its own; a kernel of one row in parts of its positions
    (`schedules.cpu_decode_attention`); or None when head_dim is not whole SIMD vectors."""
    q_buf, k_buf, _, table_buf = func.params[:4]
    pages, page_size, kv_width = (int(d) for d in k_buf.shape)
    seqs, width = (int(d) for d in table_buf.shape)
    shape = _Shape(q_buf, width * page_size, attrs, lanes)
    if shape.dim % lanes:
        return None
    if shape.rows == 1:
        return decode_attention(func, attrs, lanes)
    rows, heads, dim, group, head_block = shape.rows, shape.heads, shape.dim, shape.group, shape.head_block
    block = shape.block if shape.blocked else rows
    blocks = rows // block
    rows_block, heads_row = _block_macro(shape), _row_macro(shape)
    page_floats = page_size * kv_width

    @T.macro
    def single_rows(q, out, keys, values, table, row_of, pos_of, h0, t0):
        for r in range(block):
            heads_row(q, out, keys, values, h0, h0 // group * dim, t0 + r, pos_of[t0 + r],
                      slot_base(table, row_of[t0 + r], page_size, kv_width))

    @T.macro
    def float_heads(q, out, keys, values, h0, kv, r0, first, seen, base):
        for i in range(head_block):
            rows_block(q, out, keys, values, h0 + i, kv, r0, first, seen, base)

    block_heads = _bf16_block_macro(shape, bf16_products) or float_heads

    @T.macro
    def chunk_or_rows(q, out, keys, values, table, row_of, pos_of, h0, t0):
        if row_of[t0 + block - 1] == row_of[t0] and pos_of[t0 + block - 1] == pos_of[t0] + block - 1:
            block_heads(q, out, keys, values, h0, h0 // group * dim, t0, pos_of[t0], pos_of[t0] + block,
                        slot_base(table, row_of[t0], page_size, kv_width))
        else:
            single_rows(q, out, keys, values, table, row_of, pos_of, h0, t0)

    task_body = chunk_or_rows if shape.blocked else single_rows

    @T.prim_func(check_well_formed=False)
    def attention(q: T.Buffer((rows, heads * dim), "float32"), kp: T.Buffer((pages, page_size, kv_width), "float32"),
                  vp: T.Buffer((pages, page_size, kv_width), "float32"), table: T.Buffer((seqs, width), "int32"),
                  row_of: T.Buffer((rows,), "int32"), pos_of: T.Buffer((rows,), "int32"),
                  out: T.Buffer((rows, heads * dim), "float32")):
        keys = T.decl_buffer((pages * page_floats,), "float32", data=kp.data)
        values = T.decl_buffer((pages * page_floats,), "float32", data=vp.data)
        for task in T.parallel(heads // head_block * blocks):  # a block of rows for a block of heads sharing KV
            task_body(q, out, keys, values, table, row_of, pos_of, task // blocks * head_block, task % blocks * block)

    return attention
