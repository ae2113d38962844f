"""One compute definition per IR op: concrete input types in, an unscheduled TensorIR PrimFunc out.

Every kernel takes its op's inputs in order, then any constant tensors the op needs (`Kernel.constants`), then
writes fresh outputs; in-place ops (`paged_kv_append`, the recurrent ops' state pools) write into their input
instead. Float math is float32; weights are widened where they are read.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import numpy as np
from tvm import te, tirx
from tvm.script import tirx as T

from ir import TensorType
from ir.ops import delta_chunk
from ir.packing import AWQ_PACK, PAIR_SLOTS, Packing, awq_slot, pair_index, pair_scale, pair_value
from schedules import stages
from schedules.written import group_scale

F32 = "float32"


@dataclass
class Kernel:
    """A PrimFunc for one op signature, plus constant tensors passed after the op's inputs."""

    func: tirx.PrimFunc
    constants: list[np.ndarray] = field(default_factory=list)


def _placeholders(types: list[TensorType], names: list[str]) -> list:
    """TE placeholders for the inputs."""
    return [te.placeholder(t.shape, t.dtype, name=name) for t, name in zip(types, names)]


def _weight_parts(t: TensorType, name: str) -> list:
    """TE placeholders of a weight: the tensor itself, or a packed one's parts (ir.packing)."""
    names = t.packing.part_names if t.packing is not None else (name,)
    return [te.placeholder(part.shape, part.dtype, name=n) for part, n in zip(t.parts(), names)]


def _f32(x):
    return x if x.dtype == F32 else x.astype(F32)


def embedding(types, attrs) -> Kernel:
    """The table's rows of the ids, as float32; a packed (ir.packing) table's unpacked from its parts."""
    table_type, ids_type = types
    parts = _weight_parts(table_type, "table")
    (ids,) = _placeholders([ids_type], ["ids"])
    row = _unpacked(table_type.packing, parts)
    paired = table_type.packing is not None and table_type.packing.paired  # rows in the layout's column order
    y = te.compute((ids.shape[0], table_type.shape[1]),
                   lambda i, h: row(pair_index(ids[i], int(parts[0].shape[2])) if paired else ids[i], h),
                   name="embedding")
    return Kernel(te.create_prim_func([*parts, ids, y]))


def _normalize(x, w, attrs):
    """RMSNorm of each group of features (the whole row by default), scaled by weight + weight_offset."""
    rows, hidden = x.shape[0], int(x.shape[1])
    group, offset = attrs.get("group", hidden), attrs.get("weight_offset", 0.0)
    k = te.reduce_axis((0, group), "k")
    ss = te.compute((rows, hidden // group), lambda i, g: te.sum(x[i, g * group + k] * x[i, g * group + k], axis=k),
                    name="rms_norm_sumsq")
    return te.compute((rows, hidden), lambda i, h: x[i, h] * te.rsqrt(ss[i, h // group] / float(group) + attrs["eps"])
                      * (_f32(w[h % group]) + offset), name=stages.NORM)


def rms_norm(types, attrs) -> Kernel:
    x, w = _placeholders(types, ["x", "weight"])
    return Kernel(te.create_prim_func([x, w, _normalize(x, w, attrs)]))


def add_rms_norm(types, attrs) -> Kernel:
    x, r, w = _placeholders(types, ["x", "residual", "weight"])
    s = te.compute(x.shape, lambda i, h: x[i, h] + r[i, h], name="residual_add")
    return Kernel(te.create_prim_func([x, r, w, s, _normalize(s, w, attrs)]))


def linear(types, attrs) -> Kernel:
    """x @ W.T (+ bias) of a float or packed (ir.packing) weight W [out, in]; a packed one takes its parts."""
    x_type, w_type, *bias_type = types
    x, *bias = _placeholders([x_type, *bias_type], ["x", "bias"])
    w_parts = _weight_parts(w_type, "weight")
    weight = _unpacked(w_type.packing, w_parts)
    if w_type.packing is not None:  # a stage of its own, so a schedule can unpack a tile for many rows (or inline it)
        unpacked = te.compute(w_type.shape, weight, name=stages.DEQUANT)
        weight = lambda j, k: unpacked[j, k]  # noqa: E731
    k = te.reduce_axis((0, x.shape[1]), "k")
    y = te.compute((x.shape[0], w_type.shape[0]), lambda i, j: te.sum(x[i, k] * weight(j, k), axis=k),
                   name=stages.MATMUL)
    if w_type.packing is not None and w_type.packing.paired:  # y's columns in the layout's order
        ordered, tile = y, int(w_parts[0].shape[2])
        y = te.compute(y.shape, lambda i, j: ordered[i, pair_index(j, tile)], name=stages.PAIR_COLUMNS)
    if bias:
        b = bias[0]
        y = te.compute(y.shape, lambda i, j: y[i, j] + _f32(b[j]), name="bias_add")
    return Kernel(te.create_prim_func([x, *w_parts, *bias, y]))


def _unpacked(packing: Packing | None, parts: list):
    """weight(j, k): element [j, k] of the logical weight matrix as float32, read from its parts (of the pairs
    layout: j in the layout's column order, ir.packing.pair_index): (q - z) * s, or q * s + m for an affine kind;
    with two planes (ir.packing), q - z is 16 (h - z_h) + l - z_l, q is 16 h + l."""
    if packing is None:
        return lambda j, k: _f32(parts[0][j, k])
    qweight, zeros, scales = parts
    group, tile = packing.group, int(qweight.shape[2])
    if packing.paired:  # j: a position in the layout's column order (ir.packing.pair_order)
        def value(words, j, row):  # the 4-bit value of row `row` at position j of a pairs-layout tensor
            t, n, word = j // (PAIR_SLOTS * tile), j // tile % PAIR_SLOTS, j % tile
            return pair_value(words[t, row // 2, word], row, n)

        quant = lambda j, r: value(qweight, j, r)  # noqa: E731
        zero = lambda j, r: value(zeros, j, r // group)  # noqa: E731
        element = lambda part, j, row: part[pair_scale(j, row, tile)]  # noqa: E731
    else:
        def nibble(word, j):  # column j lies in nibble slot awq_slot(j % 8) of its word
            return tirx.bitwise_and(tirx.shift_right(word, awq_slot(j % AWQ_PACK) * 4), 15)

        quant = lambda j, r: nibble(qweight[j // AWQ_PACK // tile, r, j // AWQ_PACK % tile], j)  # noqa: E731
        zero = lambda j, r: nibble(zeros[r // group, j // AWQ_PACK], j)  # noqa: E731
        element = lambda part, j, row: part[row, j]  # noqa: E731

    def group_float(part, j, k):  # the scale (or offset) of [j, k]
        return group_scale(lambda row: element(part, j, row), k // group, group, packing.block > 0)

    span = packing.planes * group  # packed rows of one logical group: its planes, one after another (high first)

    def integer(j, k):  # the integer of [j, k] as float32: q - z, or q (affine), over its planes' packed rows
        rows = [k // group * span + p * group + k % group for p in range(packing.planes)]
        planes = [quant(j, r) if packing.affine else quant(j, r) - zero(j, r) for r in rows]
        return functools.reduce(lambda high, low: high * 16 + low, planes).astype(F32)

    if packing.affine:
        return lambda j, k: integer(j, k) * group_float(scales, j, k) + group_float(zeros, j, k)
    return lambda j, k: integer(j, k) * group_float(scales, j, k)


def rope(types, attrs) -> Kernel:
    """Rotary embedding of the first 2 * len(inv_freq) dims of each head (rotate-half form); with `pos_axes`, each
    frequency turns by the row's position on its axis (multimodal rotary), else by the row's one position."""
    x, pos = _placeholders(types, ["x", "pos"])
    freqs = np.asarray(attrs["inv_freq"], dtype=np.float32)
    half, head_dim = len(freqs), attrs["head_dim"]
    inv = te.placeholder((half,), F32, name="inv_freq")
    constants, args = [freqs], [x, pos, inv]
    if "pos_axes" in attrs:
        axes = te.placeholder((half,), "int32", name="pos_axes")
        constants.append(np.asarray(attrs["pos_axes"], dtype=np.int32))
        args.append(axes)
        angle = lambda i, f: pos[i, axes[f]].astype(F32) * inv[f]  # noqa: E731
    else:
        angle = lambda i, f: pos[i].astype(F32) * inv[f]  # noqa: E731
    # cos and sin once per row and frequency, not once per head
    cos = te.compute((x.shape[0], half), lambda i, f: te.cos(angle(i, f)), name="rope_cos")
    sin = te.compute((x.shape[0], half), lambda i, f: te.sin(angle(i, f)), name="rope_sin")

    def rotate(i, c):
        d = c % head_dim
        base = c - d
        partner = tirx.if_then_else(d < half, -x[i, base + d + half], x[i, base + d - half])
        rotated = x[i, c] * cos[i, d % half] + partner * sin[i, d % half]
        return tirx.if_then_else(d < 2 * half, rotated, x[i, c])

    y = te.compute(x.shape, rotate, name="rope")
    return Kernel(te.create_prim_func(args + [y]), constants)


def layer_norm(types, attrs) -> Kernel:
    """(x - mean) / sqrt(variance + eps) * weight + bias over each row (the variance from the centred values)."""
    x, w, b = _placeholders(types, ["x", "weight", "bias"])
    rows, hidden = x.shape[0], int(x.shape[1])
    k, k2 = te.reduce_axis((0, hidden), "k"), te.reduce_axis((0, hidden), "k2")
    mean = te.compute((rows,), lambda i: te.sum(x[i, k] / float(hidden), axis=k), name="layer_norm_mean")
    var = te.compute((rows,), lambda i: te.sum((x[i, k2] - mean[i]) * (x[i, k2] - mean[i]) / float(hidden), axis=k2),
                     name="layer_norm_variance")
    y = te.compute((rows, hidden), lambda i, h: (x[i, h] - mean[i]) * te.rsqrt(var[i] + attrs["eps"]) * _f32(w[h])
                   + _f32(b[h]), name=stages.NORM)
    return Kernel(te.create_prim_func([x, w, b, y]))


def gelu(types, attrs) -> Kernel:
    """GELU: x * Phi(x) with the exact normal CDF (erf), or PyTorch's tanh approximation."""
    (x,) = _placeholders(types, ["x"])
    if attrs["approximate"] == "tanh":
        f = lambda v: 0.5 * v * (1.0 + te.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v * v * v)))  # noqa: E731
    else:
        f = lambda v: 0.5 * v * (1.0 + te.erf(v * (1.0 / math.sqrt(2.0))))  # noqa: E731
    return Kernel(te.create_prim_func([x, te.compute(x.shape, lambda i, c: f(x[i, c]), name="gelu")]))


def image_attention(types, attrs) -> Kernel:
    """Softmax attention of every patch over the patches of its own image (no mask within an image)."""
    q, k, v, images = _placeholders(types, ["q", "k", "v", "images"])
    out = _attend(q, {**attrs, "num_kv_heads": attrs["num_heads"]}, q.shape[0], lambda i, j, c: k[j, c],
                  lambda i, j, c: v[j, c], lambda i, j: images[i] == images[j])
    return Kernel(te.create_prim_func([q, k, v, images, out]))


def interpolated_embedding(types, attrs) -> Kernel:
    """Each row: its taps' table rows weighted and summed (a learned position grid resampled)."""
    table, index, weight = _placeholders(types, ["table", "index", "weight"])
    t = te.reduce_axis((0, index.shape[1]), "t")
    y = te.compute((index.shape[0], table.shape[1]), lambda r, h: te.sum(
        _f32(table[index[r, t], h]) * weight[r, t], axis=t), name="interpolated_embedding")
    return Kernel(te.create_prim_func([table, index, weight, y]))


def merge_rows(types, attrs) -> Kernel:
    """Every `group` consecutive rows side by side as one row."""
    (x,) = _placeholders(types, ["x"])
    group, width = attrs["group"], int(x.shape[1])
    y = te.compute((x.shape[0] // group, width * group), lambda r, c: x[r * group + c // width, c % width],
                   name="merge_rows")
    return Kernel(te.create_prim_func([x, y]))


def merge_embeddings(types, attrs) -> Kernel:
    """The token embeddings, with the rows whose mask is set taken from the input embeddings instead."""
    embedded, inputs, mask = _placeholders(types, ["embedded", "inputs", "mask"])
    y = te.compute(embedded.shape, lambda i, c: tirx.if_then_else(mask[i] != 0, inputs[i, c], embedded[i, c]),
                   name="merge_embeddings")
    return Kernel(te.create_prim_func([embedded, inputs, mask, y]))


def _attend(q, attrs, length, key, value, visible):
    """Softmax attention of every query row over `length` cached positions, one stage per block.

    key(i, j, c) / value(i, j, c) read the cached feature c (a column over the KV heads) at
    position j for query row i; visible(i, j) is the causal mask. The stage names are what the
    schedules look for.
    """
    heads, group, dim = attrs["num_heads"], attrs["num_heads"] // attrs["num_kv_heads"], attrs["head_dim"]
    rows = q.shape[0]
    d = te.reduce_axis((0, dim), "d")
    s = te.compute((heads, rows, length),
                   lambda h, i, j: te.sum(q[i, h * dim + d] * key(i, j, (h // group) * dim + d), axis=d), name=stages.SCORES)
    masked = te.compute((heads, rows, length), lambda h, i, j: tirx.if_then_else(
        visible(i, j), s[h, i, j] * attrs["scale"], tirx.min_value(F32)), name=stages.MASKED)
    j = te.reduce_axis((0, length), "j")
    m = te.compute((heads, rows), lambda h, i: te.max(masked[h, i, j], axis=j), name=stages.ROW_MAX)
    e = te.compute((heads, rows, length), lambda h, i, jj: te.exp(masked[h, i, jj] - m[h, i]), name=stages.EXP)
    j2 = te.reduce_axis((0, length), "j2")
    total = te.compute((heads, rows), lambda h, i: te.sum(e[h, i, j2], axis=j2), name=stages.ROW_SUM)
    j3 = te.reduce_axis((0, length), "j3")
    acc = te.compute((rows, heads * dim), lambda i, c: te.sum(tirx.if_then_else(  # never read hidden slots: may be NaN
        visible(i, j3), e[c // dim, i, j3] * value(i, j3, (c // dim // group) * dim + c % dim), 0.0), axis=j3),
        name=stages.WEIGHTED)
    return te.compute((rows, heads * dim), lambda i, c: acc[i, c] / total[c // dim, i], name=stages.ATTENTION)


def paged_attention(types, attrs) -> Kernel:
    q, kp, vp, table, row_of, pos_of = _placeholders(types, ["q", "k_pages", "v_pages", "block_table", "row_of",
                                                             "pos_of"])
    block, pages_per_row = int(kp.shape[1]), int(table.shape[1])

    def page(i, j):  # padded table entries are negative: read page 0, the mask hides it
        return tirx.max(table[row_of[i], j // block], 0)

    out = _attend(q, attrs, pages_per_row * block, lambda i, j, c: kp[page(i, j), j % block, c],
                  lambda i, j, c: vp[page(i, j), j % block, c], lambda i, j: j <= pos_of[i])
    return Kernel(te.create_prim_func([q, kp, vp, table, row_of, pos_of, out]))


def paged_kv_append(types, attrs) -> Kernel:
    pages_t, new_t = types[0], types[1]
    count, block, width = pages_t.shape
    rows = new_t.shape[0]

    @T.prim_func(s_tir=True)
    def func(pages: T.Buffer((count, block, width), "float32"), new: T.Buffer((rows, width), "float32"),
             slots: T.Buffer((rows,), "int32")):
        for i, c in T.grid(rows, width):
            with T.sblock("paged_kv_append"):
                vi, vc = T.axis.remap("SS", [i, c])
                if slots[vi] >= 0:
                    pages[slots[vi] // block, slots[vi] % block, vc] = new[vi, vc]

    return Kernel(func)


def take_rows(types, attrs) -> Kernel:
    x, index = _placeholders(types, ["x", "index"])
    y = te.compute((index.shape[0], x.shape[1]), lambda r, c: x[index[r], c], name="take_rows")
    return Kernel(te.create_prim_func([x, index, y]))


def silu_mul(types, attrs) -> Kernel:
    g, u = _placeholders(types, ["gate", "up"])
    y = te.compute(g.shape, lambda i, c: g[i, c] * te.sigmoid(g[i, c]) * u[i, c], name="silu_mul")
    return Kernel(te.create_prim_func([g, u, y]))


def add(types, attrs) -> Kernel:
    a, b = _placeholders(types, ["a", "b"])
    return Kernel(te.create_prim_func([a, b, te.compute(a.shape, lambda i, c: a[i, c] + b[i, c], name="add")]))


def slice_cols(types, attrs) -> Kernel:
    (x,) = _placeholders(types, ["x"])
    period, offset, width = attrs["period"], attrs["offset"], attrs["width"]
    y = te.compute((x.shape[0], x.shape[1] // period * width),
                   lambda i, c: x[i, c // width * period + offset + c % width], name="slice_cols")
    return Kernel(te.create_prim_func([x, y]))


def sigmoid_mul(types, attrs) -> Kernel:
    g, x = _placeholders(types, ["gate", "x"])
    y = te.compute(g.shape, lambda i, c: te.sigmoid(g[i, c]) * x[i, c], name="sigmoid_mul")
    return Kernel(te.create_prim_func([g, x, y]))


L2_EPS = 1e-6  # the epsilon of the q/k L2 normalisation in Qwen3.5's gated delta rule


def delta_inputs(types, attrs) -> Kernel:
    """The gated delta rule's per-token inputs: L2-normalised q (times k_dim^-1/2) and k, and the gates
    g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), both 0 on padding rows (>= n)."""
    qkv, a, b, a_log, dt_bias, n = _placeholders(types, ["qkv", "a", "b", "a_log", "dt_bias", "n"])
    hk, dk = attrs["num_k_heads"], attrs["k_dim"]
    d = te.reduce_axis((0, dk), "d")
    sumsq = te.compute((qkv.shape[0], 2 * hk), lambda t, s: te.sum(qkv[t, s * dk + d] * qkv[t, s * dk + d], axis=d),
                       name="qk_sumsq")
    qk = te.compute((qkv.shape[0], 2 * hk * dk), lambda t, c: qkv[t, c] * te.rsqrt(sumsq[t, c // dk] + L2_EPS)
                    * tirx.if_then_else(c < hk * dk, dk ** -0.5, 1.0), name="qk_normed")

    def gate(t, h, e):
        x = a[t, h] + _f32(dt_bias[h])
        y = te.exp(x)  # softplus = log1p(exp(x)) (as series for tiny y: NVPTX has no log1p), x above torch's threshold 20
        softplus = tirx.if_then_else(x > 20.0, x, tirx.if_then_else(y < 1e-4, y * (1.0 - 0.5 * y), te.log(1.0 + y)))
        value = tirx.if_then_else(e == 0, -te.exp(_f32(a_log[h])) * softplus, te.sigmoid(b[t, h]))
        return tirx.if_then_else(t < n[0], value, 0.0)

    gates = te.compute((qkv.shape[0], a.shape[1], 2), gate, name="delta_gates")
    return Kernel(te.create_prim_func([qkv, a, b, a_log, dt_bias, n, qk, gates]))


def _column_scan(hk, hv, dk, dv, lanes):
    """The recurrence for `lanes` state columns (value columns j0.. of head h) over `count` token rows from `first`.

    `col` holds S[:, j0:j0 + lanes] ([k_dim, lanes]), `acc` [2, lanes] and `decay` one scalar: the caller's
    local buffers. The innermost loops run over the lanes, which are independent: they vectorise.
    """
    ratio, key, value = hv // hk, hk * dk, 2 * hk * dk

    @T.macro
    def scan(col, acc, decay, qk, qkv, gates, out, vh, j0, first, count):
        for t in range(count):
            decay[0] = T.exp(gates[first + t, vh, 0])
            for jj in range(lanes):
                acc[0, jj] = T.float32(0)
            for i in range(dk):
                for jj in range(lanes):
                    col[i, jj] = col[i, jj] * decay[0]
                    acc[0, jj] = acc[0, jj] + col[i, jj] * qk[first + t, key + vh // ratio * dk + i]
            for jj in range(lanes):
                acc[0, jj] = (qkv[first + t, value + vh * dv + j0 + jj] - acc[0, jj]) * gates[first + t, vh, 1]
                acc[1, jj] = T.float32(0)
            for i in range(dk):
                for jj in range(lanes):
                    col[i, jj] = col[i, jj] + qk[first + t, key + vh // ratio * dk + i] * acc[0, jj]
                    acc[1, jj] = acc[1, jj] + col[i, jj] * qk[first + t, vh // ratio * dk + i]
            for jj in range(lanes):
                out[first + t, vh * dv + j0 + jj] = acc[1, jj]

    return scan


def batch_gated_delta_rule(types, attrs) -> Kernel:
    """Qwen3.5's gated delta rule for a step: each sequence's tokens in order, from its state slot (zero when it
    starts at position 0), the final state back to its slot.

    Per token t and value head h (reading k head h // (v heads / k heads)), with q, k, g, beta from
    `delta_inputs`: S = S * exp(g); S += k (beta (v - S^T k))^T; out = S^T q. A step of one sequence (a
    prefill chunk of one request) with `chunk` C > 0 runs the equivalent chunked form over chunks of
    gcd(C, rows) tokens: an in-chunk triangular solve, then one state update per chunk (padding rows have
    zero gates, so they leave the state as it is). Otherwise the recurrence runs token by token, one
    (sequence, head, value columns) per task. Each task takes `scan_lanes` neighbouring value columns (see
    make_kernel).
    """
    rows, width = types[1].shape
    slots, seqs = types[3].shape[0], types[4].shape[0]
    hk, hv, dk, dv = (attrs[k] for k in ("num_k_heads", "num_v_heads", "k_dim", "v_dim"))
    lanes = math.gcd(attrs["scan_lanes"], dk, dv)
    chunk = delta_chunk(rows, seqs, attrs["chunk"])
    if chunk:
        return Kernel(_delta_chunked(rows, hk, hv, dk, dv, width, slots, chunk, lanes))
    scan = _column_scan(hk, hv, dk, dv, lanes)

    @T.prim_func(s_tir=True)
    def func(qk: T.Buffer((rows, 2 * hk * dk), "float32"), qkv: T.Buffer((rows, width), "float32"),
             gates: T.Buffer((rows, hv, 2), "float32"), pool: T.Buffer((slots, hv, dk, dv), "float32"),
             seq_start: T.Buffer((seqs,), "int32"), seq_len: T.Buffer((seqs,), "int32"),
             seq_pos: T.Buffer((seqs,), "int32"), seq_slot: T.Buffer((seqs,), "int32"),
             out: T.Buffer((rows, hv * dv), "float32")):
        for r, h, j in T.grid(seqs, hv, dv // lanes):
            with T.sblock("delta_scan"):
                vr, vh, vj = T.axis.remap("SSS", [r, h, j])
                # each sequence reads and writes only its own slot's columns
                T.reads(qk[0:rows, 0:2 * hk * dk], qkv[0:rows, 0:width], gates[0:rows, vh, 0:2], seq_start[vr],
                        seq_len[vr], seq_pos[vr], seq_slot[vr])
                T.writes(pool[0:slots, vh, 0:dk, vj * lanes:vj * lanes + lanes], out[0:rows, vh * dv:vh * dv + dv])
                col = T.alloc_buffer((dk, lanes), "float32", scope="local")
                acc = T.alloc_buffer((2, lanes), "float32", scope="local")
                decay = T.alloc_buffer((1,), "float32", scope="local")
                if seq_len[vr] > 0:
                    for i, jj in T.grid(dk, lanes):
                        col[i, jj] = T.if_then_else(seq_pos[vr] > 0, pool[T.max(seq_slot[vr], 0), vh, i, vj * lanes + jj],
                                                    T.float32(0))
                    scan(col, acc, decay, qk, qkv, gates, out, vh, vj * lanes, seq_start[vr], seq_len[vr])
                    for i, jj in T.grid(dk, lanes):
                        pool[seq_slot[vr], vh, i, vj * lanes + jj] = col[i, jj]

    return Kernel(func)


def batch_causal_conv1d(types, attrs) -> Kernel:
    """The causal conv1d + SiLU for a step: each sequence's tokens in order, its rolling window read from
    its state slot (zeros when it starts at position 0) and written back. A task takes one sequence and
    `scan_lanes` neighbouring channels (see make_kernel), whose innermost loops vectorise; the windows live in
    one buffer of the call (a buffer per task would be a heap allocation per task on a CPU)."""
    rows, channels = types[0].shape
    slots, keep = types[1].shape[:2]
    wdtype, seqs = types[2].dtype, types[3].shape[0]
    lanes = math.gcd(attrs["scan_lanes"], channels)

    @T.prim_func(s_tir=True)
    def func(x: T.Buffer((rows, channels), "float32"), pool: T.Buffer((slots, keep, channels), "float32"),
             w: T.Buffer((channels, 1, keep + 1), wdtype), seq_start: T.Buffer((seqs,), "int32"),
             seq_len: T.Buffer((seqs,), "int32"), seq_pos: T.Buffer((seqs,), "int32"),
             seq_slot: T.Buffer((seqs,), "int32"), y: T.Buffer((rows, channels), "float32")):
        window = T.alloc_buffer((seqs, keep, channels), "float32")
        for r, c in T.grid(seqs, channels // lanes):
            with T.sblock("conv_scan"):
                vr, vc = T.axis.remap("SS", [r, c])
                # each sequence reads and writes only its own slot's window
                T.reads(x[0:rows, vc * lanes:vc * lanes + lanes], w[vc * lanes:vc * lanes + lanes, 0, 0:keep + 1],
                        seq_start[vr], seq_len[vr], seq_pos[vr], seq_slot[vr])
                T.writes(pool[0:slots, 0:keep, vc * lanes:vc * lanes + lanes], y[0:rows, vc * lanes:vc * lanes + lanes],
                         window[vr, 0:keep, vc * lanes:vc * lanes + lanes])
                if seq_len[vr] > 0:
                    for k, lane in T.grid(keep, lanes):
                        window[vr, k, vc * lanes + lane] = T.if_then_else(
                            seq_pos[vr] > 0, pool[T.max(seq_slot[vr], 0), k, vc * lanes + lane], T.float32(0))
                    for t in range(seq_len[vr]):
                        for lane in range(lanes):
                            y[seq_start[vr] + t, vc * lanes + lane] = T.Cast("float32", w[vc * lanes + lane, 0, keep]) \
                                * x[seq_start[vr] + t, vc * lanes + lane]
                        for k, lane in T.grid(keep, lanes):
                            y[seq_start[vr] + t, vc * lanes + lane] = y[seq_start[vr] + t, vc * lanes + lane] + T.Cast(
                                "float32", w[vc * lanes + lane, 0, k]) * window[vr, k, vc * lanes + lane]
                        for lane in range(lanes):
                            y[seq_start[vr] + t, vc * lanes + lane] = y[seq_start[vr] + t, vc * lanes + lane] \
                                * T.sigmoid(y[seq_start[vr] + t, vc * lanes + lane])
                        for k, lane in T.grid(keep - 1, lanes):
                            window[vr, k, vc * lanes + lane] = window[vr, k + 1, vc * lanes + lane]
                        for lane in range(lanes):
                            window[vr, keep - 1, vc * lanes + lane] = x[seq_start[vr] + t, vc * lanes + lane]
                    for k, lane in T.grid(keep, lanes):
                        pool[seq_slot[vr], k, vc * lanes + lane] = window[vr, k, vc * lanes + lane]

    return Kernel(func)


def gather_pages(types, attrs) -> Kernel:
    """Each sequence's KV history gathered from its pages into one padded row (the legacy batch path)."""
    pages, table = _placeholders(types, ["pages", "block_table"])
    block = int(pages.shape[1])
    hist = te.compute((table.shape[0], table.shape[1] * block, pages.shape[2]),
                      lambda r, j, c: pages[tirx.max(table[r, j // block], 0), j % block, c], name="gather_pages")
    return Kernel(te.create_prim_func([pages, table, hist]))


def padded_attention(types, attrs) -> Kernel:
    q, kh, vh, row_of, pos_of = _placeholders(types, ["q", "k_history", "v_history", "row_of", "pos_of"])
    out = _attend(q, attrs, kh.shape[1], lambda i, j, c: kh[row_of[i], j, c], lambda i, j, c: vh[row_of[i], j, c],
                  lambda i, j: j <= pos_of[i])
    return Kernel(te.create_prim_func([q, kh, vh, row_of, pos_of, out]))


def _delta_chunked(rows, hk, hv, dk, dv, width, slots, chunk, lanes):
    """The chunked delta rule of one sequence whose tokens start at row 0."""
    ratio, key, value = hv // hk, hk * dk, 2 * hk * dk

    @T.prim_func(s_tir=True)
    def func(qk: T.Buffer((rows, 2 * hk * dk), "float32"), qkv: T.Buffer((rows, width), "float32"),
             gates: T.Buffer((rows, hv, 2), "float32"), pool: T.Buffer((slots, hv, dk, dv), "float32"),
             seq_start: T.Buffer((1,), "int32"), seq_len: T.Buffer((1,), "int32"), seq_pos: T.Buffer((1,), "int32"),
             seq_slot: T.Buffer((1,), "int32"), out: T.Buffer((rows, hv * dv), "float32")):
        decay = T.alloc_buffer((hv, rows), "float32")  # log decay from the chunk's start, inclusive
        scales = T.alloc_buffer((hv, rows, 2), "float32")  # exp(decay), exp(decay at chunk end - decay)
        dots = T.alloc_buffer((2, hk, rows, chunk), "float32")  # k_t . k_s and q_t . k_s, s in t's chunk
        a_mat = T.alloc_buffer((hv, rows, chunk), "float32")  # strictly lower: beta_t k_t . k_s decayed from s to t
        attn = T.alloc_buffer((hv, rows, chunk), "float32")  # lower: q_t . k_s decayed from s to t
        w = T.alloc_buffer((hv, rows, dk), "float32")  # (I + A)^-1 (beta k exp(decay)), per chunk
        u = T.alloc_buffer((hv, rows, dv), "float32")  # (I + A)^-1 (beta v), per chunk
        for h, c, r, s in T.grid(hv, rows // chunk, chunk, chunk):
            with T.sblock("delta_decay"):
                vh, vc, vr, vs = T.axis.remap("SSSR", [h, c, r, s])
                with T.init():
                    decay[vh, vc * chunk + vr] = T.float32(0)
                decay[vh, vc * chunk + vr] = decay[vh, vc * chunk + vr] + T.if_then_else(
                    vs <= vr, gates[vc * chunk + vs, vh, 0], T.float32(0))
        for h, c, r, e in T.grid(hv, rows // chunk, chunk, 2):
            with T.sblock("delta_scales"):
                vh, vc, vr, ve = T.axis.remap("SSSS", [h, c, r, e])
                scales[vh, vc * chunk + vr, ve] = T.exp(T.if_then_else(
                    ve == 0, decay[vh, vc * chunk + vr], decay[vh, vc * chunk + chunk - 1] - decay[vh, vc * chunk + vr]))
        for e, g, c, r, s, i in T.grid(2, hk, rows // chunk, chunk, chunk, dk):
            with T.sblock(stages.DELTA_DOTS):  # e = 0: k_t . k_s, e = 1: q_t . k_s
                ve, vg, vc, vr, vs, vi = T.axis.remap("SSSSSR", [e, g, c, r, s, i])
                with T.init():
                    dots[ve, vg, vc * chunk + vr, vs] = T.float32(0)
                dots[ve, vg, vc * chunk + vr, vs] = dots[ve, vg, vc * chunk + vr, vs] + qk[
                    vc * chunk + vr, (1 - ve) * key + vg * dk + vi] * qk[vc * chunk + vs, key + vg * dk + vi]
        for h, c, r, s in T.grid(hv, rows // chunk, chunk, chunk):
            with T.sblock("delta_a"):
                vh, vc, vr, vs = T.axis.remap("SSSS", [h, c, r, s])
                a_mat[vh, vc * chunk + vr, vs] = T.if_then_else(vs < vr, gates[vc * chunk + vr, vh, 1] * dots[
                    0, vh // ratio, vc * chunk + vr, vs] * T.exp(decay[vh, vc * chunk + vr] - decay[vh, vc * chunk + vs]),
                    T.float32(0))
        for h, c, r, s in T.grid(hv, rows // chunk, chunk, chunk):
            with T.sblock("delta_attn"):
                vh, vc, vr, vs = T.axis.remap("SSSS", [h, c, r, s])
                attn[vh, vc * chunk + vr, vs] = T.if_then_else(vs <= vr, dots[1, vh // ratio, vc * chunk + vr, vs] * T.exp(
                    decay[vh, vc * chunk + vr] - decay[vh, vc * chunk + vs]), T.float32(0))
        for h, c, e in T.grid(hv, rows // chunk, (dk + dv) // lanes):
            with T.sblock("delta_solve"):  # forward substitution for `lanes` right-hand-side columns (of k, then v)
                vh, vc, ve = T.axis.remap("SSS", [h, c, e])
                T.reads(gates[vc * chunk:vc * chunk + chunk, vh, 0:2], qk[vc * chunk:vc * chunk + chunk, 0:2 * hk * dk],
                        qkv[vc * chunk:vc * chunk + chunk, 0:width], scales[vh, vc * chunk:vc * chunk + chunk, 0:2],
                        a_mat[vh, vc * chunk:vc * chunk + chunk, 0:chunk])
                T.writes(w[vh, vc * chunk:vc * chunk + chunk, 0:dk], u[vh, vc * chunk:vc * chunk + chunk, 0:dv])
                x = T.alloc_buffer((chunk, lanes), "float32", scope="local")
                for r in range(chunk):
                    for jj in range(lanes):
                        x[r, jj] = gates[vc * chunk + r, vh, 1] * T.if_then_else(
                            ve * lanes < dk, qk[vc * chunk + r, key + vh // ratio * dk + T.min(ve * lanes + jj, dk - 1)]
                            * scales[vh, vc * chunk + r, 0],
                            qkv[vc * chunk + r, value + vh * dv + T.max(ve * lanes + jj - dk, 0)])
                    for s in range(r):
                        for jj in range(lanes):
                            x[r, jj] = x[r, jj] - a_mat[vh, vc * chunk + r, s] * x[s, jj]
                for r, jj in T.grid(chunk, lanes):
                    if ve * lanes < dk:
                        w[vh, vc * chunk + r, ve * lanes + jj] = x[r, jj]
                    else:
                        u[vh, vc * chunk + r, ve * lanes + jj - dk] = x[r, jj]
        for h, j in T.grid(hv, dv // lanes):
            with T.sblock("delta_scan"):  # state columns j * lanes.. of head h, one update per chunk
                vh, vj = T.axis.remap("SS", [h, j])
                T.reads(u[vh, 0:rows, vj * lanes:vj * lanes + lanes], w[vh, 0:rows, 0:dk], qk[0:rows, 0:2 * hk * dk],
                        scales[vh, 0:rows, 0:2], attn[vh, 0:rows, 0:chunk], seq_pos[0],
                        seq_slot[0])  # and its own state columns, read first
                T.writes(pool[0:slots, vh, 0:dk, vj * lanes:vj * lanes + lanes], out[0:rows, vh * dv:vh * dv + dv])
                col = T.alloc_buffer((dk, lanes), "float32", scope="local")
                fresh = T.alloc_buffer((chunk, lanes), "float32", scope="local")
                acc = T.alloc_buffer((lanes,), "float32", scope="local")
                for i, jj in T.grid(dk, lanes):
                    col[i, jj] = T.if_then_else(seq_pos[0] > 0, pool[T.max(seq_slot[0], 0), vh, i, vj * lanes + jj],
                                                T.float32(0))
                for c in range(rows // chunk):
                    for r in range(chunk):  # the new values: what the state does not already predict
                        for jj in range(lanes):
                            fresh[r, jj] = u[vh, c * chunk + r, vj * lanes + jj]
                        for i in range(dk):
                            for jj in range(lanes):
                                fresh[r, jj] = fresh[r, jj] - w[vh, c * chunk + r, i] * col[i, jj]
                    for r in range(chunk):
                        for jj in range(lanes):
                            acc[jj] = T.float32(0)
                        for i in range(dk):
                            for jj in range(lanes):
                                acc[jj] = acc[jj] + qk[c * chunk + r, vh // ratio * dk + i] * col[i, jj]
                        for jj in range(lanes):
                            acc[jj] = acc[jj] * scales[vh, c * chunk + r, 0]
                        for s in range(r + 1):
                            for jj in range(lanes):
                                acc[jj] = acc[jj] + attn[vh, c * chunk + r, s] * fresh[s, jj]
                        for jj in range(lanes):
                            out[c * chunk + r, vh * dv + vj * lanes + jj] = acc[jj]
                    for i in range(dk):
                        for jj in range(lanes):
                            col[i, jj] = col[i, jj] * scales[vh, c * chunk + chunk - 1, 0]
                        for r in range(chunk):
                            for jj in range(lanes):
                                col[i, jj] = col[i, jj] + qk[c * chunk + r, key + vh // ratio * dk + i] * scales[
                                    vh, c * chunk + r, 1] * fresh[r, jj]
                for i, jj in T.grid(dk, lanes):
                    pool[seq_slot[0], vh, i, vj * lanes + jj] = col[i, jj]

    return func


KERNELS = {
    "embedding": embedding, "rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "linear": linear, "rope": rope,
    "silu_mul": silu_mul, "add": add, "paged_kv_append": paged_kv_append, "paged_attention": paged_attention,
    "take_rows": take_rows, "slice_cols": slice_cols, "sigmoid_mul": sigmoid_mul, "delta_inputs": delta_inputs,
    "batch_causal_conv1d": batch_causal_conv1d,
    "batch_gated_delta_rule": batch_gated_delta_rule, "gather_pages": gather_pages, "padded_attention": padded_attention,
    "layer_norm": layer_norm, "gelu": gelu, "image_attention": image_attention,
    "interpolated_embedding": interpolated_embedding, "merge_rows": merge_rows, "merge_embeddings": merge_embeddings,
}


def make_kernel(kind: str, types: list[TensorType], attrs: dict, scan_lanes: int = 1) -> Kernel:
    """The unscheduled kernel for one op signature (all dims concrete).

    `scan_lanes`: how many independent columns one task of a sequential scan (the delta rule, the causal conv)
    carries in its innermost loops: a few SIMD vectors on a CPU (compiler.target.CpuTarget.scan_lanes), 1 on a GPU (a
    thread per column).
    """
    kernel = KERNELS[kind](types, {**attrs, "scan_lanes": scan_lanes})
    kernel.func = kernel.func.with_attr("tirx.noalias", True)
    return kernel


__all__ = ["KERNELS", "Kernel", "make_kernel"]
