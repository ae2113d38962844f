"""The causal conv1d + SiLU of a step on a CPU, its rolling window and weights in registers.

The compute definition (`compiler.kernels.batch_causal_conv1d`) keeps each task's window in memory and walks
its channels as a serial loop that LLVM vectorises on its own: per token it stores and reloads the window and the
output, and reads each weight as a bfloat16 to widen. Here a task (one sequence, a block of channels) widens its
weights once and holds them and the window in registers (unrolled loops over tiles under 1 KiB); per token it
reads x, writes y, and the window shifts by renaming registers. Qwen3.5-0.8B shape (6144 channels, window 3),
alternating in one process (Intel Xeon, AVX-512): 128 rows of one sequence 1.59 -> 0.58 ms; decode rows unchanged.
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

BLOCK_VECS = 2  # SIMD vectors of channels per task: window and weights stay under 1 KiB each


def causal_conv(func: tirx.PrimFunc, lanes: int) -> tirx.PrimFunc | None:
    """The conv's kernel for the signature of `func` (the definition), or None when the channels are not whole SIMD
    vectors."""
    x_buf, pool_buf, w_buf, seq_buf = func.params[:4]
    rows, channels = (int(d) for d in x_buf.shape)
    slots, keep = (int(d) for d in pool_buf.shape[:2])
    seqs, w_dtype = int(seq_buf.shape[0]), w_buf.dtype
    if channels % lanes:
        return None
    vecs = next(v for v in (BLOCK_VECS, 1) if channels // lanes % v == 0)
    block = vecs * lanes
    blocks = channels // block

    @T.prim_func(check_well_formed=False)
    def conv(x: T.Buffer((rows, channels), "float32"), pool: T.Buffer((slots, keep, channels), "float32"),
             w: T.Buffer((channels, 1, keep + 1), w_dtype), seq_start: T.Buffer((seqs,), "int32"),
             seq_len: T.Buffer((seqs,), "int32"), seq_pos: T.Buffer((seqs,), "int32"),
             seq_slot: T.Buffer((seqs,), "int32"), y: T.Buffer((rows, channels), "float32")):
        for task in T.parallel(seqs * blocks):  # one sequence's block of channels
            weights = T.alloc_buffer((keep + 1, vecs, lanes), "float32")
            window = T.alloc_buffer((keep, vecs, lanes), "float32")
            acc = T.alloc_buffer((vecs, lanes), "float32")
            if seq_len[task // blocks] > 0:
                for k in T.unroll(keep + 1):
                    for v in T.unroll(vecs):
                        for lane in T.vectorized(lanes):
                            weights[k, v, lane] = T.Cast("float32", w[task % blocks * block + v * lanes + lane, 0, k])
                for k in T.unroll(keep):
                    for v in T.unroll(vecs):
                        for lane in T.vectorized(lanes):
                            window[k, v, lane] = T.if_then_else(seq_pos[task // blocks] > 0, pool[
                                T.max(seq_slot[task // blocks], 0), k, task % blocks * block + v * lanes + lane],
                                T.float32(0))
                for t in range(seq_len[task // blocks]):
                    for v in T.unroll(vecs):
                        for lane in T.vectorized(lanes):
                            acc[v, lane] = weights[keep, v, lane] * x[seq_start[task // blocks] + t,
                                                                      task % blocks * block + v * lanes + lane]
                        for k in T.unroll(keep):
                            for lane in T.vectorized(lanes):
                                acc[v, lane] = acc[v, lane] + weights[k, v, lane] * window[k, v, lane]
                        for lane in T.vectorized(lanes):
                            y[seq_start[task // blocks] + t, task % blocks * block + v * lanes + lane] = acc[
                                v, lane] * T.sigmoid(acc[v, lane])
                        for k in T.unroll(keep - 1):
                            for lane in T.vectorized(lanes):
                                window[k, v, lane] = window[k + 1, v, lane]
                        for lane in T.vectorized(lanes):
                            window[keep - 1, v, lane] = x[seq_start[task // blocks] + t,
                                                          task % blocks * block + v * lanes + lane]
                for k in T.unroll(keep):
                    for v in T.unroll(vecs):
                        for lane in T.vectorized(lanes):
                            pool[seq_slot[task // blocks], k, task % blocks * block + v * lanes + lane] = window[
                                k, v, lane]

    return conv
