"""One compute definition per IR op: concrete input types in, an unscheduled TensorIR PrimFunc out.

Every kernel takes its op's inputs in order (int32 scalars as scalar params), then any constant
tensors the op needs (`Kernel.constants`), then writes fresh outputs; in-place ops (`kv_append`,
`paged_kv_append`) write into their input instead. Float math is float32; weights are widened where they are read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from tvm import te, tirx
from tvm.script import tirx as T

from ir import TensorType

F32 = "float32"


@dataclass
class Kernel:
    """A PrimFunc for one op signature, plus constant tensors passed after the op's inputs."""

    func: tirx.PrimFunc
    constants: list[np.ndarray] = field(default_factory=list)


def _placeholders(types: list[TensorType], names: list[str]) -> list:
    """TE placeholders for tensor inputs and int32 vars for scalar inputs."""
    out = []
    for t, name in zip(types, names):
        out.append(te.var(name, "int32") if t.shape == () else te.placeholder(t.shape, t.dtype, name=name))
    return out


def _f32(x):
    return x if x.dtype == F32 else x.astype(F32)


def embedding(types, attrs) -> Kernel:
    table, ids = _placeholders(types, ["table", "ids"])
    y = te.compute((ids.shape[0], table.shape[1]), lambda i, h: _f32(table[ids[i], h]), name="embedding")
    return Kernel(te.create_prim_func([table, ids, y]))


def _normalize(x, w, eps, name):
    rows, hidden = x.shape[0], int(x.shape[1])
    k = te.reduce_axis((0, hidden), "k")
    ss = te.compute((rows,), lambda i: te.sum(x[i, k] * x[i, k], axis=k), name=f"{name}_sumsq")
    return te.compute((rows, hidden), lambda i, h: x[i, h] * te.rsqrt(ss[i] / float(hidden) + eps) * _f32(w[h]), name=name)


def rms_norm(types, attrs) -> Kernel:
    x, w = _placeholders(types, ["x", "weight"])
    return Kernel(te.create_prim_func([x, w, _normalize(x, w, attrs["eps"], "rms_norm")]))


def add_rms_norm(types, attrs) -> Kernel:
    x, r, w = _placeholders(types, ["x", "residual", "weight"])
    s = te.compute(x.shape, lambda i, h: x[i, h] + r[i, h], name="residual_add")
    return Kernel(te.create_prim_func([x, r, w, s, _normalize(s, w, attrs["eps"], "rms_norm")]))


def linear(types, attrs) -> Kernel:
    x, w, *bias = _placeholders(types, ["x", "weight", "bias"])
    k = te.reduce_axis((0, x.shape[1]), "k")
    y = te.compute((x.shape[0], w.shape[0]), lambda i, j: te.sum(x[i, k] * _f32(w[j, k]), axis=k), name="matmul")
    if bias:
        b = bias[0]
        y = te.compute(y.shape, lambda i, j: y[i, j] + _f32(b[j]), name="bias_add")
    return Kernel(te.create_prim_func([x, w, *bias, y]))


def rope(types, attrs) -> Kernel:
    x, pos = _placeholders(types, ["x", "pos"])
    position = (lambda i: pos + i) if types[1].shape == () else (lambda i: pos[i])
    freqs = np.asarray(attrs["inv_freq"], dtype=np.float32)
    half, head_dim = len(freqs), attrs["head_dim"]
    inv = te.placeholder((half,), F32, name="inv_freq")

    def rotate(i, c):
        d = c % head_dim
        base = c - d
        angle = position(i).astype(F32) * inv[d % half]
        partner = tirx.if_then_else(d < half, -x[i, base + d + half], x[i, base + d - half])
        rotated = x[i, c] * te.cos(angle) + partner * te.sin(angle)
        return tirx.if_then_else(d < 2 * half, rotated, x[i, c])

    y = te.compute(x.shape, rotate, name="rope")
    return Kernel(te.create_prim_func([x, pos, inv, y]), [freqs])


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
                   lambda h, i, j: te.sum(q[i, h * dim + d] * key(i, j, (h // group) * dim + d), axis=d), name="scores")
    masked = te.compute((heads, rows, length), lambda h, i, j: tirx.if_then_else(
        visible(i, j), s[h, i, j] * attrs["scale"], tirx.min_value(F32)), name="masked")
    j = te.reduce_axis((0, length), "j")
    m = te.compute((heads, rows), lambda h, i: te.max(masked[h, i, j], axis=j), name="row_max")
    e = te.compute((heads, rows, length), lambda h, i, jj: te.exp(masked[h, i, jj] - m[h, i]), name="exp")
    j2 = te.reduce_axis((0, length), "j2")
    total = te.compute((heads, rows), lambda h, i: te.sum(e[h, i, j2], axis=j2), name="row_sum")
    j3 = te.reduce_axis((0, length), "j3")
    acc = te.compute((rows, heads * dim), lambda i, c: te.sum(tirx.if_then_else(  # never read hidden slots: may be NaN
        visible(i, j3), e[c // dim, i, j3] * value(i, j3, (c // dim // group) * dim + c % dim), 0.0), axis=j3),
        name="weighted")
    return te.compute((rows, heads * dim), lambda i, c: acc[i, c] / total[c // dim, i], name="attention")


def attention(types, attrs) -> Kernel:
    q, kc, vc, pos, n = _placeholders(types, ["q", "k_cache", "v_cache", "pos", "n"])
    out = _attend(q, attrs, pos + n, lambda i, j, c: kc[j, c], lambda i, j, c: vc[j, c], lambda i, j: j <= pos + i)
    return Kernel(te.create_prim_func([q, kc, vc, pos, n, out]))


def paged_attention(types, attrs) -> Kernel:
    q, kp, vp, table, row_of, pos_of = _placeholders(types, ["q", "k_pages", "v_pages", "block_table", "row_of",
                                                             "pos_of"])
    block, pages_per_row = int(kp.shape[1]), int(table.shape[1])

    def page(i, j):  # padded table entries are negative: read page 0, the mask hides it
        return tirx.max(table[row_of[i], j // block], 0)

    out = _attend(q, attrs, pages_per_row * block, lambda i, j, c: kp[page(i, j), j % block, c],
                  lambda i, j, c: vp[page(i, j), j % block, c], lambda i, j: j <= pos_of[i])
    return Kernel(te.create_prim_func([q, kp, vp, table, row_of, pos_of, out]))


def kv_append(types, attrs) -> Kernel:
    cache_t, new_t = types[0], types[1]
    ctx, width = cache_t.shape
    rows = new_t.shape[0]

    @T.prim_func(s_tir=True)
    def func(cache: T.Buffer((ctx, width), "float32"), new: T.Buffer((rows, width), "float32"), pos: T.int32, n: T.int32):
        for i, c in T.grid(rows, width):
            with T.sblock("kv_append"):
                vi, vc = T.axis.remap("SS", [i, c])
                if vi < n:
                    cache[pos + vi, vc] = new[vi, vc]

    return Kernel(func)


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


def take_last(types, attrs) -> Kernel:
    x, n = _placeholders(types, ["x", "n"])
    return Kernel(te.create_prim_func([x, n, te.compute((1, x.shape[1]), lambda _, c: x[n - 1, c], name="take_last")]))


KERNELS = {
    "embedding": embedding, "rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "linear": linear, "rope": rope,
    "attention": attention, "kv_append": kv_append, "silu_mul": silu_mul, "add": add, "take_last": take_last,
    "paged_kv_append": paged_kv_append, "paged_attention": paged_attention, "take_rows": take_rows,
}


def make_kernel(kind: str, types: list[TensorType], attrs: dict) -> Kernel:
    """The unscheduled kernel for one op signature (all dims concrete)."""
    kernel = KERNELS[kind](types, attrs)
    kernel.func = kernel.func.with_attr("tirx.noalias", True)
    return kernel


__all__ = ["KERNELS", "Kernel", "make_kernel"]
