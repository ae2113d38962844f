"""Independent numpy definitions of every IR op, the reference the compiled kernels are checked against."""

from __future__ import annotations

import numpy as np


def f32(a):
    return np.asarray(a).astype(np.float32)


def embedding(table, ids):
    return f32(table)[ids]


def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * f32(w)


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


def kv_append(cache, new, pos, n):
    out = cache.copy()
    out[pos:pos + n] = new[:n]
    return out


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


def take_last(x, n):
    return x[n - 1:n]


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
