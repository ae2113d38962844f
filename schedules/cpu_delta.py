"""Qwen3.5's gated delta rule on a CPU, in both its forms, as register-blocked loops.

The compute definition (`compiler.kernels.batch_gated_delta_rule`) fixes the arithmetic. Its chunked form (a step
of one sequence: a prefill chunk of one request) works per chunk of C tokens and value head h: the log decays from
the chunk's start, the in-chunk dot products k_t . k_s and q_t . k_s, the matrices A (strictly lower, beta and decay
applied) and attn (lower), a forward substitution giving W = (I + A)^-1 (beta k exp(decay)) and
U = (I + A)^-1 (beta v), then the state pass: fresh = U - W S, out = exp(decay) (q S) + attn fresh,
S = S exp(decay at the chunk's end) + (k exp(decay at end - decay))^T fresh. Its recurrent form (any other step:
decodes, and prompt chunks mixed with them in a batch) runs token by token.

The chunked kernel computes the same in two parallel passes:
- per (head, chunk): the decays, the decayed keys, the dot products from a transposed copy of the chunk's keys (a
  tile of rows against every key in SIMD lanes; the definition's schedule read each key element as a scalar
  gather), A, attn and the substitution, a row's columns held in registers;
- per (head, block of value columns): the state pass, as register tiles: two token rows of W S and of q S over
  the block's columns (each state row loaded once for both sums of both rows), then the update a few state rows
  at a time over the chunk's tokens. The block of the state stays in L1 from chunk to chunk.
The recurrent kernel gives each (head, block of value columns, sequence) a task, ordered so that one long
sequence's tasks spread over the cores, and makes two passes over the block per token (see `_recurrent`).
Qwen3.5-0.8B shape (16 heads of 128 x 128), alternating in one process (Intel Xeon, AVX-512): one sequence of 128
rows 5.4 -> 1.6 ms, 32 v heads over 16 k heads 9.7 -> 3.9 ms; a 120-token prompt chunk beside 8 decode rows 6.0 ->
2.6 ms; decode rows unchanged (the state's bytes bound them).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ir.ops import delta_chunk

SOLVE_VECS = 4  # vectors of right-hand-side columns a row of the substitution holds at once
TILE_BYTES = 1024  # TVM keeps a tile on the stack (where LLVM holds it in registers) only when it is under this


def _budget(lanes: int) -> int:
    """Accumulator registers a tile may take: half the SIMD registers (32 with AVX-512, 16 with AVX2)."""
    return 16 if lanes >= 16 else 8


def _rows_per_tile(rows: int, vecs: int, lanes: int, most: int, sums: int = 1) -> int:
    """Rows of `sums` register tiles of `vecs` vectors per row: at most `most`, dividing `rows`, within the register
    budget, each tile under TILE_BYTES."""
    return max(t for t in (4, 2, 1) if t <= most and rows % t == 0 and t * vecs * sums <= _budget(lanes)
               and t * vecs * lanes * 4 < TILE_BYTES)


def delta_rule(func: tirx.PrimFunc, attrs: dict, lanes: int, scan_lanes: int) -> tirx.PrimFunc | None:
    """The delta rule's kernel for the signature of `func` (the definition): its chunked form for a step of one
    sequence where the definition has one, else the token-by-token recurrence; None when the head dimensions are not
    whole SIMD vectors."""
    qk_buf, qkv_buf, _, pool_buf, seq_buf = func.params[:5]
    rows, width = (int(d) for d in qkv_buf.shape)
    slots, seqs = int(pool_buf.shape[0]), int(seq_buf.shape[0])
    hk, hv, dk, dv = (attrs[k] for k in ("num_k_heads", "num_v_heads", "k_dim", "v_dim"))
    if dk % lanes or dv % lanes:
        return None
    chunk = delta_chunk(rows, seqs, attrs["chunk"])
    cols = next(c for c in (scan_lanes, lanes) if dv % c == 0)  # value columns of a state-pass task
    shape = _Shape(rows, chunk or 1, hk, hv, dk, dv, lanes, cols)  # the recurrence: a chunk of one token
    if chunk == 0:
        return _recurrent(width, slots, seqs, shape)
    prep, state_pass = _prep_macro(shape), _state_macro(shape)
    chunks, groups = rows // chunk, dv // shape.cols

    @T.prim_func(check_well_formed=False)
    def delta_rule(qk: T.Buffer((rows, 2 * hk * dk), "float32"), qkv: T.Buffer((rows, width), "float32"),
                   gates: T.Buffer((rows, hv, 2), "float32"), pool: T.Buffer((slots, hv, dk, dv), "float32"),
                   seq_start: T.Buffer((1,), "int32"), seq_len: T.Buffer((1,), "int32"),
                   seq_pos: T.Buffer((1,), "int32"), seq_slot: T.Buffer((1,), "int32"),
                   out: T.Buffer((rows, hv * dv), "float32")):
        gain = T.alloc_buffer((hv, rows), "float32")  # exp(decay from the chunk's start)
        kd = T.alloc_buffer((hv, rows, dk), "float32")  # k exp(decay at the chunk's end - decay)
        attn = T.alloc_buffer((hv, rows, chunk), "float32")
        w = T.alloc_buffer((hv, rows, dk), "float32")
        u = T.alloc_buffer((hv, rows, dv), "float32")
        for task in T.parallel(hv * chunks):
            prep(qk, qkv, gates, gain, kd, attn, w, u, task // chunks, task % chunks * chunk)
        for task in T.parallel(hv * groups):
            state_pass(qk, pool, seq_pos, seq_slot, gain, kd, attn, w, u, out, task // groups,
                       task % groups * shape.cols)

    return delta_rule


class _Shape:
    """The sizes one kernel is specialised for, and its tiles."""

    def __init__(self, rows, chunk, hk, hv, dk, dv, lanes, cols):
        self.rows, self.chunk, self.hv, self.dk, self.dv, self.lanes, self.cols = rows, chunk, hv, dk, dv, lanes, cols
        self.ratio, self.key, self.value = hv // hk, hk * dk, 2 * hk * dk
        self.vecs = cols // lanes  # vectors of value columns of a state-pass task
        self.pair = _rows_per_tile(chunk, self.vecs, lanes, 2, sums=2)  # token rows per tile of W S and q S (two sums)
        self.quad = _rows_per_tile(dk, self.vecs, lanes, 4)  # state rows per tile of the update
        self.row_tile = _rows_per_tile(chunk, -(-chunk // lanes), lanes, 4, sums=2)  # query rows per in-chunk dot tile


def _solve_macro(chunk, lanes, size):
    """The macro of a forward substitution over `size` columns: rows r of dst[h, base + r, :] = rhs(r, column) - the
    sum over s < r of A[r, s] times row s, each row `group` vectors of columns at a time, held in registers."""
    group = next(v for v in (SOLVE_VECS, 2, 1) if size // lanes % v == 0)

    @T.macro
    def solve(a_mat, dst, rhs, h, base):
        x = T.alloc_buffer((group, lanes), "float32")
        for r, c0 in T.grid(chunk, size // lanes // group):
            for v in T.unroll(group):
                for lane in T.vectorized(lanes):
                    x[v, lane] = rhs(r, (c0 * group + v) * lanes + lane)
            for s in range(r):
                for v in T.unroll(group):
                    for lane in T.vectorized(lanes):
                        x[v, lane] = x[v, lane] - a_mat[r, s] * dst[h, base + s, (c0 * group + v) * lanes + lane]
            for v in T.unroll(group):
                for lane in T.vectorized(lanes):
                    dst[h, base + r, (c0 * group + v) * lanes + lane] = x[v, lane]

    return solve


def _prep_macro(shape: _Shape):
    """The macro of one (head h, chunk starting at row `base`): gains, decayed keys, attn, and W and U by forward
    substitution."""
    chunk, dk, dv, key, value, ratio, row_tile = (shape.chunk, shape.dk, shape.dv, shape.key, shape.value, shape.ratio,
                                                  shape.row_tile)
    solve_w, solve_u = _solve_macro(chunk, shape.lanes, dk), _solve_macro(chunk, shape.lanes, dv)

    @T.macro
    def prep(qk, qkv, gates, gain, kd, attn, w, u, h, base):
        decay = T.alloc_buffer((chunk,), "float32")  # log decay from the chunk's start, inclusive
        keys = T.alloc_buffer((dk, chunk), "float32")  # the chunk's keys, transposed
        a_mat = T.alloc_buffer((chunk, chunk), "float32")
        kk = T.alloc_buffer((row_tile, chunk), "float32")
        qq = T.alloc_buffer((row_tile, chunk), "float32")
        decay[0] = gates[base, h, 0]
        for r in range(1, chunk):
            decay[r] = decay[r - 1] + gates[base + r, h, 0]
        for r in range(chunk):
            gain[h, base + r] = T.exp(decay[r])
            for i in T.vectorized(dk):
                kd[h, base + r, i] = qk[base + r, key + h // ratio * dk + i] * T.exp(decay[chunk - 1] - decay[r])
        for s, i in T.grid(chunk, dk):
            keys[i, s] = qk[base + s, key + h // ratio * dk + i]
        for r0 in range(chunk // row_tile):
            for t in T.unroll(row_tile):
                for s in T.vectorized(chunk):
                    kk[t, s] = T.float32(0)
                    qq[t, s] = T.float32(0)
            for i in range(dk):
                for t in T.unroll(row_tile):
                    for s in T.vectorized(chunk):
                        kk[t, s] = kk[t, s] + qk[base + r0 * row_tile + t, key + h // ratio * dk + i] * keys[i, s]
                        qq[t, s] = qq[t, s] + qk[base + r0 * row_tile + t, h // ratio * dk + i] * keys[i, s]
            for t in T.unroll(row_tile):
                for s in T.vectorized(chunk):  # exp of a positive decay difference (s > r) is masked out
                    a_mat[r0 * row_tile + t, s] = T.Select(
                        s < r0 * row_tile + t, gates[base + r0 * row_tile + t, h, 1] * kk[t, s]
                        * T.exp(decay[r0 * row_tile + t] - decay[s]), T.float32(0))
                    attn[h, base + r0 * row_tile + t, s] = T.Select(
                        s <= r0 * row_tile + t, qq[t, s] * T.exp(decay[r0 * row_tile + t] - decay[s]), T.float32(0))
        solve_w(a_mat, w, lambda r, c: gates[base + r, h, 1] * qk[base + r, key + h // ratio * dk + c]
                * gain[h, base + r], h, base)
        solve_u(a_mat, u, lambda r, c: gates[base + r, h, 1] * qkv[base + r, value + h * dv + c], h, base)

    return prep


def _state_macro(shape: _Shape):
    """The macro of one (head h, value columns j0..j0 + cols): the state pass over every chunk."""
    chunk, chunks, dk, dv = shape.chunk, shape.rows // shape.chunk, shape.dk, shape.dv
    ratio, lanes = shape.ratio, shape.lanes
    vecs, pair, quad, cols = shape.vecs, shape.pair, shape.quad, shape.cols

    @T.macro
    def state_pass(qk, pool, seq_pos, seq_slot, gain, kd, attn, w, u, out, h, j0):
        state = T.alloc_buffer((dk, cols), "float32")
        fresh = T.alloc_buffer((chunk, cols), "float32")
        acc_f = T.alloc_buffer((pair, vecs, lanes), "float32")  # register tiles: in unrolled loops
        acc_q = T.alloc_buffer((pair, vecs, lanes), "float32")
        acc_s = T.alloc_buffer((quad, vecs, lanes), "float32")
        for i, v in T.grid(dk, vecs):
            for lane in T.vectorized(lanes):
                state[i, v * lanes + lane] = T.float32(0)
        if seq_pos[0] > 0:
            for i, v in T.grid(dk, vecs):
                for lane in T.vectorized(lanes):
                    state[i, v * lanes + lane] = pool[T.max(seq_slot[0], 0), h, i, j0 + v * lanes + lane]
        for c in range(chunks):
            for p in range(chunk // pair):
                for t in T.unroll(pair):
                    for v in T.unroll(vecs):
                        for lane in T.vectorized(lanes):
                            acc_f[t, v, lane] = T.float32(0)
                            acc_q[t, v, lane] = T.float32(0)
                for i in range(dk):  # W S and q S together: each state row loaded once for both
                    for t in T.unroll(pair):
                        for v in T.unroll(vecs):
                            for lane in T.vectorized(lanes):
                                acc_f[t, v, lane] = acc_f[t, v, lane] + w[h, c * chunk + p * pair + t, i] * state[
                                    i, v * lanes + lane]
                                acc_q[t, v, lane] = acc_q[t, v, lane] + qk[
                                    c * chunk + p * pair + t, h // ratio * dk + i] * state[i, v * lanes + lane]
                for t in T.unroll(pair):
                    for v in T.unroll(vecs):
                        for lane in T.vectorized(lanes):
                            fresh[p * pair + t, v * lanes + lane] = u[
                                h, c * chunk + p * pair + t, j0 + v * lanes + lane] - acc_f[t, v, lane]
                            acc_q[t, v, lane] = acc_q[t, v, lane] * gain[h, c * chunk + p * pair + t]
                for s in range(p * pair + pair):  # attn is 0 past each row's own position
                    for t in T.unroll(pair):
                        for v in T.unroll(vecs):
                            for lane in T.vectorized(lanes):
                                acc_q[t, v, lane] = acc_q[t, v, lane] + attn[h, c * chunk + p * pair + t, s] * fresh[
                                    s, v * lanes + lane]
                for t in T.unroll(pair):
                    for v in T.unroll(vecs):
                        for lane in T.vectorized(lanes):
                            out[c * chunk + p * pair + t, h * dv + j0 + v * lanes + lane] = acc_q[t, v, lane]
            for i0 in range(dk // quad):  # the update, `quad` state rows at a time over the chunk's tokens
                for t in T.unroll(quad):
                    for v in T.unroll(vecs):
                        for lane in T.vectorized(lanes):
                            acc_s[t, v, lane] = state[i0 * quad + t, v * lanes + lane] * gain[h, c * chunk + chunk - 1]
                for r in range(chunk):
                    for t in T.unroll(quad):
                        for v in T.unroll(vecs):
                            for lane in T.vectorized(lanes):
                                acc_s[t, v, lane] = acc_s[t, v, lane] + kd[h, c * chunk + r, i0 * quad + t] * fresh[
                                    r, v * lanes + lane]
                for t in T.unroll(quad):
                    for v in T.unroll(vecs):
                        for lane in T.vectorized(lanes):
                            state[i0 * quad + t, v * lanes + lane] = acc_s[t, v, lane]
        for i, v in T.grid(dk, vecs):
            for lane in T.vectorized(lanes):
                pool[seq_slot[0], h, i, j0 + v * lanes + lane] = state[i, v * lanes + lane]

    return state_pass


def _recurrent(width, slots, seqs, shape: _Shape) -> tirx.PrimFunc:
    """The recurrence token by token: a task is one sequence's block of value columns of one head, over its tokens.
    Per token two passes over the block of the state: S^T k (the decay applied after the sum), then S = S exp(g) +
    k delta^T written back while S^T q is summed; each pass's sums in two sets of registers (rows alternating), so
    no chain of FMAs waits on one set's latency."""
    rows, hk, hv, dk, dv, cols = shape.rows, shape.hv // shape.ratio, shape.hv, shape.dk, shape.dv, shape.cols
    recurrence, groups = _recurrence_macro(shape), dv // cols

    @T.prim_func(check_well_formed=False)
    def delta_rule(qk: T.Buffer((rows, 2 * hk * dk), "float32"), qkv: T.Buffer((rows, width), "float32"),
                   gates: T.Buffer((rows, hv, 2), "float32"), pool: T.Buffer((slots, hv, dk, dv), "float32"),
                   seq_start: T.Buffer((seqs,), "int32"), seq_len: T.Buffer((seqs,), "int32"),
                   seq_pos: T.Buffer((seqs,), "int32"), seq_slot: T.Buffer((seqs,), "int32"),
                   out: T.Buffer((rows, hv * dv), "float32")):
        for task in T.parallel(hv * groups * seqs):  # head-major: one long sequence's tasks spread over the cores
            if seq_len[task % seqs] > 0:
                recurrence(qk, qkv, gates, pool, out, seq_start[task % seqs], seq_len[task % seqs],
                           seq_pos[task % seqs], seq_slot[task % seqs], task // (groups * seqs),
                           task // seqs % groups * cols)

    return delta_rule


def _recurrence_macro(shape: _Shape):
    """The macro of one sequence (tokens first..first + count, state from `slot` unless it starts at position 0)
    for head h, value columns j0..j0 + cols."""
    dk, dv, ratio, key, value, lanes, vecs, cols = (shape.dk, shape.dv, shape.ratio, shape.key, shape.value,
                                                    shape.lanes, shape.vecs, shape.cols)

    @T.macro
    def recurrence(qk, qkv, gates, pool, out, first, count, pos, slot, h, j0):
        state = T.alloc_buffer((dk, cols), "float32")
        sums = T.alloc_buffer((2, vecs, lanes), "float32")  # register tiles: in unrolled loops
        delta = T.alloc_buffer((vecs, lanes), "float32")
        for i, v in T.grid(dk, vecs):
            for lane in T.vectorized(lanes):
                state[i, v * lanes + lane] = T.if_then_else(pos > 0, pool[T.max(slot, 0), h, i, j0 + v * lanes + lane],
                                                            T.float32(0))
        for t in range(count):
            for p in T.unroll(2):
                for v in T.unroll(vecs):
                    for lane in T.vectorized(lanes):
                        sums[p, v, lane] = T.float32(0)
            for i0 in range(dk // 2):  # S^T k
                for p in T.unroll(2):
                    for v in T.unroll(vecs):
                        for lane in T.vectorized(lanes):
                            sums[p, v, lane] = sums[p, v, lane] + state[i0 * 2 + p, v * lanes + lane] * qk[
                                first + t, key + h // ratio * dk + i0 * 2 + p]
            for v in T.unroll(vecs):
                for lane in T.vectorized(lanes):  # beta (v - exp(g) S^T k)
                    delta[v, lane] = gates[first + t, h, 1] * (
                        qkv[first + t, value + h * dv + j0 + v * lanes + lane]
                        - T.exp(gates[first + t, h, 0]) * (sums[0, v, lane] + sums[1, v, lane]))
                    sums[0, v, lane] = T.float32(0)
                    sums[1, v, lane] = T.float32(0)
            for i0 in range(dk // 2):  # S = S exp(g) + k delta^T, and S^T q
                for p in T.unroll(2):
                    for v in T.unroll(vecs):
                        for lane in T.vectorized(lanes):
                            state[i0 * 2 + p, v * lanes + lane] = state[i0 * 2 + p, v * lanes + lane] * T.exp(
                                gates[first + t, h, 0]) + qk[first + t, key + h // ratio * dk + i0 * 2 + p] * delta[
                                v, lane]
                            sums[p, v, lane] = sums[p, v, lane] + state[i0 * 2 + p, v * lanes + lane] * qk[
                                first + t, h // ratio * dk + i0 * 2 + p]
            for v in T.unroll(vecs):
                for lane in T.vectorized(lanes):
                    out[first + t, h * dv + j0 + v * lanes + lane] = sums[0, v, lane] + sums[1, v, lane]
        for i, v in T.grid(dk, vecs):
            for lane in T.vectorized(lanes):
                pool[slot, h, i, j0 + v * lanes + lane] = state[i, v * lanes + lane]

    return recurrence
