"""What the hand-written kernels share (CPU, and the GPU ones with their CPU emulation)."""

from __future__ import annotations

import operator

from tvm import tirx
from tvm.script import tirx as T

from ir.packing import block_scale_rows, pair_order, pair_scale, pair_value, scale_groups, two_level

CACHE_LINE = 64  # bytes: what one prefetch brings in
FLOATS_PER_LINE = CACHE_LINE // 4


def prefetch(element, into_l1: bool = False):
    """A software prefetch (read) of the cache line holding `element` (a buffer element), into L2, or into L1 too."""
    return T.call_llvm_intrin("void", "llvm.prefetch.p0", T.address_of(element), 0, 3 if into_l1 else 2, 1)


def horizontal(vector, lanes: int, combine):
    """`combine` over the lanes of a vector, as a tree of halves (log2(lanes) steps, not lanes - 1)."""
    while lanes > 2:
        lanes //= 2
        vector = combine(T.vectorlow(f"float32x{lanes}", vector), T.vectorhigh(f"float32x{lanes}", vector))
    return combine(tirx.Shuffle([vector], [0]), tirx.Shuffle([vector], [1]))


def horizontals(vectors: list, lanes: int, combine=operator.add):
    """One vector whose lane p is `combine` over the lanes of vectors[p] (`lanes` vectors): a tree of pairwise
    halves (lanes - 1 combines and twice as many shuffles, where a `horizontal` per vector takes log2(lanes) of
    each)."""
    width = lanes  # lanes per partial result in every vector of this level
    while width > 1:
        half = width // 2
        low = [s * width + k for s in range(lanes // width) for k in range(half)]
        order_low = low + [lanes + i for i in low]
        order_high = [i + half for i in order_low]
        vectors = [combine(tirx.Shuffle([a, b], order_low), tirx.Shuffle([a, b], order_high))
                   for a, b in zip(vectors[::2], vectors[1::2])]
        width = half
    return vectors[0]


def register_budget(lanes: int) -> int:
    """Accumulator vectors a loop may keep: under half of AVX-512's 32 registers, or of AVX2's 16."""
    return 14 if lanes >= 16 else 8


def slot_base(table, seq, page_size: int, kv_width: int):
    """base(j): the flat offset of position j's key/value row of sequence `seq` of a paged cache, through its block
    table (a padded entry, negative, reads page 0)."""
    return lambda j: T.max(table[seq, j // page_size], 0) * (page_size * kv_width) + j % page_size * kv_width


def thread_loop(emulate: bool):
    """loop(extent, tag): a loop bound to GPU thread axis `tag`, or, to emulate the kernel on the CPU, a serial one."""
    if emulate:
        return lambda extent, tag: T.serial(extent)
    return lambda extent, tag: T.thread_binding(extent, thread=tag)


def linear_func(func: tirx.PrimFunc, products) -> tirx.PrimFunc:
    """A PrimFunc with the signature of the `linear` kernel `func` (x, w, optional bias, y) whose body is the macro
    `products(x, w, y, first)`, `first(j)` being column j's starting value: its bias, or 0."""
    x_buf, w_buf, *rest = func.params
    (m, k), n, w_dtype = (int(d) for d in x_buf.shape), int(w_buf.shape[0]), w_buf.dtype
    if not rest[:-1]:
        @T.prim_func(check_well_formed=False)
        def linear(x: T.Buffer((m, k), "float32"), w: T.Buffer((n, k), w_dtype), y: T.Buffer((m, n), "float32")):
            products(x, w, y, lambda j: T.float32(0))
        return linear

    bias_dtype = rest[0].dtype

    @T.prim_func(check_well_formed=False)
    def linear_bias(x: T.Buffer((m, k), "float32"), w: T.Buffer((n, k), w_dtype), b: T.Buffer((n,), bias_dtype),
                    y: T.Buffer((m, n), "float32")):
        products(x, w, y, lambda j: T.Cast("float32", b[j]))
    return linear_bias


def packed_linear_func(func: tirx.PrimFunc, products) -> tirx.PrimFunc:
    """As `linear_func`, for a `linear` kernel with a packed weight (x, qweight, qzeros or offsets, scales, optional
    bias, y): the body is `products(x, qweight, qzeros, scales, y, first)`."""
    x_buf, q_buf, z_buf, s_buf, *rest = func.params
    (m, k), n = (int(d) for d in x_buf.shape), int(rest[-1].shape[1])  # y [m, n]
    q_shape, z_shape, s_shape, s_dtype = tuple(q_buf.shape), tuple(z_buf.shape), tuple(s_buf.shape), s_buf.dtype
    z_dtype = z_buf.dtype
    if not rest[:-1]:
        @T.prim_func(check_well_formed=False)
        def linear(x: T.Buffer((m, k), "float32"), qw: T.Buffer(q_shape, "int32"), qz: T.Buffer(z_shape, z_dtype),
                   sc: T.Buffer(s_shape, s_dtype), y: T.Buffer((m, n), "float32")):
            products(x, qw, qz, sc, y, lambda j: T.float32(0))
        return linear

    bias_dtype = rest[0].dtype

    @T.prim_func(check_well_formed=False)
    def linear_bias(x: T.Buffer((m, k), "float32"), qw: T.Buffer(q_shape, "int32"), qz: T.Buffer(z_shape, z_dtype),
                    sc: T.Buffer(s_shape, s_dtype), b: T.Buffer((n,), bias_dtype), y: T.Buffer((m, n), "float32")):
        products(x, qw, qz, sc, y, lambda j: T.Cast("float32", b[j]))
    return linear_bias


PAIR_ROWS = 16  # token rows per block of paired activations
PAIR_MASK = 0x000F000F  # one 4-bit value in each 16-bit half of a word of the pairs layout (ir.packing)


def bf16_bits(v):
    """The bits of float32 `v` rounded to the nearest bfloat16 (ties to even)."""
    bits = T.reinterpret("uint32", v)
    return T.Cast("uint16", (bits + T.uint32(0x7FFF) + ((bits >> T.uint32(16)) & T.uint32(1))) >> T.uint32(16))


def widened(bits):
    """The float32 of the bfloat16 whose bits are the low 16 of `bits` (a uint16, or a word whose upper half is
    dropped)."""
    return T.reinterpret("float32", T.shift_left(T.Cast("uint32", bits), T.uint32(16)))


def bf16_pair(low, high):
    """One uint32 word of two bfloat16 bit patterns, `low` in its low half: a pair as memory holds it."""
    return T.bitwise_or(T.Cast("uint32", low), T.shift_left(T.Cast("uint32", high), T.uint32(16)))


@T.macro
def pack_activation_pairs(x, xp):
    """xp[row block, depth / 2, row, 2] = x[row block * PAIR_ROWS + row, depth] rounded to bfloat16 (its bits): the
    operand layout of the bfloat16 pair products (AMX tiles and AVX512-BF16 dot products). Each 64-byte line of xp
    is written whole before the next (depth pairs outer): row by row, a row block of a deep product (16 rows x 4864
    depth: 155 KiB, past L1) had every line written 16 times from L2, which cost the AMX down projection [256, 4864]
    x [896, 4864] 0.78 ms of its 1.7 (0.29 now)."""
    for rb in T.parallel(xp.shape[0]):
        for d, r in T.grid(xp.shape[1], PAIR_ROWS):
            for p in T.vectorized(2):
                xp[rb, d, r, p] = bf16_bits(x[rb * PAIR_ROWS + r, d * 2 + p])


@T.macro
def nibble_table(table):
    """table[i] = the bits of the bfloat16 of i, exact, for the 2 x PAIR_ROWS indices one vpermw looks up."""
    for i in range(2 * PAIR_ROWS):
        table[i] = bf16_bits(T.Cast("float32", i))


def nibble_pairs(table, words, n):
    """Nibble n of each of PAIR_ROWS words of the pairs layout (ir.packing: its two 4-bit values of one column, of
    depth 2p and 2p + 1) as a pair of exact bfloat16 per word: one vpermw of `nibble_table` (a uint32 vector)."""
    lanes = PAIR_ROWS
    return T.reinterpret(f"uint32x{lanes}", T.call_llvm_pure_intrin(
        f"uint16x{2 * lanes}", "llvm.x86.avx512.permvar.hi.512", table[T.ramp(0, 1, 2 * lanes)],
        T.reinterpret(f"uint16x{2 * lanes}", _pair_nibbles(words, n))))


def _pair_nibbles(words, n):
    """Nibble n of PAIR_ROWS words of the pairs layout as a uint32 vector: each 16-bit half its 4-bit value."""
    lanes = PAIR_ROWS
    return T.bitwise_and(T.shift_right(T.reinterpret(f"uint32x{lanes}", words), T.broadcast(
        T.uint32(4) * T.Cast("uint32", n), lanes)), T.broadcast(T.uint32(PAIR_MASK), lanes))


def group_value_pairs(table, qw, task, g, p, n, planes: int, group_pairs: int, words: int):
    """Nibble n of the `words` words of row pair p of group g of x in column tile `task` of a packed weight `qw`
    (pairs layout, ir.packing): pairs of its exact values in bfloat16, a weight of two planes' as 16 h + l."""
    if planes == 1:
        return nibble_pairs(table, qw[task, g * group_pairs + p, T.ramp(0, 1, words)], n)
    return byte_pairs(qw[task, 2 * g * group_pairs + p, T.ramp(0, 1, words)],
                      qw[task, (2 * g + 1) * group_pairs + p, T.ramp(0, 1, words)], n)


def byte_pairs(high, low, n):
    """Nibble n of PAIR_ROWS words of a weight's two planes (ir.packing: `high` and `low`, the same rows of its high
    and low plane) as the pairs of exact bfloat16 of their values 16 h + l (0..255, exact in bfloat16's 8 bits)."""
    lanes = PAIR_ROWS
    values = T.bitwise_or(T.shift_left(_pair_nibbles(high, n), T.broadcast(T.uint32(4), lanes)),
                          _pair_nibbles(low, n))

    def bf16_of(half):  # the float32 of each 16-bit value (exact), its bits
        return T.reinterpret(f"uint32x{lanes}", T.Cast(f"float32x{lanes}", T.Cast(f"int32x{lanes}", half)))

    return T.bitwise_or(T.shift_right(bf16_of(T.bitwise_and(values, T.broadcast(T.uint32(0xFFFF), lanes))),
                                      T.broadcast(T.uint32(16), lanes)),
                        T.bitwise_and(bf16_of(T.shift_right(values, T.broadcast(T.uint32(16), lanes))),
                                      T.broadcast(T.uint32(0xFFFF0000), lanes)))


def group_scale(read, g, group: int, levels: bool):
    """The float32 scale (or offset) of group g (of `group` rows) of one column, `read(row)` giving the element of
    that column at a row of its scales part: the element, or, two-level (`levels`, ir.packing), its block's float
    times its signed byte."""
    if not levels:
        return tirx.Cast("float32", read(g))
    block, word, shift = block_scale_rows(g, group)
    byte = tirx.shift_right(tirx.shift_left(read(word), 24 - shift), 24)  # sign-extended: arithmetic shifts
    return tirx.reinterpret("float32", read(block)) * tirx.Cast("float32", byte)


def packed_groups(x_buf, s_buf, pairs: int) -> tuple[int, int, int]:
    """(planes, groups of x, rows a group) of a packed weight of `pairs` packed row pairs in the pairs layout, its
    scales part `s_buf` (int32: two-level, ir.packing), multiplied with x `x_buf`."""
    k = int(x_buf.shape[1])
    groups = scale_groups(int(s_buf.shape[1]), k, two_level(s_buf))
    return 2 * pairs // k, groups, k // groups


def group_product(zeros, scales, task, g, n, word, tile: int, sum_xq, sum_x, planes: int = 1, whole: bool = False,
                  group: int = 0):
    """A group's sum of x * W[column] for the column of word `word` in nibble n of column tile `task` (the pairs
    layout, ir.packing), from x's sum with the 4-bit values (sum_xq) and x's own sum (sum_x): s * (sum_xq - z *
    sum_x) with AWQ zero points, s * sum_xq + m * sum_x with an affine kind's offsets (`zeros` of a float dtype).
    g is a packed group: with two `planes`, plane g % 2 of x's group g // 2, whose scale s is 16 times the logical
    group's for the high plane (0), whose offset m counts on the low plane (1) only; or, `whole`, g is a group of x
    and sum_xq its sum with the values 16 h + l (`byte_pairs`): z = 16 z_h + z_l. Two-level scales and offsets
    (ir.packing, int32 words: offsets shaped as the scales, zero points never) take the rows of a group (`group`)."""
    index = pair_order(task, n, word, tile)
    logical = g if whole else g // planes
    levels = two_level(scales)
    scale = group_scale(lambda row: scales[pair_scale(index, row, tile)], logical, group, levels)
    low = None if whole or planes == 1 else g % planes == planes - 1  # whether g is a low plane, where it varies
    if low is not None:
        scale = scale * T.Select(low, T.float32(1), T.float32(16))
    if zeros.dtype != "int32" or two_level(zeros, scales):
        offset = group_scale(lambda row: zeros[pair_scale(index, row, tile)], logical, group, levels) * sum_x
        return scale * sum_xq + (offset if low is None else T.Select(low, offset, T.float32(0)))
    if whole:  # the row pair of packed groups 2g (high: its even row) and 2g + 1 (low: its odd row)
        zero = pair_value(zeros[task, g, word], 0, n) * 16 + pair_value(zeros[task, g, word], 1, n)
    else:
        zero = pair_value(zeros[task, g // 2, word], g, n)
    return scale * (sum_xq - sum_x * T.Cast("float32", zero))


def packed_weight(func: tirx.PrimFunc) -> bool:
    """Whether a `linear` kernel takes its weight packed (ir.packing: int32 words, zeros and scales)."""
    return func.params[1].dtype == "int32"


def paired_weight(func: tirx.PrimFunc) -> bool:
    """Whether a packed `linear` kernel's weight is in the pairs layout (ir.packing awq_int4_pairs, affine_int4_pairs):
    its zero points or offsets laid out per column tile (3-D), where the GPU layout has them [groups, columns]."""
    return len(func.params[2].shape) == 3


SQUARE = 16  # rows and columns of a block that `transpose` turns: one AVX-512 vector per row


def _swapped(a, b, half: int, high: bool):
    """Rows a and b of a tile (vectors) with the blocks of `half` columns off their diagonal swapped: row a's upper
    halves replaced by b's lower ones (`high` False), or b's lower halves by a's upper ones (`high` True)."""
    if high:
        order = [k + half if k & half == 0 else SQUARE + k for k in range(SQUARE)]
    else:
        order = [k if k & half == 0 else SQUARE + k - half for k in range(SQUARE)]
    return tirx.Shuffle([a, b], order)


def _upper_row(p, half: int):
    """The upper row of pair p of a swap pass: pairs are rows `half` apart, in runs of `half`."""
    return p // half * 2 * half + p % half


@T.macro
def _swap_pass(src, dst, half):
    """dst = src with the off-diagonal blocks of `half` columns of each pair of rows `half` apart swapped."""
    for p in T.unroll(SQUARE // 2):
        dst[_upper_row(p, half), T.ramp(0, 1, SQUARE)] = _swapped(
            src[_upper_row(p, half), T.ramp(0, 1, SQUARE)], src[_upper_row(p, half) + half, T.ramp(0, 1, SQUARE)],
            half, False)
        dst[_upper_row(p, half) + half, T.ramp(0, 1, SQUARE)] = _swapped(
            src[_upper_row(p, half), T.ramp(0, 1, SQUARE)], src[_upper_row(p, half) + half, T.ramp(0, 1, SQUARE)],
            half, True)


@T.macro
def transpose(t0, t1):
    """t0 (SQUARE x SQUARE float32, a vector per row) transposed in place, through t1: four passes of blocks of 8,
    4, 2 and 1 columns (64 two-vector shuffles; read column by column, a tile took 256 scalar loads and 240
    inserts)."""
    _swap_pass(t0, t1, 8)
    _swap_pass(t1, t0, 4)
    _swap_pass(t0, t1, 2)
    _swap_pass(t1, t0, 1)
