"""Prefill matrix products on Intel AMX tiles: bfloat16 weights (`amx_gemm`), or AWQ INT4 weights in the pairs
layout (`amx_awq_gemm`), times activations rounded to bfloat16.

Opt-in (`--matmul-precision bfloat16`): products then differ from float32 ones by bfloat16 rounding of
the activations, as llama.cpp's BF16 path and torch's bf16 models do. Sums stay float32.

One AMX dot product, `tdpbf16ps C, A, B`, adds A[16 x 32] @ B[32 x 16] into a 16 x 16 float32 tile C, with B
stored in pairs: B[depth / 2][16 columns][2]. In `amx_gemm` A is 16 rows of the weight, read in place (w is
[out, in], so each row is a contiguous run of the depth), and B holds 16 activation rows, packed once per
call into that paired layout; C is thus a transposed [out, token] block, written back to y[token, out]. AWQ
words already hold B's pairs, so `amx_awq_gemm` swaps the roles (its docstring).
"""

from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ir.packing import PAIR_SLOTS, pair_column

from .written import (PAIR_ROWS, bf16_bits, group_product, group_value_pairs, linear_func, nibble_table,
                      pack_activation_pairs, packed_groups, packed_linear_func, transpose, widened)

TILE = PAIR_ROWS  # rows per tile (16); a tile row holds 64 bytes: 32 bfloat16 or 16 float32
DEPTH = 32  # bfloat16 depth per dot product
HALF_DEPTH = DEPTH // 2  # a dot product's depth in groups of 16 rows (GGUF's Q2_K, Q3_K, Q6_K)
BLOCK = 2 * TILE  # outputs per block side: 2 weight tiles x 2 activation tiles -> 4 accumulator tiles


@T.macro
def tile_config(cfg, depth):
    """Palette 1 loaded into this thread's tile registers: every tile 16 rows x 64 bytes, but for a dot product's
    `depth` below 32 the A tiles (0, 1) narrower (depth bfloat16 a row) and the B tiles (2, 3) shorter (depth / 2
    rows of pairs)."""
    for i in range(64):
        cfg[i] = T.uint8(0)
    cfg[0] = T.uint8(1)
    for t in range(8):
        cfg[16 + 2 * t] = T.uint8(64)
        cfg[48 + t] = T.uint8(TILE)
    cfg[16] = T.uint8(2 * depth)  # bytes a row of tiles 0 and 1
    cfg[18] = T.uint8(2 * depth)
    cfg[50] = T.uint8(depth // 2)  # rows of tiles 2 and 3
    cfg[51] = T.uint8(depth // 2)
    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.ldtilecfg", T.address_of(cfg[0])))


@T.macro
def load(tile, address, stride):
    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tileloadd64", T.int8(tile), address, T.int64(stride)))


@T.macro
def dot(acc, a, b):
    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tdpbf16ps", T.int8(acc), T.int8(a), T.int8(b)))


@T.macro
def zero(tile):
    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilezero", T.int8(tile)))


@T.macro
def store(tile, address, stride):
    T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilestored64", T.int8(tile), address, T.int64(stride)))


@T.macro
def two_by_two(a0, a1, a_stride, b0, b1, b_stride):
    """Accumulator tiles 4..7 += A (tiles 0, 1 from addresses a0, a1: rows) @ B (tiles 2, 3 from b0, b1: columns),
    one dot product's depth (`tile_config`'s); strides in bytes."""
    load(0, a0, a_stride)
    load(1, a1, a_stride)
    load(2, b0, b_stride)
    load(3, b1, b_stride)
    dot(4, 0, 2)
    dot(5, 0, 3)
    dot(6, 1, 2)
    dot(7, 1, 3)


@T.macro
def two_by_one(a0, a1, a_stride, b0, b_stride):
    """Accumulator tiles 4 and 6 += A (tiles 0, 1 from addresses a0, a1: rows) @ B (tile 2 from b0: columns), one
    depth of 32; strides in bytes."""
    load(0, a0, a_stride)
    load(1, a1, a_stride)
    load(2, b0, b_stride)
    dot(4, 0, 2)
    dot(6, 1, 2)


@T.macro
def zero_accumulators():
    """Accumulator tiles 4..7 set to zero."""
    zero(4)
    zero(5)
    zero(6)
    zero(7)


def amx_gemm(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """x @ w.T (+ bias) for float32 x and bfloat16 w on AMX tiles, or None when the shape does not fit
    (token rows must be a multiple of 16, depth and outputs of 32). Each block of outputs takes two weight tiles
    and, a block of token rows at a time, two activation tiles (16 rows: one)."""
    x_buf, w_buf = func.params[:2]
    m, k = (int(d) for d in x_buf.shape)
    n = int(w_buf.shape[0])
    if w_buf.dtype != "bfloat16" or x_buf.dtype != "float32" or m % TILE or k % DEPTH or n % BLOCK:
        return None
    x_tiles = 2 if m % BLOCK == 0 else 1  # activation tiles per block of token rows

    @T.macro
    def products(x, w, y, first):
        # x as bfloat16 bits, 16 rows at a time, depth in pairs: xp[row block, depth / 2, row, 2]
        xp = T.alloc_buffer((m // TILE, k // 2, TILE, 2), "uint16")
        pack_activation_pairs(x, xp)
        for task in T.parallel(n // BLOCK):  # a task: 32 outputs for every token row
            cfg = T.alloc_buffer((64,), "uint8")  # on the stack
            acc = T.alloc_buffer((4, TILE, TILE), "float32", scope="local")
            t0 = T.alloc_buffer((TILE, TILE), "float32")  # a tile being transposed: 1 KiB each, in registers
            t1 = T.alloc_buffer((TILE, TILE), "float32")
            tile_config(cfg, DEPTH)
            for rows in range(m // (x_tiles * TILE)):
                zero_accumulators()
                for s in range(k // DEPTH):  # A: two tiles of weight rows; B: x_tiles of activation rows
                    if x_tiles == 2:
                        two_by_two(T.address_of(w[task * BLOCK, s * DEPTH]),
                                   T.address_of(w[task * BLOCK + TILE, s * DEPTH]), k * 2,
                                   T.address_of(xp[rows * 2, s * TILE, 0, 0]),
                                   T.address_of(xp[rows * 2 + 1, s * TILE, 0, 0]), 64)
                    else:
                        two_by_one(T.address_of(w[task * BLOCK, s * DEPTH]),
                                   T.address_of(w[task * BLOCK + TILE, s * DEPTH]), k * 2,
                                   T.address_of(xp[rows, s * TILE, 0, 0]), 64)
                store(4, T.address_of(acc[0, 0, 0]), 64)
                store(5, T.address_of(acc[1, 0, 0]), 64)
                store(6, T.address_of(acc[2, 0, 0]), 64)
                store(7, T.address_of(acc[3, 0, 0]), 64)
                for wt, xt in T.grid(2, x_tiles):  # acc[2 * wt + xt] is [output, token]: transposed in registers
                    for c in T.unroll(TILE):
                        t0[c, T.ramp(0, 1, TILE)] = acc[wt * 2 + xt, c, T.ramp(0, 1, TILE)]
                    transpose(t0, t1)
                    for r in T.unroll(TILE):  # no Let for the column: TVM 0.27 miscompiles a LetStmt inside a
                        # vectorised loop (it stored zeros)
                        for c in T.vectorized(TILE):
                            y[rows * x_tiles * TILE + xt * TILE + r, task * BLOCK + wt * TILE + c] = (
                                t0[r, c] + first(task * BLOCK + wt * TILE + c))
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))

    return linear_func(func, products)


def amx_awq_gemm(func: tirx.PrimFunc) -> tirx.PrimFunc | None:
    """x @ W.T (+ bias) for float32 x and an AWQ weight in the pairs layout (ir.packing awq_int4_pairs) on AMX
    tiles, or None when the shape does not fit (16-word column tiles, token rows a multiple of 32, a depth of
    whole 32s, groups of 16 rows or a multiple of 32: a group of 16 takes dot products of half the depth).

    The roles swap: x rounded to bfloat16 is A (16 token rows x 32 depth, read in place), and the packed words
    are B, whose layout they already have: `(word >> 4n) & 0x000F000F` is a pair (depth 2p, depth 2p + 1) of
    4-bit values per column, and one vpermw turns each into its exact bfloat16. A task unpacks its column tile
    once (every depth, four nibbles) and reuses it for every block of token rows. C sums x * q over one group;
    after each group, y += s * (C - z * sum of x over the group) (affine: s * C + m * that sum), so the weights
    are exact and only the activations are rounded, as in `amx_gemm`. A weight of two planes is unpacked as its
    values 16 h + l (`group_value_pairs`), so it takes one set of dot products and one fold a group, not two."""
    x_buf, q_buf, z_buf, s_buf = func.params[:4]
    m, k = (int(d) for d in x_buf.shape)
    tiles, pairs, words = (int(d) for d in q_buf.shape)
    planes, groups, group = packed_groups(x_buf, s_buf, pairs)
    depth = DEPTH if group % DEPTH == 0 else HALF_DEPTH  # a dot product's
    if words != TILE or m % BLOCK or group % depth or k % DEPTH or x_buf.dtype != "float32":
        return None
    steps, columns = group // depth, PAIR_SLOTS * words  # depth steps a group; columns a task

    @T.macro
    def products(x, qw, qz, sc, ys, first):
        xa = T.alloc_buffer((m, k), "uint16")  # x as bfloat16 bits, row-major: the A tiles
        xsum = T.alloc_buffer((m, groups), "float32")  # sum of the rounded x over each group
        for r in T.parallel(m):
            part = T.alloc_buffer((TILE,), "float32")
            for g in range(groups):
                for lane in T.vectorized(TILE):
                    part[lane] = T.float32(0)
                for d in range(group // TILE):
                    for lane in T.vectorized(TILE):
                        xa[r, (g * group // TILE + d) * TILE + lane] = bf16_bits(
                            x[r, (g * group // TILE + d) * TILE + lane])
                        part[lane] = part[lane] + widened(xa[r, (g * group // TILE + d) * TILE + lane])
                xsum[r, g] = T.float32(0)
                for lane in range(TILE):
                    xsum[r, g] = xsum[r, g] + part[lane]
        for task in T.parallel(tiles):
            cfg = T.alloc_buffer((64,), "uint8")  # on the stack
            table = T.alloc_buffer((2 * TILE,), "uint16")
            bt = T.alloc_buffer((k // DEPTH, PAIR_SLOTS, TILE, TILE), "uint32")  # B: [step, nibble, pair, col]
            acc = T.alloc_buffer((2, 2, TILE, TILE), "float32", scope="local")
            yacc = T.alloc_buffer((m, columns), "float32")
            tile_config(cfg, depth)
            nibble_table(table)
            for g, p in T.grid(groups, group // 2):  # pair p of group g: bt's pair row g * group / 2 + p
                for n in T.unroll(PAIR_SLOTS):
                    bt[(g * group // 2 + p) // TILE, n, (g * group // 2 + p) % TILE, T.ramp(0, 1, TILE)] = \
                        group_value_pairs(table, qw, task, g, p, n, planes, group // 2, TILE)
            for r, c in T.grid(m, columns):
                yacc[r, c] = T.float32(0)
            for half, rows, g in T.grid(PAIR_SLOTS // 2, m // BLOCK, groups):
                zero_accumulators()
                for s in range(steps):  # A: two tiles of x rows; B: two nibbles' columns, from bt's pair row p
                    p = (g * steps + s) * depth // 2
                    two_by_two(T.address_of(xa[rows * BLOCK, (g * steps + s) * depth]),
                               T.address_of(xa[rows * BLOCK + TILE, (g * steps + s) * depth]), k * 2,
                               T.address_of(bt[p // TILE, 2 * half, p % TILE, 0]),
                               T.address_of(bt[p // TILE, 2 * half + 1, p % TILE, 0]), 64)
                store(4, T.address_of(acc[0, 0, 0, 0]), 64)
                store(5, T.address_of(acc[0, 1, 0, 0]), 64)
                store(6, T.address_of(acc[1, 0, 0, 0]), 64)
                store(7, T.address_of(acc[1, 1, 0, 0]), 64)
                for xt, nt, r in T.grid(2, 2, TILE):  # acc[xt, nt] is [token, column] of nibble 2 half + nt
                    for c in T.vectorized(TILE):
                        yacc[rows * BLOCK + xt * TILE + r, (2 * half + nt) * TILE + c] = yacc[
                            rows * BLOCK + xt * TILE + r, (2 * half + nt) * TILE + c] + group_product(
                            qz, sc, task, g, 2 * half + nt, c, words, acc[xt, nt, r, c],
                            xsum[rows * BLOCK + xt * TILE + r, g], planes, whole=planes == 2, group=group)
            for r, n, c in T.grid(m, PAIR_SLOTS, TILE):
                ys[r, pair_column(task, n, c, words)] = first(pair_column(task, n, c, words)) + yacc[r, n * TILE + c]
            T.evaluate(T.call_llvm_intrin("void", "llvm.x86.tilerelease"))

    return packed_linear_func(func, products)
