"""Every op's kernel, compiled for this CPU with its schedule, against the numpy reference."""

from __future__ import annotations

import math
import re

import ml_dtypes
import numpy as np
import numpy_reference as ref
import pytest
import tvm

from compiler.kernels import KERNELS, make_kernel
from compiler.target import cpu_target
from ir import OPS, TensorType, infer_types
from schedules import cpu
from schedules.cpu_attention import WEIGHTED_POSITIONS, paged_attention
from schedules.cpu_conv import causal_conv
from schedules.cpu_decode_attention import PARTS
from schedules.cpu_delta import delta_rule

TARGET = cpu_target()
RNG = np.random.default_rng(0)
NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "int32": np.int32}


def run_kernel(kind: str, inputs: list, attrs: dict, target=TARGET) -> list[np.ndarray]:
    """Compile `kind` for these inputs (arrays) and `target` (default: this CPU) and return its outputs."""
    types = [TensorType(x.shape, str(x.dtype)) for x in inputs]
    kernel = make_kernel(kind, types, attrs, target.scan_lanes)
    func = cpu.schedule(kernel.func, kind, attrs, target)
    lib = tvm.compile(func, target.tvm_target())
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(x, dev) for x in inputs]
    args += [tvm.runtime.tensor(c, dev) for c in kernel.constants]
    out_types = infer_types(kind, types, attrs)
    inplace = OPS[kind].sources(len(out_types))
    fresh = [tvm.runtime.empty(t.shape, t.dtype, dev) for t, src in zip(out_types, inplace) if src < 0]
    lib["main"](*args, *fresh)
    fresh_iter = iter(fresh)
    return [(next(fresh_iter) if src < 0 else args[src]).numpy() for src in inplace]


def rand(*shape, dtype="float32", scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(NP_DTYPES[dtype])


def close(got, want, tol=2e-5):
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max())))


def test_every_op_has_a_kernel():
    assert set(KERNELS) == set(OPS)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 5])
def test_embedding(dtype, rows):
    table = rand(50, 24, dtype=dtype)
    ids = RNG.integers(0, 50, rows).astype(np.int32)
    close(run_kernel("embedding", [table, ids], {})[0], ref.embedding(table, ids))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 48), (3, 20)])
def test_rms_norm(dtype, rows, hidden):
    x, w = rand(rows, hidden), rand(hidden, dtype=dtype)
    close(run_kernel("rms_norm", [x, w], {"eps": 1e-5})[0], ref.rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("rows,hidden", [(1, 64), (6, 40)])
def test_add_rms_norm(rows, hidden):
    x, r, w = rand(rows, hidden), rand(rows, hidden), rand(hidden)
    s, y = run_kernel("add_rms_norm", [x, r, w], {"eps": 1e-6})
    want_s, want_y = ref.add_rms_norm(x, r, w, 1e-6)
    close(s, want_s)
    close(y, want_y)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("rows,k,n", [(1, 64, 48), (1, 96, 14), (1, 64, 7), (1, 40, 16), (9, 32, 20), (4, 40, 16)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear(dtype, rows, k, n, bias):
    inputs = [rand(rows, k), rand(n, k, dtype=dtype, scale=k ** -0.5)] + ([rand(n, dtype=dtype)] if bias else [])
    close(run_kernel("linear", inputs, {})[0], ref.linear(*inputs), tol=1e-4)


@pytest.mark.parametrize("pos", [0, 37])
@pytest.mark.parametrize("head_dim,rotary", [(16, 16), (32, 8)])
def test_rope(pos, head_dim, rotary):
    x = rand(5, 3 * head_dim)
    positions = (pos + np.arange(5)).astype(np.int32)
    inv_freq = [1.0 / 10000 ** (2 * i / rotary) for i in range(rotary // 2)]
    attrs = {"head_dim": head_dim, "inv_freq": inv_freq}
    close(run_kernel("rope", [x, positions], attrs)[0], ref.rope(x, pos, head_dim, inv_freq), tol=1e-4)


@pytest.mark.parametrize("rows,width", [(1, 128), (5, 40)])
def test_silu_mul_and_add(rows, width):
    a, b = rand(rows, width), rand(rows, width)
    close(run_kernel("silu_mul", [a, b], {})[0], ref.silu_mul(a, b))
    close(run_kernel("add", [a, b], {})[0], ref.add(a, b))


@pytest.mark.parametrize("rows", [1, 6])
def test_rope_with_a_position_per_row(rows):
    x = rand(rows, 32)
    positions = RNG.integers(0, 500, rows).astype(np.int32)
    inv_freq = [1.0 / 10000 ** (2 * i / 16) for i in range(8)]
    attrs = {"head_dim": 16, "inv_freq": inv_freq}
    close(run_kernel("rope", [x, positions], attrs)[0], ref.rope_at(x, positions, 16, inv_freq), tol=1e-4)


def test_paged_kv_append_writes_slots_and_skips_padding():
    pages, new = rand(6, 4, 24), rand(5, 24)
    slots = np.array([0, 9, 23, -1, 5], dtype=np.int32)
    close(run_kernel("paged_kv_append", [pages, new, slots], {})[0], ref.paged_kv_append(pages, new, slots))


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (2, 2)])
def test_paged_attention_over_scattered_pages(heads, kv_heads):
    head_dim, block = 16, 4
    k_pages, v_pages = rand(9, block, kv_heads * head_dim), rand(9, block, kv_heads * head_dim)
    table = np.array([[3, 7, 1], [5, -1, -1], [0, 2, 8]], dtype=np.int32)  # rows of 9..12, 1..4, 9..12 tokens
    # a decode token of row 0 at position 10, a prefill chunk of row 1 (positions 0..3), one token of row 2
    row_of = np.array([0, 1, 1, 1, 1, 2], dtype=np.int32)
    pos_of = np.array([10, 0, 1, 2, 3, 8], dtype=np.int32)
    q = rand(6, heads * head_dim)
    attrs = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim, "scale": head_dim ** -0.5}
    got = run_kernel("paged_attention", [q, k_pages, v_pages, table, row_of, pos_of], attrs)[0]
    close(got, ref.paged_attention(q, k_pages, v_pages, table, row_of, pos_of, **attrs), tol=1e-4)


@pytest.mark.parametrize("lanes_target", ["native", "x86-64-v3"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (3, 1, 16), (4, 2, 64), (14, 2, 64), (16, 1, 32)])
def test_written_paged_attention_blocks_chunks_and_single_rows(lanes_target, heads, kv_heads, head_dim):
    """The hand-written paged kernel: a 16-row prefill chunk (one block, when rows fill SIMD vectors), the chunk's
    ragged end, decode tokens of other sequences, and padding, over scattered pages whose unwritten slots hold
    NaN (never read); head dimensions of one to eight SIMD vectors (a single row sums its weighted values in one or
    two sets)."""
    block, pages = 4, 24
    k_pages, v_pages = rand(pages, block, kv_heads * head_dim), rand(pages, block, kv_heads * head_dim)
    table = np.full((3, 8), -1, dtype=np.int32)
    table[0, :4] = [9, 2, 17, 4]  # positions 0..13 written (a decode token at 13)
    table[1, :6] = [3, 11, 0, 20, 7, 15]  # positions 0..23 (a chunk 3..18, then 19..23)
    table[2, :1] = [21]  # position 0
    for row, last in ((0, 13), (1, 23), (2, 0)):
        for p in range(last + 1, 32):
            if table[row, p // block] >= 0:
                k_pages[table[row, p // block], p % block] = np.nan
                v_pages[table[row, p // block], p % block] = np.nan
    row_of = np.zeros(32, dtype=np.int32)
    pos_of = np.zeros(32, dtype=np.int32)
    row_of[:21], pos_of[:21] = 1, np.arange(3, 24)
    row_of[21], pos_of[21] = 0, 13
    row_of[22], pos_of[22] = 2, 0  # then padding: row 0, position 0
    q = rand(32, heads * head_dim)
    attrs = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim, "scale": head_dim ** -0.5}
    inputs = [q, k_pages, v_pages, table, row_of, pos_of]
    types = [TensorType(a.shape, str(a.dtype)) for a in inputs]
    target = TARGET if lanes_target == "native" else cpu_target(lanes_target)
    assert paged_attention(make_kernel("paged_attention", types, attrs).func, attrs, target.lanes) is not None
    got = run_kernel("paged_attention", inputs, attrs, target)[0]
    close(got, ref.paged_attention(q, k_pages, v_pages, table, row_of, pos_of, **attrs), tol=1e-4)


@pytest.mark.parametrize("lanes_target", ["native", "x86-64-v3"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (2, 1, 256)])
def test_written_paged_attention_sums_values_in_passes_of_positions(lanes_target, heads, kv_heads, head_dim):
    """A prefill chunk deep in a sequence (32 rows at positions 70..101) sums its weighted values in several passes
    of WEIGHTED_POSITIONS positions, the last one ragged, over scattered pages whose slots after the chunk hold NaN."""
    block, rows, first = 16, 32, 70
    seen = first + rows
    assert seen > 2 * WEIGHTED_POSITIONS and seen % WEIGHTED_POSITIONS  # several passes, the last one ragged
    table = RNG.permutation(10).astype(np.int32)[None, :8]  # 8 of 10 pages, in no order: 128 slots
    k_pages, v_pages = rand(10, block, kv_heads * head_dim), rand(10, block, kv_heads * head_dim)
    for p in range(seen, 8 * block):
        k_pages[table[0, p // block], p % block] = np.nan
        v_pages[table[0, p // block], p % block] = np.nan
    row_of, pos_of = np.zeros(rows, dtype=np.int32), np.arange(first, seen, dtype=np.int32)
    q = rand(rows, heads * head_dim)
    attrs = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim, "scale": head_dim ** -0.5}
    inputs = [q, k_pages, v_pages, table, row_of, pos_of]
    target = TARGET if lanes_target == "native" else cpu_target(lanes_target)
    got = run_kernel("paged_attention", inputs, attrs, target)[0]
    close(got, ref.paged_attention(q, k_pages, v_pages, table, row_of, pos_of, **attrs), tol=1e-4)


@pytest.mark.parametrize("lanes_target", ["native", "x86-64-v3"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 64), (4, 4, 16), (8, 2, 256), (6, 1, 32)])
@pytest.mark.parametrize("last", [0, 47, 128, 700])
def test_decode_attention_splits_positions_into_parts_of_every_head(lanes_target, heads, kv_heads, head_dim, last):
    """One decode row: PARTS tasks, each over a run of positions for every head (whole key and value rows), merged
    by their softmax maxima: contexts too short for more than one part or two (the tasks between them left empty),
    and one of several blocks a part with a ragged end, over scattered pages whose unwritten slots hold NaN."""
    block = 16
    pages = (last + block) // block + 3
    table = np.full((2, 64), -1, dtype=np.int32)
    table[1, :pages - 2] = RNG.permutation(pages)[:pages - 2]  # the row's pages in no order, two left out
    k_pages, v_pages = rand(pages, block, kv_heads * head_dim), rand(pages, block, kv_heads * head_dim)
    for p in range(last + 1, (pages - 2) * block):
        k_pages[table[1, p // block], p % block] = np.nan
        v_pages[table[1, p // block], p % block] = np.nan
    unused = np.setdiff1d(np.arange(pages), table[1])  # pages no sequence holds
    k_pages[unused], v_pages[unused] = np.nan, np.nan
    row_of, pos_of = np.array([1], dtype=np.int32), np.array([last], dtype=np.int32)
    q = rand(1, heads * head_dim)
    attrs = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim, "scale": head_dim ** -0.5}
    inputs = [q, k_pages, v_pages, table, row_of, pos_of]
    types = [TensorType(a.shape, str(a.dtype)) for a in inputs]
    target = TARGET if lanes_target == "native" else cpu_target(lanes_target)
    written = paged_attention(make_kernel("paged_attention", types, attrs).func, attrs, target.lanes)
    assert re.findall(r"T\.parallel\((\d+)\)", written.script()) == [str(PARTS)]
    got = run_kernel("paged_attention", inputs, attrs, target)[0]
    close(got, ref.paged_attention(q, k_pages, v_pages, table, row_of, pos_of, **attrs), tol=1e-4)


def test_take_rows():
    x = rand(7, 12)
    index = np.array([6, 0, 3], dtype=np.int32)
    close(run_kernel("take_rows", [x, index], {})[0], ref.take_rows(x, index))


@pytest.mark.parametrize("kind,types,attrs", [
    ("add_rms_norm", [TensorType((8, 896), "float32")] * 2 + [TensorType((896,), "bfloat16")], {"eps": 1e-6}),
    ("rms_norm", [TensorType((8, 1024), "float32"), TensorType((256,), "bfloat16")],
     {"eps": 1e-6, "group": 256, "weight_offset": 1.0}),
    ("layer_norm", [TensorType((8, 64), "float32")] + [TensorType((64,), "float32")] * 2, {"eps": 1e-6}),
])
def test_norm_row_sums_run_as_vector_partial_sums(kind, types, attrs):
    """A norm's per-row (per-group) sums are `lanes` partial sums in one vector, added up after the row: not one
    serial chain of scalar adds (LayerNorm's mean and variance both)."""
    script = cpu.schedule(make_kernel(kind, types, attrs).func, kind, attrs, TARGET).script()
    partials = re.findall(rf'T\.vectorized\({TARGET.lanes}\):\s+with T\.sblock\("\w+_rf_update"\)', script)
    assert len(partials) == (2 if kind == "layer_norm" else 1)


@pytest.mark.parametrize("group,offset", [(16, 1.0), (48, 0.0), (8, 0.5)])
def test_rms_norm_per_group_with_weight_offset(group, offset):
    x, w = rand(5, 48), rand(group, dtype="bfloat16", scale=0.1)
    attrs = {"eps": 1e-6, "group": group, "weight_offset": offset}
    close(run_kernel("rms_norm", [x, w], attrs)[0], ref.rms_norm(x, w, 1e-6, group, offset))


def test_add_rms_norm_with_weight_offset():
    x, r, w = rand(3, 32), rand(3, 32), rand(32, scale=0.1)
    s, y = run_kernel("add_rms_norm", [x, r, w], {"eps": 1e-6, "weight_offset": 1.0})
    close(y, ref.rms_norm(x + r, w, 1e-6, None, 1.0))


@pytest.mark.parametrize("period,offset,width", [(32, 0, 16), (32, 16, 16), (40, 8, 24)])
def test_slice_cols(period, offset, width):
    x = rand(3, 4 * period) if period != 40 else rand(3, 40)
    close(run_kernel("slice_cols", [x], {"period": period, "offset": offset, "width": width})[0],
          ref.slice_cols(x, period, offset, width))


def test_sigmoid_mul():
    g, x = rand(4, 24), rand(4, 24)
    close(run_kernel("sigmoid_mul", [g, x], {})[0], ref.sigmoid_mul(g, x))


def _delta_case(rows, n, hk, hv, dk, dv, seed):
    rng = np.random.default_rng(seed)
    qkv = rng.standard_normal((rows, 2 * hk * dk + hv * dv)).astype(np.float32)
    a, b = (rng.standard_normal((rows, hv)).astype(np.float32) for _ in range(2))
    a_log = np.log(rng.uniform(0.5, 4, hv)).astype(np.float32)
    dt_bias = rng.standard_normal(hv).astype(ml_dtypes.bfloat16)
    state = (rng.standard_normal((hv, dk, dv)) * 0.5).astype(np.float32)
    return qkv, a, b, a_log, dt_bias, state


@pytest.mark.parametrize("dk", [8, 32])  # 32: whole SIMD vectors, sums of squares as partial sums in lanes
@pytest.mark.parametrize("rows,n", [(1, 1), (6, 4), (16, 16)])
def test_delta_inputs(rows, n, dk):
    qkv, a, b, a_log, dt_bias, _ = _delta_case(rows, n, 2, 4, dk, 6, seed=rows)
    a[0, 0], a[-1, -1] = 30.0, -25.0  # beyond softplus's linear threshold; exp(x) below the series threshold
    attrs = {"num_k_heads": 2, "k_dim": dk}
    qk, gates = run_kernel("delta_inputs", [qkv, a, b, a_log, dt_bias, np.array([n], np.int32)], attrs)
    want_qk, want_gates = ref.delta_inputs(qkv, a, b, a_log, dt_bias, n, **attrs)
    close(qk, want_qk)
    close(gates, want_gates)


@pytest.mark.parametrize("chunk", [0, 4, 64])
@pytest.mark.parametrize("pos", [0, 9])
@pytest.mark.parametrize("rows,n,hk,hv,dk,dv", [(1, 1, 2, 4, 8, 6), (8, 8, 2, 2, 8, 6), (16, 11, 1, 3, 8, 6),
                                                (12, 12, 2, 4, 8, 6), (16, 9, 2, 4, 16, 16)])
def test_one_sequence_delta_rule_chunked_or_recurrent_matches_the_recurrence(chunk, pos, rows, n, hk, hv, dk, dv):
    """A step of one sequence (n real rows of `rows`, the rest padding) from its slot: at position 0 the slot's
    old state is ignored; the chunked form is built when `chunk` and the rows share a factor > 1."""
    qkv, a, b, a_log, dt_bias, state = _delta_case(rows, n, hk, hv, dk, dv, seed=rows + n)
    qk, gates = ref.delta_inputs(qkv, a, b, a_log, dt_bias, n, hk, dk)
    pool = np.stack([state * 2, state, state - 1])  # slot 1 is the sequence's
    seqs = [np.array([v], dtype=np.int32) for v in (0, n, pos, 1)]
    attrs = {"num_k_heads": hk, "num_v_heads": hv, "k_dim": dk, "v_dim": dv, "chunk": chunk}
    types = [TensorType(x.shape, str(x.dtype)) for x in (qk, qkv, gates, pool, *seqs)]
    chunked = "delta_dots" in make_kernel("batch_gated_delta_rule", types, attrs).func.script()
    assert chunked == (math.gcd(rows, chunk) > 1)
    out, new_pool = run_kernel("batch_gated_delta_rule", [qk, qkv, gates, pool, *seqs], attrs)
    want_out, want_pool = ref.batch_gated_delta_rule(qk, qkv, gates, pool, *seqs, num_k_heads=hk, num_v_heads=hv,
                                                     k_dim=dk, v_dim=dv)
    close(out[:n], want_out[:n], tol=1e-4)
    close(new_pool, want_pool, tol=1e-4)


@pytest.mark.parametrize("lanes_target", ["native", "x86-64-v3"])
@pytest.mark.parametrize("rows,n,chunk,hk,hv,dk,dv,pos", [
    (64, 64, 16, 2, 2, 32, 64, 5),  # four chunks, state from the slot
    (48, 37, 16, 1, 3, 16, 48, 0),  # GQA (three v heads read one k head), padding rows, a fresh sequence
    (32, 32, 64, 2, 4, 64, 32, 9),  # a chunk of gcd(rows, 64) = 32 rows
    (12, 10, 16, 2, 2, 16, 16, 3),  # chunks of gcd(12, 16) = 4 rows
    (6, 6, 16, 1, 1, 32, 16, 1),  # chunks of 2 rows
])
def test_written_chunked_delta_rule_matches_the_recurrence(lanes_target, rows, n, chunk, hk, hv, dk, dv, pos):
    """The hand-written chunked delta rule (register tiles: two token rows of W S and q S, state rows of the update)
    replaces the definition for one sequence's prefill chunk, and its output and final state equal the token-by-token
    recurrence's, for AVX-512 and AVX2 vector widths."""
    qkv, a, b, a_log, dt_bias, state = _delta_case(rows, n, hk, hv, dk, dv, seed=rows + dk)
    qk, gates = ref.delta_inputs(qkv, a, b, a_log, dt_bias, n, hk, dk)
    pool = np.stack([state * 2, state, state - 1])
    seqs = [np.array([v], dtype=np.int32) for v in (0, n, pos, 2)]
    attrs = {"num_k_heads": hk, "num_v_heads": hv, "k_dim": dk, "v_dim": dv, "chunk": chunk}
    inputs = [qk, qkv, gates, pool, *seqs]
    target = TARGET if lanes_target == "native" else cpu_target(lanes_target)
    kernel = make_kernel("batch_gated_delta_rule", [TensorType(x.shape, str(x.dtype)) for x in inputs], attrs,
                         target.scan_lanes)
    assert delta_rule(kernel.func, attrs, target.lanes, target.scan_lanes) is not None
    lib = tvm.compile(cpu.schedule(kernel.func, "batch_gated_delta_rule", attrs, target), target.tvm_target())
    args = [tvm.runtime.tensor(x) for x in inputs] + [tvm.runtime.empty((rows, hv * dv), "float32", tvm.cpu())]
    lib["main"](*args)
    want_out, want_pool = ref.batch_gated_delta_rule(qk, qkv, gates, pool, *seqs, num_k_heads=hk, num_v_heads=hv,
                                                     k_dim=dk, v_dim=dv)
    close(args[-1].numpy()[:n], want_out[:n], tol=1e-4)
    close(args[3].numpy(), want_pool, tol=1e-4)


# Three sequences of a batch over 9 token rows (the last one padding): a decode token of a sequence at
# position 7 (slot 2), a 5-token prefill starting a new sequence (slot 0: its old state must be ignored), a
# 2-token prefill chunk continuing at position 4 (slot 3), and a padding sequence (no tokens).
SEQS = [np.array(v, dtype=np.int32) for v in ([0, 1, 6, 8], [1, 5, 2, 0], [7, 0, 4, 0], [2, 0, 3, 1])]


@pytest.mark.parametrize("channels", [40, 192])  # a task's scan_lanes channels: 8, or 64 on AVX-512
def test_batch_causal_conv1d_runs_each_sequence_from_its_slot(channels):
    x, pool, w = rand(9, channels), rand(4, 3, channels), rand(channels, 1, 4, dtype="bfloat16")
    y, new_pool = run_kernel("batch_causal_conv1d", [x, pool, w, *SEQS], {})
    want_y, want_pool = ref.batch_causal_conv1d(x, pool, w, *SEQS)
    close(y[:8], want_y[:8], tol=1e-4)
    close(new_pool, want_pool)


@pytest.mark.parametrize("lanes_target", ["native", "x86-64-v3"])
@pytest.mark.parametrize("channels,keep", [(48, 3), (96, 3), (64, 5)])  # blocks of one and two vectors
def test_written_causal_conv1d_holds_its_window_in_registers(lanes_target, channels, keep):
    """The hand-written conv (weights and window in register tiles) replaces the definition when the channels are
    whole SIMD vectors, and equals the reference for every sequence of the batch above."""
    target = TARGET if lanes_target == "native" else cpu_target(lanes_target)
    if channels % target.lanes:
        pytest.skip(f"{channels} channels are not whole vectors of {target.lanes} lanes")
    x, pool, w = rand(9, channels), rand(4, keep, channels), rand(channels, 1, keep + 1, dtype="bfloat16")
    inputs = [x, pool, w, *SEQS]
    kernel = make_kernel("batch_causal_conv1d", [TensorType(a.shape, str(a.dtype)) for a in inputs], {},
                         target.scan_lanes)
    assert causal_conv(kernel.func, target.lanes) is not None
    lib = tvm.compile(cpu.schedule(kernel.func, "batch_causal_conv1d", {}, target), target.tvm_target())
    args = [tvm.runtime.tensor(a) for a in inputs] + [tvm.runtime.empty(x.shape, "float32", tvm.cpu())]
    lib["main"](*args)
    want_y, want_pool = ref.batch_causal_conv1d(x, pool, w, *SEQS)
    close(args[-1].numpy()[:8], want_y[:8], tol=1e-4)
    close(args[1].numpy(), want_pool)


@pytest.mark.parametrize("lanes_target", ["native", "x86-64-v3"])
@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 4, 16, 48), (1, 2, 32, 64)])
def test_written_recurrent_delta_rule_runs_a_batch_of_sequences(lanes_target, hk, hv, dk, dv):
    """The hand-written token-by-token delta rule (two passes over each block of the state per token, sums in
    registers) replaces the definition for a step of several sequences (a decode token, a new 5-token prompt, a
    continued 2-token chunk, an empty sequence), and equals the recurrence, for AVX-512 and AVX2 vector widths."""
    target = TARGET if lanes_target == "native" else cpu_target(lanes_target)
    qkv, a, b, a_log, dt_bias, _ = _delta_case(9, 8, hk, hv, dk, dv, seed=dk + dv)
    qk, gates = ref.delta_inputs(qkv, a, b, a_log, dt_bias, 8, hk, dk)
    pool = (RNG.standard_normal((4, hv, dk, dv)) * 0.5).astype(np.float32)
    attrs = {"num_k_heads": hk, "num_v_heads": hv, "k_dim": dk, "v_dim": dv, "chunk": 16}
    inputs = [qk, qkv, gates, pool, *SEQS]
    kernel = make_kernel("batch_gated_delta_rule", [TensorType(x.shape, str(x.dtype)) for x in inputs], attrs,
                         target.scan_lanes)
    assert "delta_dots" not in kernel.func.script()  # the recurrent form of the definition
    assert delta_rule(kernel.func, attrs, target.lanes, target.scan_lanes) is not None
    lib = tvm.compile(cpu.schedule(kernel.func, "batch_gated_delta_rule", attrs, target), target.tvm_target())
    args = [tvm.runtime.tensor(x) for x in inputs] + [tvm.runtime.empty((9, hv * dv), "float32", tvm.cpu())]
    lib["main"](*args)
    want_out, want_pool = ref.batch_gated_delta_rule(qk, qkv, gates, pool, *SEQS, num_k_heads=hk, num_v_heads=hv,
                                                     k_dim=dk, v_dim=dv)
    close(args[-1].numpy()[:8], want_out[:8], tol=1e-4)
    close(args[3].numpy(), want_pool, tol=1e-4)


@pytest.mark.parametrize("dk,dv", [(16, 16), (64, 128)])  # the latter: value columns in several tasks of scan_lanes
def test_batch_gated_delta_rule_runs_each_sequence_from_its_slot(dk, dv):
    hk, hv = 2, 4
    qkv, a, b, a_log, dt_bias, _ = _delta_case(9, 8, hk, hv, dk, dv, seed=3)
    qk, gates = ref.delta_inputs(qkv, a, b, a_log, dt_bias, 8, hk, dk)
    pool = (RNG.standard_normal((4, hv, dk, dv)) * 0.5).astype(np.float32)
    attrs = {"num_k_heads": hk, "num_v_heads": hv, "k_dim": dk, "v_dim": dv}
    out, new_pool = run_kernel("batch_gated_delta_rule", [qk, qkv, gates, pool, *SEQS], {**attrs, "chunk": 16})
    want_out, want_pool = ref.batch_gated_delta_rule(qk, qkv, gates, pool, *SEQS, **attrs)
    close(out[:8], want_out[:8], tol=1e-4)
    close(new_pool, want_pool, tol=1e-4)


def test_gather_pages_then_padded_attention_equals_paged_attention():
    heads, kv_heads, head_dim, block = 4, 2, 16, 4
    k_pages, v_pages = rand(9, block, kv_heads * head_dim), rand(9, block, kv_heads * head_dim)
    table = np.array([[3, 7, 1], [5, -1, -1], [0, 2, 8]], dtype=np.int32)
    row_of = np.array([0, 1, 1, 1, 1, 2], dtype=np.int32)
    pos_of = np.array([10, 0, 1, 2, 3, 8], dtype=np.int32)
    q = rand(6, heads * head_dim)
    attrs = {"num_heads": heads, "num_kv_heads": kv_heads, "head_dim": head_dim, "scale": head_dim ** -0.5}
    k_hist = run_kernel("gather_pages", [k_pages, table], {})[0]
    v_hist = run_kernel("gather_pages", [v_pages, table], {})[0]
    close(k_hist, ref.gather_pages(k_pages, table))
    got = run_kernel("padded_attention", [q, k_hist, v_hist, row_of, pos_of], attrs)[0]
    close(got, ref.padded_attention(q, k_hist, v_hist, row_of, pos_of, **attrs), tol=1e-4)
    close(got, ref.paged_attention(q, k_pages, v_pages, table, row_of, pos_of, **attrs), tol=1e-4)


@pytest.mark.parametrize("axes", [2, 3])
def test_rope_with_a_position_per_axis(axes):
    x = rand(6, 48)
    positions = RNG.integers(0, 300, (6, axes)).astype(np.int32)
    inv_freq = [1.0 / 10000 ** (2 * i / 12) for i in range(6)]
    pos_axes = [int(a) for a in RNG.integers(0, axes, 6)]
    attrs = {"head_dim": 16, "inv_freq": inv_freq, "pos_axes": pos_axes}
    close(run_kernel("rope", [x, positions], attrs)[0], ref.rope_axes(x, positions, 16, inv_freq, pos_axes), tol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 40)])
def test_layer_norm(dtype, rows, hidden):
    x, w, b = rand(rows, hidden, scale=3.0) + 2.0, rand(hidden, dtype=dtype), rand(hidden, dtype=dtype)
    close(run_kernel("layer_norm", [x, w, b], {"eps": 1e-6})[0], ref.layer_norm(x, w, b, 1e-6), tol=1e-4)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate):
    x = rand(5, 40, scale=3.0)
    close(run_kernel("gelu", [x], {"approximate": approximate})[0], ref.gelu(x, approximate), tol=1e-5)


def test_image_attention_stays_within_each_image():
    q, k, v = rand(12, 32), rand(12, 32), rand(12, 32)
    images = np.array([0] * 4 + [1] * 6 + [-1] * 2, np.int32)  # two images and two padding patches
    attrs = {"num_heads": 2, "head_dim": 16, "scale": 0.25}
    got = run_kernel("image_attention", [q, k, v, images], attrs)[0]
    close(got, ref.image_attention(q, k, v, images, **attrs), tol=1e-4)
    v2 = v.copy()
    v2[4:] += 10.0  # another image's values do not reach the first image's patches
    close(run_kernel("image_attention", [q, k, v2, images], attrs)[0][:4], got[:4], tol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_interpolated_embedding(dtype):
    table = rand(16, 24, dtype=dtype)
    index = RNG.integers(0, 16, (7, 4)).astype(np.int32)
    weight = RNG.random((7, 4)).astype(np.float32)
    close(run_kernel("interpolated_embedding", [table, index, weight], {})[0],
          ref.interpolated_embedding(table, index, weight))


def test_merge_rows_and_merge_embeddings():
    x = rand(8, 6)
    close(run_kernel("merge_rows", [x], {"group": 4, "rows": 2})[0], ref.merge_rows(x, 4))
    embedded, inputs = rand(5, 6), rand(5, 6)
    mask = np.array([0, 1, 1, 0, 1], np.int32)
    close(run_kernel("merge_embeddings", [embedded, inputs, mask], {})[0], ref.merge_embeddings(embedded, inputs, mask))
