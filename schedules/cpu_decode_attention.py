"""One decode row's paged attention on a CPU: its positions split into runs (parts), a task each, every task streaming
its run's keys and values once, BLOCK positions at a time, for every head; then one merge of the parts.

Tasks split positions rather than KV heads: a position's key (value) row holds every KV head, and a core reading
whole rows of consecutive positions streams them faster than two cores each reading its KV head's half of every row
(a sum over the rows of a 4000-position context, Qwen2.5-0.5B's 2 KV heads of 64, from memory on AMD EPYC Zen 4: 33
against 19 GB/s; in a decode step after a 1024-token prompt, attention 1.2-1.7x faster, docs/performance.md). There
are PARTS tasks; TVM hands each thread a run of consecutive ones, so each core streams one run of pages. A context
too short to give each of them MIN_PART positions uses fewer parts, a power of two, held by every PARTS / n-th task
so that every thread still gets its share.

A block's keys are scored `lanes` positions at a time for one head: an accumulator per position with the head
dimension in lanes, whose sums `written.horizontals` turns into one vector of the positions' scores (lanes - 1 adds,
where a horizontal sum per score takes log2(lanes)). The softmax runs online, `lanes` heads to a vector: the block's
maxima update the part's, which rescale the part's sums of e^(score - maximum) and of its weighted values before the
block adds its own. The weighted values are summed over the block's values (in L1) for `head_block` heads and
`pass_vecs` vectors of the head dimension at a time. While a block is scored and summed, every head prefetches its
share of the next block's key and value rows into L2 (a part's first block: at its start). The merge rescales every
part by e^(its maximum - the overall maximum).
"""

from __future__ import annotations

import functools
import operator

from tvm import tirx
from tvm.script import tirx as T

from .vector_math import softmax_exp
from .written import FLOATS_PER_LINE, horizontals, prefetch, register_budget, slot_base

PARTS = 8  # runs of positions of a decode row, a task each: consecutive ones run on the same core
BLOCK = 32  # positions whose keys and values a part scores and sums at a time (in L1)
MIN_PART = 2 * BLOCK  # positions of a part at least, where a context is too short for every part


def decode_attention(func: tirx.PrimFunc, attrs: dict, lanes: int) -> tirx.PrimFunc:
    """The `paged_attention` kernel of a single query row (`func`'s q has one row), in PARTS runs of positions."""
    q_buf, k_buf, _, table_buf = func.params[:4]
    pages, page_size, kv_width = (int(d) for d in k_buf.shape)
    seqs, width = (int(d) for d in table_buf.shape)
    heads, dim, scale = attrs["num_heads"], attrs["head_dim"], float(attrs["scale"])
    kv_heads = attrs["num_kv_heads"]
    group = heads // kv_heads
    chunks, half, page_floats = dim // lanes, lanes // 2, page_size * kv_width
    longest = max(width * page_size // PARTS + 1, 2 * MIN_PART) + BLOCK  # a part's positions at most: a PARTS-th
    # of the history, or under 2 x MIN_PART where fewer parts are used, give or take half a block at either end
    span = (-(-longest // BLOCK) + 1) * BLOCK  # in whole blocks, and the block after them
    budget = register_budget(lanes)
    head_block = max(b for b in range(1, group + 1) if group % b == 0 and b <= budget)
    pass_vecs = max(c for c in range(1, chunks + 1) if chunks % c == 0 and head_block * c <= budget)
    heads_vectors = -(-heads // lanes)  # vectors of heads in the softmax's lanes
    member_rows = -(-BLOCK // group)  # rows of a block whose keys and values each head of a group prefetches
    lowest = T.min_value("float32")
    ramp = T.ramp(0, 1, lanes)

    def used(last):
        """Parts holding positions: the most, a power of two, that leaves each at least MIN_PART of them."""
        n = 1
        for more in (2 ** k for k in range(1, PARTS.bit_length()) if 2 ** k <= PARTS):
            n = T.Select(last + 1 >= more * MIN_PART, more, n)
        return n

    def first(part, n, last):
        """The first position of part `part` of n (last + 1 for part n): the parts split [0, last] evenly, each
        starting at the nearest whole block (so that only the last part ends in a ragged one)."""
        return T.Select(part < n, T.min((part * (last + 1) // n + BLOCK // 2) // BLOCK * BLOCK, last + 1), last + 1)

    def count(task, n, last):
        """Positions of task `task`'s part when n parts are used: every PARTS / n-th task holds one, so that each
        thread's run of tasks holds its share of them; the others none."""
        return T.Select(task % (PARTS // n) == 0, first(task // (PARTS // n) + 1, n, last)
                        - first(task // (PARTS // n), n, last), 0)

    def blocks(n, length):
        """Blocks of `length` covering n."""
        return (n + length - 1) // length

    def lines(floats):
        """Cache lines of `floats` consecutive floats (from a line's start)."""
        return max(1, floats // FLOATS_PER_LINE)

    @T.macro
    def zero(acc):
        for p in T.unroll(half):
            for lane in T.vectorized(lanes):
                acc[p, lane] = T.float32(0)

    @T.macro
    def products(acc, q, keys, rows_at, h, kv, c, at):
        """Head h's products over vector c of the head dimension with the keys of `half` positions from `at`."""
        for p in T.unroll(half):
            for lane in T.vectorized(lanes):
                acc[p, lane] = acc[p, lane] + q[0, h * dim + c * lanes + lane] * keys[rows_at[at + p] + kv
                                                                                      + c * lanes + lane]

    @T.macro
    def scores(q, keys, values, s, rows_at, low, high, b, n):
        """s[h, :] = q_h . k_j * scale for the n positions j of block b (lowest past them); each head prefetches its
        share of the next block's key and value rows."""
        for g, i in T.grid(kv_heads, group):
            for p in range(member_rows):
                for line in T.unroll(lines(dim)):
                    T.evaluate(prefetch(keys[rows_at[T.min((b + 1) * BLOCK + i * member_rows + p,
                                                           (b + 2) * BLOCK - 1)] + g * dim + line * FLOATS_PER_LINE]))
                    T.evaluate(prefetch(values[rows_at[T.min((b + 1) * BLOCK + i * member_rows + p,
                                                             (b + 2) * BLOCK - 1)] + g * dim + line * FLOATS_PER_LINE]))
            for v in range(blocks(n, lanes)):
                zero(low)
                zero(high)
                for c in range(chunks):
                    products(low, q, keys, rows_at, g * group + i, g * dim, c, b * BLOCK + v * lanes)
                    products(high, q, keys, rows_at, g * group + i, g * dim, c, b * BLOCK + v * lanes + half)
                s[g * group + i, T.ramp(v * lanes, 1, lanes)] = T.Select(
                    T.ramp(v * lanes, 1, lanes) < T.Broadcast(n, lanes),
                    horizontals([low[p, ramp] for p in range(half)] + [high[p, ramp] for p in range(half)], lanes)
                    * T.Broadcast(T.float32(scale), lanes), T.Broadcast(lowest, lanes))
        for h, v in T.grid(heads, BLOCK // lanes - blocks(n, lanes)):  # the softmax takes whole blocks
            s[h, T.ramp((blocks(n, lanes) + v) * lanes, 1, lanes)] = T.Broadcast(lowest, lanes)

    def of_heads(s, h0, combine):
        """The vector whose lane k is `combine` over head h0 + k's row of s (a block's), the last head's past
        them."""
        return horizontals([functools.reduce(combine, [s[T.min(h0 + k, heads - 1), T.ramp(v * lanes, 1, lanes)]
                                                       for v in range(BLOCK // lanes)]) for k in range(lanes)],
                           lanes, combine)

    @T.macro
    def softmax(s, new, tops, totals, rescale, task, n):
        """Each head's running maximum (tops) and sum (totals) updated by the block's n scores, `lanes` heads to a
        vector; s becomes e^(score - maximum) (0 past n), rescale the factor that brings the earlier blocks' sums to
        the new maximum."""
        for h0 in range(heads_vectors):
            new[ramp] = T.max(tops[task, T.ramp(h0 * lanes, 1, lanes)], of_heads(s, h0 * lanes, T.max))
            for lane in T.vectorized(lanes):
                rescale[h0 * lanes + lane] = softmax_exp(tops[task, h0 * lanes + lane] - new[lane])
                tops[task, h0 * lanes + lane] = new[lane]
        for h in range(heads):
            for v in T.unroll(BLOCK // lanes):
                for lane in T.vectorized(lanes):
                    s[h, v * lanes + lane] = T.Select(v * lanes + lane < n, softmax_exp(
                        s[h, v * lanes + lane] - tops[task, h]), T.float32(0))
        for h0 in range(heads_vectors):
            totals[task, T.ramp(h0 * lanes, 1, lanes)] = totals[task, T.ramp(h0 * lanes, 1, lanes)] * rescale[
                T.ramp(h0 * lanes, 1, lanes)] + of_heads(s, h0 * lanes, operator.add)

    @T.macro
    def weighted(values, s, rows_at, acc, sums, rescale, task, b, n):
        """sums[task, h, :] = sums * rescale[h] + the sum over block b's n positions j of s[h, j] * v_j."""
        for g, i0, c0 in T.grid(kv_heads, group // head_block, chunks // pass_vecs):
            for i in T.unroll(head_block):
                for c in T.unroll(pass_vecs):
                    for lane in T.vectorized(lanes):
                        acc[i, c, lane] = sums[task, g * group + i0 * head_block + i, (c0 * pass_vecs + c) * lanes
                                               + lane] * rescale[g * group + i0 * head_block + i]
            for j in range(n):
                for i in T.unroll(head_block):
                    for c in T.unroll(pass_vecs):
                        for lane in T.vectorized(lanes):
                            acc[i, c, lane] = acc[i, c, lane] + s[g * group + i0 * head_block + i, j] * values[
                                rows_at[b * BLOCK + j] + g * dim + (c0 * pass_vecs + c) * lanes + lane]
            for i in T.unroll(head_block):
                for c in T.unroll(pass_vecs):
                    for lane in T.vectorized(lanes):
                        sums[task, g * group + i0 * head_block + i, (c0 * pass_vecs + c) * lanes + lane] = acc[
                            i, c, lane]

    @T.macro
    def part(q, keys, values, tops, totals, sums, task, n, last, base):
        """Task `task`'s maximum, sum and weighted values for every head over its part of n (none: a maximum of
        `lowest`, sums of 0), block by block."""
        s = T.alloc_buffer((heads, BLOCK), "float32")  # a block's scores, then e^(score - maximum)
        rows_at = T.alloc_buffer((span,), "int32")  # where each position's key and value rows start
        low = T.alloc_buffer((half, lanes), "float32")  # the partial sums of a score vector's first half of
        high = T.alloc_buffer((half, lanes), "float32")  # positions, and of its second: each under 1 KiB, in
        # unrolled loops: registers
        acc = T.alloc_buffer((head_block, pass_vecs, lanes), "float32")
        new = T.alloc_buffer((lanes,), "float32")
        rescale = T.alloc_buffer((heads_vectors * lanes,), "float32")
        span_of = T.alloc_buffer((2,), "int32")
        for lane in T.vectorized(heads_vectors * lanes):
            tops[task, lane] = lowest
            totals[task, lane] = T.float32(0)
        for h in range(heads):
            for c in range(chunks):
                for lane in T.vectorized(lanes):
                    sums[task, h, c * lanes + lane] = T.float32(0)
        span_of[0] = first(task // (PARTS // n), n, last)  # the part's first position and its length, computed once
        span_of[1] = count(task, n, last)
        if span_of[1] > 0:
            for p in range((blocks(span_of[1], BLOCK) + 1) * BLOCK):  # the block after the part's too
                rows_at[p] = base(T.min(span_of[0] + p, last))
            for p in range(BLOCK):  # the first block's rows, whole, while nothing else is in flight
                for line in T.unroll(lines(kv_width)):
                    T.evaluate(prefetch(keys[rows_at[p] + line * FLOATS_PER_LINE]))
                    T.evaluate(prefetch(values[rows_at[p] + line * FLOATS_PER_LINE]))
            for b in range(blocks(span_of[1], BLOCK)):
                scores(q, keys, values, s, rows_at, low, high, b, T.min(span_of[1] - b * BLOCK, BLOCK))
                softmax(s, new, tops, totals, rescale, task, T.min(span_of[1] - b * BLOCK, BLOCK))
                weighted(values, s, rows_at, acc, sums, rescale, task, b, T.min(span_of[1] - b * BLOCK, BLOCK))

    @T.prim_func(check_well_formed=False)
    def attention(q: T.Buffer((1, heads * dim), "float32"), kp: T.Buffer((pages, page_size, kv_width), "float32"),
                  vp: T.Buffer((pages, page_size, kv_width), "float32"), table: T.Buffer((seqs, width), "int32"),
                  row_of: T.Buffer((1,), "int32"), pos_of: T.Buffer((1,), "int32"),
                  out: T.Buffer((1, heads * dim), "float32")):
        keys = T.decl_buffer((pages * page_floats,), "float32", data=kp.data)
        values = T.decl_buffer((pages * page_floats,), "float32", data=vp.data)
        tops = T.alloc_buffer((PARTS, heads_vectors * lanes), "float32")  # each part's maximum score of each head
        totals = T.alloc_buffer((PARTS, heads_vectors * lanes), "float32")  # and its sum of e^(score - maximum)
        sums = T.alloc_buffer((PARTS, heads, dim), "float32")  # and its sum of e^(score - maximum) x value
        parts = T.alloc_buffer((1,), "int32")
        parts[0] = used(pos_of[0])
        for task in T.parallel(PARTS):
            part(q, keys, values, tops, totals, sums, task, parts[0], pos_of[0],
                 slot_base(table, row_of[0], page_size, kv_width))
        for h in range(heads):  # the merge: each part's share scaled by e^(its maximum - the maximum)
            top = T.alloc_buffer((1,), "float32")
            total = T.alloc_buffer((1,), "float32")
            weight = T.alloc_buffer((PARTS,), "float32")
            top[0] = lowest
            for p in range(PARTS):
                top[0] = T.max(top[0], tops[p, h])
            total[0] = T.float32(0)
            for p in T.vectorized(PARTS):
                weight[p] = softmax_exp(tops[p, h] - top[0])
            for p in range(PARTS):
                total[0] = total[0] + weight[p] * totals[p, h]
            for c in range(chunks):
                for lane in T.vectorized(lanes):
                    out[0, h * dim + c * lanes + lane] = T.float32(0)
                for p in range(PARTS):
                    for lane in T.vectorized(lanes):
                        out[0, h * dim + c * lanes + lane] = out[0, h * dim + c * lanes + lane] + weight[p] * sums[
                            p, h, c * lanes + lane]
                for lane in T.vectorized(lanes):
                    out[0, h * dim + c * lanes + lane] = out[0, h * dim + c * lanes + lane] / total[0]

    return attention
