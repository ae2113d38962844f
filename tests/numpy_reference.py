"""Independent numpy definitions of every IR op, the reference the compiled kernels are checked against."""

from __future__ import annotations

import numpy as np


def f32(a):
    return np.asarray(a).astype(np.float32)


def embedding(table, ids):
    return f32(table)[ids]


def rms_norm(x, w, eps, group=None, weight_offset=0.0):
    rows, width = x.shape
    g = x.reshape(rows, -1, group or width)
    y = g / np.sqrt(np.mean(g * g, axis=-1, keepdims=True) + eps) * (f32(w) + weight_offset)
    return y.reshape(rows, width)


def add_rms_norm(x, r, w, eps):
    s = x + r
    return s, rms_norm(s, w, eps)


def linear(x, w, b=None):
    y = x @ f32(w).T
    return y if b is None else y + f32(b)


def rope(x, pos, head_dim, inv_freq):
    inv_freq = np.asarray(inv_freq, dtype=np.float32)
    half = len(inv_freq)
    t, f = x.shape
    heads = x.reshape(t, f // head_dim, head_dim).copy()
    angle = (pos + np.arange(t, dtype=np.float32))[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    a, b = heads[..., :half].copy(), heads[..., half:2 * half].copy()
    heads[..., :half] = a * cos - b * sin
    heads[..., half:2 * half] = b * cos + a * sin
    return heads.reshape(t, f)


def attention(q, k_cache, v_cache, pos, n, num_heads, num_kv_heads, head_dim, scale):
    t = q.shape[0]
    ctx = pos + n
    group = num_heads // num_kv_heads
    qh = q.reshape(t, num_heads, head_dim)
    k = k_cache[:ctx].reshape(ctx, num_kv_heads, head_dim)
    v = v_cache[:ctx].reshape(ctx, num_kv_heads, head_dim)
    out = np.zeros_like(qh)
    for h in range(num_heads):
        s = qh[:, h] @ k[:, h // group].T * scale
        s = np.where(np.arange(ctx)[None, :] <= pos + np.arange(t)[:, None], s, -np.inf)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ v[:, h // group]
    return out.reshape(t, num_heads * head_dim)


def silu_mul(g, u):
    return g / (1 + np.exp(-g)) * u


def add(a, b):
    return a + b


def rope_at(x, positions, head_dim, inv_freq):
    """rope with one position per row."""
    return np.concatenate([rope(x[i:i + 1], int(p), head_dim, inv_freq) for i, p in enumerate(positions)])


def paged_kv_append(pages, new, slots):
    out = pages.copy()
    block = pages.shape[1]
    for row, slot in zip(new, slots):
        if slot >= 0:
            out[slot // block, slot % block] = row
    return out


def paged_attention(q, k_pages, v_pages, table, row_of, pos_of, num_heads, num_kv_heads, head_dim, scale):
    block = k_pages.shape[1]
    out = np.zeros_like(q)
    for t in range(q.shape[0]):
        ctx = pos_of[t] + 1
        pages = table[row_of[t]]
        k = np.stack([k_pages[pages[j // block], j % block] for j in range(ctx)])
        v = np.stack([v_pages[pages[j // block], j % block] for j in range(ctx)])
        out[t] = attention(q[t:t + 1], k, v, ctx - 1, 1, num_heads, num_kv_heads, head_dim, scale)[0]
    return out


def take_rows(x, index):
    return x[index]


def slice_cols(x, period, offset, width):
    rows = x.shape[0]
    return x.reshape(rows, -1, period)[:, :, offset:offset + width].reshape(rows, -1)


def sigmoid_mul(g, x):
    return x / (1 + np.exp(-g))


def causal_conv1d(x, state, w, n):
    """(output, new state): depthwise causal conv over [state; x[:n]], SiLU."""
    keep = state.shape[0]
    seq = np.concatenate([state, x[:n]])
    w = f32(w)[:, 0, :]  # [channels, kernel]
    conv = np.stack([(seq[t:t + keep + 1] * w.T).sum(axis=0) for t in range(n)])
    return conv / (1 + np.exp(-conv)), seq[-keep:]


def delta_inputs(qkv, a, b, a_log, dt_bias, n, num_k_heads, k_dim):
    """(normalised q (scaled) and k, gates [rows, heads, (g, beta)]) of the gated delta rule."""
    rows = qkv.shape[0]
    qk = qkv[:, :2 * num_k_heads * k_dim].reshape(rows, 2 * num_k_heads, k_dim)
    qk = qk / np.sqrt((qk * qk).sum(axis=-1, keepdims=True) + 1e-6)
    qk[:, :num_k_heads] *= k_dim ** -0.5
    x = a + f32(dt_bias)
    softplus = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    gates = np.stack([-np.exp(f32(a_log)) * softplus, 1 / (1 + np.exp(-b))], axis=-1)
    gates[n:] = 0
    return qk.reshape(rows, -1), gates


def gated_delta_rule(qk, qkv, gates, state, num_k_heads, num_v_heads, k_dim, v_dim):
    """(output, new state): the recurrence token by token, per value head."""
    rows, ratio = qk.shape[0], num_v_heads // num_k_heads
    q = qk[:, :num_k_heads * k_dim].reshape(rows, num_k_heads, k_dim)
    k = qk[:, num_k_heads * k_dim:].reshape(rows, num_k_heads, k_dim)
    v = qkv[:, 2 * num_k_heads * k_dim:].reshape(rows, num_v_heads, v_dim)
    s = state.astype(np.float64).copy()
    out = np.zeros((rows, num_v_heads, v_dim))
    for t in range(rows):
        for h in range(num_v_heads):
            kh = h // ratio
            s[h] *= np.exp(gates[t, h, 0])
            delta = (v[t, h] - k[t, kh] @ s[h]) * gates[t, h, 1]
            s[h] += np.outer(k[t, kh], delta)
            out[t, h] = q[t, kh] @ s[h]
    return out.reshape(rows, -1).astype(np.float32), s.astype(np.float32)


def _batch_recurrent(one, inputs, pool, seqs):
    """Run `one(rows_of_inputs, state) -> (out, state)` per sequence (start, count, pos, slot) of a batch."""
    pool = pool.copy()
    outs = {}
    for start, count, pos, slot in zip(*seqs):
        if count == 0:
            continue
        state = pool[slot] if pos > 0 else np.zeros_like(pool[slot])
        y, pool[slot] = one([x[start:start + count] for x in inputs], state)
        outs[start] = y
    width = next(iter(outs.values())).shape[1]
    out = np.zeros((inputs[0].shape[0], width), np.float32)
    for start, y in outs.items():
        out[start:start + len(y)] = y
    return out, pool


def batch_causal_conv1d(x, pool, w, *seqs):
    return _batch_recurrent(lambda ins, s: causal_conv1d(ins[0], s, w, len(ins[0])), [x], pool, seqs)


def batch_gated_delta_rule(qk, qkv, gates, pool, *seqs, num_k_heads, num_v_heads, k_dim, v_dim):
    return _batch_recurrent(lambda ins, s: gated_delta_rule(*ins, s, num_k_heads, num_v_heads, k_dim, v_dim),
                            [qk, qkv, gates], pool, seqs)


def gather_pages(pages, table):
    block = pages.shape[1]
    return np.stack([np.concatenate([pages[max(p, 0)] for p in row]) for row in table])[:, :table.shape[1] * block]


def padded_attention(q, k_hist, v_hist, row_of, pos_of, **attrs):
    out = np.zeros_like(q)
    for t in range(q.shape[0]):
        ctx = pos_of[t] + 1
        out[t] = attention(q[t:t + 1], k_hist[row_of[t], :ctx], v_hist[row_of[t], :ctx], ctx - 1, 1, **attrs)[0]
    return out


def rope_axes(x, pos, head_dim, inv_freq, pos_axes):
    """rope whose frequency f turns by the row's position on axis pos_axes[f] (multimodal rotary)."""
    inv_freq = np.asarray(inv_freq, dtype=np.float32)
    half = len(inv_freq)
    t, f = x.shape
    heads = x.reshape(t, f // head_dim, head_dim).copy()
    angle = pos[:, pos_axes].astype(np.float32) * inv_freq[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    a, b = heads[..., :half].copy(), heads[..., half:2 * half].copy()
    heads[..., :half] = a * cos - b * sin
    heads[..., half:2 * half] = b * cos + a * sin
    return heads.reshape(t, f)


def layer_norm(x, w, b, eps):
    mean = x.mean(axis=1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * f32(w) + f32(b)


def gelu(x, approximate):
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    from math import erf
    return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))


def image_attention(q, k, v, images, num_heads, head_dim, scale):
    rows = q.shape[0]
    out = np.zeros_like(q)
    for i in range(rows):
        same = images == images[i]
        for h in range(num_heads):
            cols = slice(h * head_dim, (h + 1) * head_dim)
            s = k[same, cols] @ q[i, cols] * scale
            p = np.exp(s - s.max())
            out[i, cols] = (p / p.sum()) @ v[same, cols]
    return out


def interpolated_embedding(table, index, weight):
    return (f32(table)[index] * weight[..., None]).sum(axis=1)


def merge_rows(x, group):
    return x.reshape(x.shape[0] // group, -1)


def merge_embeddings(embedded, inputs, mask):
    return np.where(mask[:, None] != 0, inputs, embedded)


# AWQ INT4 (AutoAWQ GEMM), unpacked as the format documents it, independently of ir.packing
DOCUMENTED_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def unpack(words: np.ndarray, columns: int) -> np.ndarray:
    """[rows, columns / 8] int32 words -> [rows, columns] 4-bit values."""
    bits = words.view(np.uint32)
    out = np.empty((words.shape[0], columns), np.int64)
    for c in range(columns):
        slot = DOCUMENTED_ORDER.index(c % 8)
        out[:, c] = (bits[:, c // 8] >> (4 * slot)) & 0xF
    return out


def packed_dequantise(qweight, zeros, scales, planes: int = 1, affine: bool = False) -> np.ndarray:
    """The [out, in] matrix (float64) of a packed module: (q - z) * s per group with 4-bit zero points `zeros`, or
    q * s + m (`affine`: `zeros` the float offsets m). With two planes each group's packed rows are its high plane
    (h, zero point z_h) then its low one (l, z_l), and q = 16 h + l, z = 16 z_h + z_l: one scale (and offset) for
    both."""
    if scales.dtype == np.int32:  # two-level scales (and offsets)
        scales = two_level(scales, qweight.shape[0] // planes)
        zeros = two_level(zeros, qweight.shape[0] // planes) if affine else zeros
    columns, groups = scales.shape[1], scales.shape[0]
    group = qweight.shape[0] // planes // groups
    q = unpack(qweight, columns).reshape(groups, planes, group, columns)
    if not affine:
        q = q - unpack(zeros, columns).reshape(groups, planes, 1, columns)
    value = (q * 16 ** np.arange(planes - 1, -1, -1).reshape(1, planes, 1, 1)).sum(axis=1)
    w = value * scales.astype(np.float64)[:, None, :] + (zeros.astype(np.float64)[:, None, :] if affine else 0)
    return np.ascontiguousarray(w.reshape(groups * group, columns).T)


def two_level(words: np.ndarray, depth: int) -> np.ndarray:
    """Two-level scales [blocks * words, columns] int32 of a weight of `depth` input rows (a block per 256) -> the
    float64 scale of each group [groups, columns]: the block's first word as a float32 times the group's signed
    byte, the block's groups' bytes in its next words, first byte first."""
    blocks, columns = depth // 256, words.shape[1]
    per_block = words.reshape(blocks, -1, columns)
    d = per_block[:, 0].view(np.float32).astype(np.float64)  # [blocks, columns]
    c = np.ascontiguousarray(per_block[:, 1:].transpose(0, 2, 1)).view(np.int8)  # [blocks, columns, groups]
    return (d[:, None, :] * c.transpose(0, 2, 1)).reshape(-1, columns)


def two_level_words(d: np.ndarray, c: np.ndarray) -> np.ndarray:
    """The inverse of `two_level`: floats d [blocks, columns] and signed bytes c [blocks, groups a block, columns]
    -> words [blocks * (1 + groups a block / 4), columns]."""
    bytes_ = np.ascontiguousarray(c.astype(np.int8).transpose(0, 2, 1)).view(np.int32).transpose(0, 2, 1)
    return np.concatenate([d.astype(np.float32).view(np.int32)[:, None, :], bytes_], axis=1).reshape(-1, d.shape[1])


def pack(values: np.ndarray) -> np.ndarray:
    """[rows, columns] 4-bit values -> [rows, columns / 8] int32 words (the inverse of `unpack`)."""
    words = np.zeros((values.shape[0], values.shape[1] // 8), np.uint32)
    for c in range(values.shape[1]):
        words[:, c // 8] |= values[:, c].astype(np.uint32) << np.uint32(4 * DOCUMENTED_ORDER.index(c % 8))
    return words.view(np.int32)


def two_plane_parts(rng, columns: int, depth: int, group: int, affine: bool) -> list[np.ndarray]:
    """The stored parts (qweight, qzeros or offsets, scales) of a random [columns, depth] weight of 8-bit values u =
    16 h + l as two planes (ir.packing): each group's high plane (h, zero point Z // 16) then its low plane (l,
    Z % 16), and one scale (or scale and offset) per group."""
    groups = depth // group
    u = rng.integers(0, 256, (groups, group, columns))
    scales = (rng.uniform(0.5, 1.5, (groups, columns)) / 256).astype(np.float16)
    qweight = pack(np.stack([u >> 4, u & 15], axis=1).reshape(2 * depth, columns))
    if affine:
        return [qweight, (rng.standard_normal((groups, columns)) / 8).astype(np.float16), scales]
    z = rng.integers(0, 256, (groups, columns))
    return [qweight, pack(np.stack([z >> 4, z & 15], axis=1).reshape(2 * groups, columns)), scales]
