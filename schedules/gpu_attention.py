"""Paged attention on a GPU as one kernel: a thread block per (token row, head), over that row's visible positions.

The compute definition's seven stages (scores, mask, max, exponentials, sum, weighted values, division) span the
whole block table, and scheduled they are five kernels that score every position up to `--max-context`. Written
out, a block reads only positions 0..pos_of[row] of its row's pages, a chunk of THREADS at a time, with an
online softmax: each thread scores one position of the chunk (its key row dotted with the query head in shared
memory), PARTS threads take the maximum of SPAN scores each and one thread the maximum of those (rescaling the
running sum), every thread exponentiates its score, and each thread adds the chunk's weighted values into its
columns of the head's accumulator while PARTS threads sum the exponentials in parts (added in at the next
chunk). The loop runs as many chunks as the row has positions, the same count for all threads of a block, so
the block barriers between the phases are safe. With `emulate` the same loops run on the CPU (thread loops
serial, each phase its own loop nest over the threads, as block barriers separate them): the tests check it
against the unscheduled kernel.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from .written import thread_loop

THREADS = 128  # positions per chunk; a block's threads
PARTS, SPAN = 16, 8  # a chunk's maximum and sum: PARTS threads reduce SPAN values each, then one thread the parts


def paged_attention(func: tirx.PrimFunc, attrs: dict, emulate: bool = False) -> tirx.PrimFunc:
    """The one-kernel form of `paged_attention` kernel `func` (its signature, attributes `attrs`)."""
    q_buf, k_buf, _, table_buf = func.params[:4]
    rows, width = (int(d) for d in q_buf.shape)
    pages, block, kv_width = (int(d) for d in k_buf.shape)
    table_shape = tuple(int(d) for d in table_buf.shape)
    heads, dim, scale = attrs["num_heads"], attrs["head_dim"], float(attrs["scale"])
    group = heads // attrs["num_kv_heads"]
    columns = -(-dim // THREADS)  # accumulator columns per thread
    threads = thread_loop(emulate)

    @T.macro
    def barrier():
        """Between phases (emulated: the phases' loop nests already run one after the other). Written out, not left
        to TVM: its planner cannot place a barrier that a read inside a condition needs."""
        if not emulate:
            T.evaluate(T.tvm_storage_sync("shared"))

    @T.prim_func(check_well_formed=False)
    def attention(q: T.Buffer((rows, width), "float32"), k: T.Buffer((pages, block, kv_width), "float32"),
                  v: T.Buffer((pages, block, kv_width), "float32"), table: T.Buffer(table_shape, "int32"),
                  row_of: T.Buffer((rows,), "int32"), pos_of: T.Buffer((rows,), "int32"),
                  out: T.Buffer((rows, width), "float32")):
        T.func_attr({"tirx.noalias": True})
        for rh in threads(rows * heads, "blockIdx.x"):
            qs = T.alloc_buffer((dim,), "float32", scope="shared")  # the query head
            acc = T.alloc_buffer((dim,), "float32", scope="shared")  # sum of exp(score - max) * value, per column
            p = T.alloc_buffer((THREADS,), "float32", scope="shared")  # the chunk's scores, then exponentials
            pmax = T.alloc_buffer((PARTS,), "float32", scope="shared")  # the chunk's maximum, in parts
            psum = T.alloc_buffer((PARTS,), "float32", scope="shared")  # the chunk's sum of exponentials, in parts
            top = T.alloc_buffer((2,), "float32", scope="shared")  # the running max; this chunk's rescaling factor
            total = T.alloc_buffer((1,), "float32", scope="shared")  # the sum of exponentials, at the end
            reg = T.alloc_buffer((2,), "float32", scope="local")  # a thread's values within a phase
            first = T.alloc_buffer((2,), "float32", scope="local")  # thread 0's running max and sum
            for t in threads(THREADS, "threadIdx.x"):
                for c in range(columns):
                    if c * THREADS + t < dim:
                        qs[c * THREADS + t] = q[rh // heads, rh % heads * dim + c * THREADS + t]
                        acc[c * THREADS + t] = T.float32(0)
                if t < PARTS:
                    psum[t] = T.float32(0)
                if t == 0:
                    first[0] = T.min_value("float32")
                    first[1] = T.float32(0)
            for chunk in range((pos_of[rh // heads] + THREADS) // THREADS):
                for t in threads(THREADS, "threadIdx.x"):  # score position chunk * THREADS + t
                    barrier()
                    reg[0] = T.min_value("float32")
                    if chunk * THREADS + t <= pos_of[rh // heads]:
                        reg[0] = T.float32(0)
                        for d in range(dim):
                            reg[0] = reg[0] + qs[d] * k[
                                T.max(table[row_of[rh // heads], (chunk * THREADS + t) // block], 0),
                                (chunk * THREADS + t) % block, rh % heads // group * dim + d]
                        reg[0] = reg[0] * T.float32(scale)
                    p[t] = reg[0]
                for t in threads(THREADS, "threadIdx.x"):  # PARTS threads: the maximum of SPAN scores each
                    barrier()
                    if t < PARTS:
                        reg[0] = p[t * SPAN]
                        for s in range(1, SPAN):
                            reg[0] = T.max(reg[0], p[t * SPAN + s])
                        pmax[t] = reg[0]
                for t in threads(THREADS, "threadIdx.x"):  # thread 0: the new max; the sum so far, rescaled
                    barrier()
                    if t == 0:
                        reg[0] = first[0]
                        reg[1] = first[1]
                        for s in range(PARTS):
                            reg[0] = T.max(reg[0], pmax[s])
                            reg[1] = reg[1] + psum[s]  # the previous chunk's sum
                        first[1] = reg[1]
                        reg[1] = T.exp(first[0] - reg[0])  # the rescaling factor, once
                        first[1] = first[1] * reg[1]
                        first[0] = reg[0]
                        top[0] = reg[0]
                        top[1] = reg[1]
                for t in threads(THREADS, "threadIdx.x"):
                    barrier()
                    reg[1] = top[0]
                    reg[0] = T.float32(0)
                    if chunk * THREADS + t <= pos_of[rh // heads]:
                        reg[0] = T.exp(p[t] - reg[1])
                    p[t] = reg[0]
                for t in threads(THREADS, "threadIdx.x"):  # each thread its columns; PARTS threads the sum too
                    barrier()
                    reg[1] = top[1]
                    for c in range(columns):
                        if c * THREADS + t < dim:
                            reg[0] = acc[c * THREADS + t] * reg[1]
                            for s in range(T.min(THREADS, pos_of[rh // heads] + 1 - chunk * THREADS)):
                                reg[0] = reg[0] + p[s] * v[
                                    T.max(table[row_of[rh // heads], (chunk * THREADS + s) // block], 0),
                                    (chunk * THREADS + s) % block, rh % heads // group * dim + c * THREADS + t]
                            acc[c * THREADS + t] = reg[0]
                    if t < PARTS:
                        reg[0] = T.float32(0)
                        for s in range(SPAN):
                            reg[0] = reg[0] + p[t * SPAN + s]
                        psum[t] = reg[0]
            for t in threads(THREADS, "threadIdx.x"):  # thread 0: the last chunk's sum
                barrier()
                if t == 0:
                    reg[1] = first[1]
                    for s in range(PARTS):
                        reg[1] = reg[1] + psum[s]
                    total[0] = reg[1]
            for t in threads(THREADS, "threadIdx.x"):
                barrier()
                reg[1] = total[0]
                for c in range(columns):
                    if c * THREADS + t < dim:
                        out[rh // heads, rh % heads * dim + c * THREADS + t] = T.if_then_else(  # no position: 0
                            reg[1] > T.float32(0), acc[c * THREADS + t] / reg[1], T.float32(0))

    return attention
