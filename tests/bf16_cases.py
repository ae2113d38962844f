"""What the tests of the two bfloat16 paths (AMX tiles, AVX512-BF16 dot products) share: a paged-attention case (a
prompt chunk after a history, with decode rows and padding beside it) checked against numpy with the operands
rounded, an AWQ product's inputs and its exact-weight reference, and a whole model's prefill checked against
transformers."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import numpy_reference as ref

from compiler.kernels import make_kernel
from ir import TensorType
from ir.packing import Packing
from models.tiny import awq_quantize
from runtime import CompiledModel
from runtime.weights import TRANSFORMS

PAGE, FIRST, CHUNK = 16, 45, 64


def chunk_after_history(rng, heads: int, kv_heads: int, head_dim: int) -> tuple[list[np.ndarray], dict, int]:
    """(inputs, attrs, chunk): 96 rows, the first `chunk` a prefill chunk deep in sequence 0 (positions 45..108, two
    32-row blocks), then a decode row of each of two other sequences, then padding; pages scattered in no order and
    NaN in every slot after a sequence's last position."""
    pages, table = rng.permutation(12).astype(np.int32), np.full((3, 8), -1, dtype=np.int32)
    table[0], table[1, :2], table[2, 0] = pages[:8], pages[8:10], pages[10]
    k_pages = (rng.standard_normal((12, PAGE, kv_heads * head_dim)) * 2).astype(np.float32)
    v_pages = rng.standard_normal((12, PAGE, kv_heads * head_dim)).astype(np.float32)
    row_of, pos_of = np.zeros(96, dtype=np.int32), np.zeros(96, dtype=np.int32)
    pos_of[:CHUNK] = np.arange(FIRST, FIRST + CHUNK)
    row_of[CHUNK:CHUNK + 2], pos_of[CHUNK:CHUNK + 2] = [1, 2], [20, 9]  # decode rows; then padding
    for seq, last in ((0, FIRST + CHUNK - 1), (1, 20), (2, 9)):
        for p in range(last + 1, 8 * PAGE):
            if table[seq, p // PAGE] >= 0:
                k_pages[table[seq, p // PAGE], p % PAGE] = v_pages[table[seq, p // PAGE], p % PAGE] = np.nan
    q = rng.standard_normal((96, heads * head_dim)).astype(np.float32)
    attrs = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim, "scale": head_dim ** -0.5}
    return [q, k_pages, v_pages, table, row_of, pos_of], attrs, CHUNK


def rounded_attention(q, k_pages, v_pages, table, row_of, pos_of, num_heads, num_kv_heads, head_dim, scale):
    """Paged attention with q (scaled), keys, probabilities and values rounded to bfloat16, each row divided by the
    sum of its rounded probabilities: what the bfloat16 attention kernels compute, in float64."""
    def bf16(x):
        return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)

    page, group, out = k_pages.shape[1], num_heads // num_kv_heads, np.zeros_like(q)
    for t in range(q.shape[0]):
        slots = [(table[row_of[t], j // page], j % page) for j in range(pos_of[t] + 1)]
        for h in range(num_heads):
            columns = slice(h // group * head_dim, (h // group + 1) * head_dim)
            keys = bf16(np.stack([k_pages[p, s, columns] for p, s in slots]))
            values = bf16(np.stack([v_pages[p, s, columns] for p, s in slots]))
            scores = keys @ bf16(q[t, h * head_dim:(h + 1) * head_dim] * np.float32(scale))
            weights = bf16(np.exp(scores - scores.max()))
            out[t, h * head_dim:(h + 1) * head_dim] = weights @ values / weights.sum()
    return out


def assert_chunk_rounded_and_rows_float32(got: np.ndarray, inputs: list[np.ndarray], attrs: dict, chunk: int) -> None:
    """The chunk's rows as the rounded reference (and off the exact one: they really were rounded), every other row
    as float32 attention. A probability within float32 error (the kernel's exp is not numpy's) of a point halfway
    between two bfloat16 values may round the other way, one bfloat16 step (2 ** -8) of that weight: seen up to
    5.6e-4 of the largest output (6 heads of 48, with the data another selection of tests leaves the shared
    generator; most cases under 1e-5), so within 1e-3, where the unrounded attention is 3.5e-3 to 6e-3 away."""
    rounded = rounded_attention(*inputs, **attrs)
    exact = ref.paged_attention(*inputs, **attrs)
    top = float(np.abs(exact).max())
    np.testing.assert_allclose(got[:chunk], rounded[:chunk], rtol=0, atol=1e-3 * top)
    assert np.abs(got[:chunk] - exact[:chunk]).max() > 1e-3 * top
    np.testing.assert_allclose(got[chunk:], exact[chunk:], rtol=0, atol=1e-5 * top)


def assert_bf16_prefill_tracks(ours: CompiledModel, hf, prompt: list[int]) -> None:
    """Prefill logits off transformers' float32 ones by the activations' bfloat16 rounding and no more (so the
    bfloat16 products ran), the same greedy token, and the decode step after it agreeing too."""
    import torch

    cache = ours.new_cache(len(prompt) + 8)
    got = ours.forward(prompt, cache)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
    want = out.logits[0, -1].numpy()
    error = np.abs(got - want).max() / np.abs(want).max()
    assert 1e-4 < error < 2e-2
    token = int(np.argmax(want))
    assert int(np.argmax(got)) == token
    with torch.no_grad():
        want = hf(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True).logits[0, -1].numpy()
    assert int(np.argmax(ours.forward([token], cache))) == int(np.argmax(want))


def packed_parts(rng, packing: Packing, out: int, inp: int) -> list[np.ndarray]:
    """The stored parts (qweight, qzeros or offsets, scales) of a random [out, inp] weight packed as `packing`: AWQ's
    quantiser's for 4-bit values, random 8-bit values as two planes (`numpy_reference.two_plane_parts`); with
    two-level scales (a K-quant's), random floats per block of 256 rows times random signed bytes per group."""
    if packing.planes == 2:
        parts = ref.two_plane_parts(rng, out, inp, packing.group, packing.affine)
    else:
        qweight, qzeros, scales = awq_quantize((rng.standard_normal((out, inp)) / 16).astype(np.float32),
                                               packing.group)
        parts = [qweight, (rng.standard_normal(scales.shape) / 8).astype(np.float16) if packing.affine else qzeros,
                 scales]
    if packing.block:
        blocks, per_block = inp // packing.block, packing.block // packing.group
        level = lambda size: ref.two_level_words(  # noqa: E731
            rng.uniform(0.5, 1.5, (blocks, out)).astype(np.float16) * np.float16(size),
            rng.integers(-128, 128, (blocks, per_block, out)))
        parts[2] = level(2.0 ** -12)
        parts[1] = level(2.0 ** -9) if packing.affine else parts[1]
    return parts


def awq_product_case(rng, rows: int, depth: int, cols: int, group: int, bias: str | None, kind: str,
                     planes: int, block: int = 0) -> tuple:
    """(the `linear` kernel of a weight packed as `kind` with `planes` planes, its inputs as the runtime passes them,
    the product in float64 with x rounded to bfloat16 and the weights exact): one group of x far larger than the
    rest, so a per-group sum of x that went wrong shows."""
    packing = Packing(kind, group, planes, block)
    stored = packed_parts(rng, packing, cols, depth)
    x = rng.standard_normal((rows, depth)).astype(np.float32)
    x[:, :group] *= 3e2
    b = rng.standard_normal(cols).astype(bias) if bias else None
    types = [TensorType((rows, depth), "float32"), TensorType((cols, depth), "float16", packing)]
    kernel = make_kernel("linear", types + ([TensorType((cols,), bias)] if bias else []), {}).func
    inputs = [x, *TRANSFORMS[packing.transform](stored)] + ([b] if bias else [])
    weight = ref.packed_dequantise(*stored, planes, packing.affine)
    want = x.astype(ml_dtypes.bfloat16).astype(np.float64) @ weight.T.astype(np.float64)
    return kernel, inputs, want + (b.astype(np.float64) if bias else 0)
