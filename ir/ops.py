"""The op set: for each kind, its inputs, attributes and type inference.

Activations are float32; weights keep their checkpoint dtype (the kernels widen them). Every
graph runs a step over the token rows of one or more sequences (a single request is a batch of
one): the KV of attention layers lives in pages of a shared arena [pages, block, width]; each token
row says which sequence it belongs to (`row_of`), its position (`pos_of`), and where its K/V go
(`slots`: page * block + offset, negative for padding rows). `n` (int32[1]) counts the real,
unpadded rows. The recurrent ops of Qwen3.5's linear-attention layers (`batch_causal_conv1d`,
`batch_gated_delta_rule`) keep each sequence's state in a slot of a pool they update in place, and
give their per-token output as a fresh tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from .graph import HISTORY, Dim, TensorType

FLOAT_DTYPES = ("float32", "float16", "bfloat16")


class IRError(Exception):
    """An ill-formed graph: a compiler or model-definition bug, never a user input problem."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise IRError(msg)


def _act(t: TensorType, rank: int, what: str) -> None:
    _check(t.dtype == "float32" and len(t.shape) == rank, f"{what} must be float32 of rank {rank}, got {t}")


def _weight(t: TensorType, shape: tuple[Dim, ...], what: str, packed: bool = False) -> None:
    """A float weight of `shape`; `packed`: it may be stored packed (the ops whose kernels unpack it)."""
    _check(t.dtype in FLOAT_DTYPES, f"{what} must be a float tensor, got {t}")
    _check(t.shape == shape, f"{what} must have shape {shape}, got {t}")
    _check(t.packing is None or packed, f"{what} cannot be packed, got {t}")
    _check(t.packing is None or t.packing.problem(t.shape) is None,
           f"{what} {t}: {t.packing and t.packing.problem(t.shape)}")


def _count(t: TensorType, what: str) -> None:
    _check(t == TensorType((1,), "int32"), f"{what} must be int32[1] (a count), got {t}")


def _embedding(ins, attrs):
    table, ids = ins
    _check(len(table.shape) == 2, f"embedding table must be a float matrix, got {table}")
    _weight(table, table.shape, "embedding table", packed=True)  # packed: its rows unpacked as they are looked up
    _check(ids.dtype == "int32" and len(ids.shape) == 1, f"embedding ids must be int32 of rank 1, got {ids}")
    return [TensorType((ids.shape[0], table.shape[1]), "float32")]


def _norm_weight(x: TensorType, w: TensorType, attrs: dict, what: str) -> None:
    """A norm's weight covers one group: the whole row, or `group` features normalised separately."""
    group = attrs.get("group", x.shape[1])
    _check(isinstance(group, int) and group > 0 and isinstance(x.shape[1], int) and x.shape[1] % group == 0,
           f"{what} group {group!r} must divide the {x.shape[1]} features")
    _check(isinstance(attrs.get("weight_offset", 0.0), float), f"{what} weight_offset must be a float")
    _weight(w, (group,), f"{what} weight")


def _rms_norm(ins, attrs):
    x, w = ins
    _act(x, 2, "rms_norm input")
    _norm_weight(x, w, attrs, "rms_norm")
    return [x]


def _add_rms_norm(ins, attrs):
    x, residual, w = ins
    _act(x, 2, "add_rms_norm input")
    _check(residual == x, f"add_rms_norm residual {residual} must match input {x}")
    _check("group" not in attrs, "add_rms_norm normalises whole rows")
    _norm_weight(x, w, attrs, "add_rms_norm")
    return [x, x]


def _slice_cols(ins, attrs):
    (x,) = ins
    _act(x, 2, "slice_cols input")
    period, offset, width = attrs["period"], attrs["offset"], attrs["width"]
    _check(all(isinstance(v, int) for v in (period, offset, width)) and width > 0 and 0 <= offset
           and offset + width <= period and x.shape[1] % period == 0,
           f"slice_cols period {period!r}, offset {offset!r}, width {width!r} do not fit {x}")
    return [TensorType((x.shape[0], x.shape[1] // period * width), "float32")]


def _delta_heads(attrs: dict, *names: str) -> tuple[int, ...]:
    values = tuple(attrs[k] for k in names)
    _check(all(isinstance(v, int) and v > 0 for v in values), f"delta rule {names} must be positive ints, got {values}")
    return values


def _delta_inputs(ins, attrs):
    qkv, a, b, a_log, dt_bias, n = ins
    hk, dk = _delta_heads(attrs, "num_k_heads", "k_dim")
    _act(qkv, 2, "delta_inputs qkv")
    rows, hv = qkv.shape[0], a.shape[1] if len(a.shape) == 2 else 0
    _check(isinstance(qkv.shape[1], int) and qkv.shape[1] > 2 * hk * dk, f"delta_inputs qkv {qkv} holds no values "
           f"after q and k ({hk} x {dk} each)")
    for t, what in ((a, "a"), (b, "b")):
        _check(t == TensorType((rows, hv), "float32"), f"delta_inputs {what} must be float32[{rows}, heads], got {t}")
    _weight(a_log, (hv,), "delta_inputs A_log")
    _weight(dt_bias, (hv,), "delta_inputs dt_bias")
    _count(n, "delta_inputs n")
    return [TensorType((rows, 2 * hk * dk), "float32"), TensorType((rows, hv, 2), "float32")]


def delta_chunk(rows: int, seqs: int, chunk: int) -> int:
    """Tokens per chunk of the gated delta rule's chunked form for a step of `rows` token rows and `seqs` sequences
    (its `chunk` attribute C): gcd(C, rows) for a step of one sequence, or 0 where the step runs the token-by-token
    recurrence (several sequences, or no common factor above 1)."""
    size = math.gcd(rows, chunk)
    return size if seqs == 1 and size > 1 else 0


def _delta_rule_types(qk: TensorType, qkv: TensorType, gates: TensorType, state: tuple, attrs: dict) -> TensorType:
    """The delta rule's output type, checking its inputs and one sequence's state shape [v heads, k_dim, v_dim]."""
    hk, hv, dk, dv = _delta_heads(attrs, "num_k_heads", "num_v_heads", "k_dim", "v_dim")
    _check(hv % hk == 0, f"batch_gated_delta_rule: {hk} k heads do not group {hv} v heads")
    _check(isinstance(attrs["chunk"], int) and attrs["chunk"] >= 0, f"batch_gated_delta_rule chunk must be an int "
           f">= 0, got {attrs['chunk']!r}")
    _act(qk, 2, "batch_gated_delta_rule qk")
    rows = qk.shape[0]
    _check(qk.shape[1] == 2 * hk * dk, f"batch_gated_delta_rule qk {qk} is not q and k of {hk} x {dk}")
    _act(qkv, 2, "batch_gated_delta_rule qkv")
    _check(qkv.shape == (rows, 2 * hk * dk + hv * dv), f"batch_gated_delta_rule qkv {qkv} is not q, k and v "
           f"({hv} x {dv})")
    _check(gates == TensorType((rows, hv, 2), "float32"), f"batch_gated_delta_rule gates must be float32[{rows}, "
           f"{hv}, 2], got {gates}")
    _check(state == (hv, dk, dv), f"batch_gated_delta_rule pool slots must be [{hv}, {dk}, {dv}], got {state}")
    return TensorType((rows, hv * dv), "float32")


def _sequences(t: TensorType, rows, what: str) -> None:
    _check(t.dtype == "int32" and len(t.shape) == 1 and (rows is None or t.shape == (rows,)),
           f"{what} must be one int32 per sequence, got {t}")


def _batch_recurrent(seq: list[TensorType], what: str) -> None:
    """The per-sequence inputs of a batched recurrent op: first token row, token count, start position, state slot."""
    for t, name in zip(seq, ("seq_start", "seq_len", "seq_pos", "seq_slot")):
        _sequences(t, seq[0].shape[0] if len(seq[0].shape) == 1 else None, f"{what} {name}")


def _batch_causal_conv1d(ins, attrs):
    x, pool, w, *seq = ins
    _check(pool.dtype == "float32" and len(pool.shape) == 3, f"batch_causal_conv1d pool must be float32 "
           f"[slots, kernel - 1, channels], got {pool}")
    _act(x, 2, "batch_causal_conv1d input")
    _check(pool.shape[2] == x.shape[1], f"batch_causal_conv1d pool {pool} does not hold {x.shape[1]} channels")
    _weight(w, (x.shape[1], 1, pool.shape[1] + 1), "batch_causal_conv1d weight")
    _batch_recurrent(seq, "batch_causal_conv1d")
    return [x, pool]


def _batch_gated_delta_rule(ins, attrs):
    qk, qkv, gates, pool, *seq = ins
    _check(pool.dtype == "float32" and len(pool.shape) == 4, f"batch_gated_delta_rule pool must be float32 "
           f"[slots, v heads, k_dim, v_dim], got {pool}")
    out = _delta_rule_types(qk, qkv, gates, pool.shape[1:], attrs)
    _batch_recurrent(seq, "batch_gated_delta_rule")
    return [out, pool]


def _gather_pages(ins, attrs):
    pages, table = ins
    _check(pages.dtype == "float32" and len(pages.shape) == 3, f"gather_pages pages must be float32 [pages, block, "
           f"width], got {pages}")
    _check(table.dtype == "int32" and len(table.shape) == 2, f"gather_pages block table must be int32[rows, pages], "
           f"got {table}")
    rows, width = table.shape
    length = width * pages.shape[1] if isinstance(width, int) and isinstance(pages.shape[1], int) else HISTORY
    return [TensorType((rows, length, pages.shape[2]), "float32")]


def _padded_attention(ins, attrs):
    q, k, v, row_of, pos_of = ins
    for t, what in ((k, "key"), (v, "value")):
        _check(t.dtype == "float32" and len(t.shape) == 3, f"padded_attention {what} history must be float32 "
               f"[rows, positions, width], got {t}")
    _check(k.shape == v.shape, f"padded_attention key {k} and value {v} histories differ")
    heads, kv_heads, head_dim = _heads(attrs, "padded_attention")
    _act(q, 2, "padded_attention query")
    _check(q.shape[1] == heads * head_dim and k.shape[2] == kv_heads * head_dim, f"padded_attention query {q} and "
           f"history {k} are not {heads} and {kv_heads} heads of {head_dim}")
    for t, what in ((row_of, "row_of"), (pos_of, "pos_of")):
        _check(t == TensorType((q.shape[0],), "int32"), f"padded_attention {what} must be int32[{q.shape[0]}], got {t}")
    return [q]


def _linear(ins, attrs):
    x, w = ins[0], ins[1]
    _act(x, 2, "linear input")
    _check(len(w.shape) == 2, f"linear weight must be a matrix, got {w}")
    _weight(w, (w.shape[0], x.shape[1]), "linear weight", packed=True)
    if len(ins) == 3:
        _weight(ins[2], (w.shape[0],), "linear bias")
    return [TensorType((x.shape[0], w.shape[0]), "float32")]


def _rope(ins, attrs):
    x, pos = ins
    _act(x, 2, "rope input")
    head_dim, inv_freq = attrs["head_dim"], attrs["inv_freq"]
    axes = attrs.get("pos_axes")
    if axes is None:
        _check(pos == TensorType((x.shape[0],), "int32"), f"rope pos must be one int32 position per row "
               f"({x.shape[0]}), got {pos}")
    else:  # a position per axis (multimodal rotary): each frequency rotates by the position on its axis
        _check(pos.dtype == "int32" and len(pos.shape) == 2 and pos.shape[0] == x.shape[0] and isinstance(
            pos.shape[1], int), f"rope pos must be int32 [{x.shape[0]}, axes] with pos_axes, got {pos}")
        _check(isinstance(axes, list) and len(axes) == len(inv_freq) and all(
            isinstance(a, int) and 0 <= a < pos.shape[1] for a in axes),
            f"rope pos_axes must give each of the {len(inv_freq)} frequencies an axis below {pos.shape[1]}")
    _check(isinstance(head_dim, int) and head_dim > 0, f"rope head_dim must be a positive int, got {head_dim!r}")
    _check(x.shape[1] % head_dim == 0, f"rope features {x.shape[1]} not a multiple of head_dim {head_dim}")
    _check(0 < 2 * len(inv_freq) <= head_dim, f"rope rotates {2 * len(inv_freq)} of {head_dim} dims")
    return [x]


def _layer_norm(ins, attrs):
    x, w, b = ins
    _act(x, 2, "layer_norm input")
    _weight(w, (x.shape[1],), "layer_norm weight")
    _weight(b, (x.shape[1],), "layer_norm bias")
    return [x]


GELU_APPROXIMATIONS = ("none", "tanh")  # erf, or the tanh approximation (PyTorch's approximate="tanh")


def _gelu(ins, attrs):
    (x,) = ins
    _act(x, 2, "gelu input")
    _check(attrs["approximate"] in GELU_APPROXIMATIONS, f"gelu approximate must be one of {GELU_APPROXIMATIONS}, "
           f"got {attrs['approximate']!r}")
    return [x]


def _image_attention(ins, attrs):
    q, k, v, images = ins
    heads, head_dim = attrs["num_heads"], attrs["head_dim"]
    _check(all(isinstance(n, int) and n > 0 for n in (heads, head_dim)),
           f"image_attention heads {heads!r} / head_dim {head_dim!r} must be positive ints")
    _act(q, 2, "image_attention query")
    _check(q.shape[1] == heads * head_dim and k == q and v == q,
           f"image_attention q {q}, k {k}, v {v} must all be {heads} heads of {head_dim}")
    _check(images == TensorType((q.shape[0],), "int32"), f"image_attention images must be int32[{q.shape[0]}], "
           f"got {images}")
    return [q]


def _interpolated_embedding(ins, attrs):
    table, index, weight = ins
    _check(table.dtype in FLOAT_DTYPES and len(table.shape) == 2, f"interpolated_embedding table must be a float "
           f"matrix, got {table}")
    _check(index.dtype == "int32" and len(index.shape) == 2, f"interpolated_embedding index must be int32 "
           f"[rows, taps], got {index}")
    _check(weight == TensorType(index.shape, "float32"), f"interpolated_embedding weight must be float32 "
           f"{list(index.shape)}, got {weight}")
    return [TensorType((index.shape[0], table.shape[1]), "float32")]


def _merge_rows(ins, attrs):
    (x,) = ins
    _act(x, 2, "merge_rows input")
    group, rows = attrs["group"], attrs["rows"]
    _check(isinstance(group, int) and group > 0 and isinstance(x.shape[1], int),
           f"merge_rows group must be a positive int, got {group!r}")
    _check(isinstance(rows, str) or (isinstance(rows, int) and rows * group == x.shape[0]),
           f"merge_rows cannot merge {x} into {rows!r} rows of {group}")
    return [TensorType((rows, x.shape[1] * group), "float32")]


def _merge_embeddings(ins, attrs):
    embedded, inputs, mask = ins
    _act(embedded, 2, "merge_embeddings embedded")
    _check(inputs == embedded, f"merge_embeddings inputs {inputs} must match the embedded tokens {embedded}")
    _check(mask == TensorType((embedded.shape[0],), "int32"), f"merge_embeddings mask must be "
           f"int32[{embedded.shape[0]}], got {mask}")
    return [embedded]


def _heads(attrs: dict, what: str) -> tuple[int, int, int]:
    """An attention op's (heads, kv heads, head_dim): positive, the kv heads grouping the heads."""
    heads, kv_heads, head_dim = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    _check(all(isinstance(x, int) and x > 0 for x in (heads, kv_heads, head_dim)) and heads % kv_heads == 0,
           f"{what} heads {heads!r} / kv heads {kv_heads!r} / head_dim {head_dim!r} are inconsistent")
    return heads, kv_heads, head_dim


def _paged_kv_append(ins, attrs):
    pages, new, slots = ins
    _check(pages.dtype == "float32" and len(pages.shape) == 3, f"KV pages must be float32 [pages, block, width], got {pages}")
    _act(new, 2, "paged_kv_append new rows")
    _check(new.shape[1] == pages.shape[2], f"paged_kv_append rows {new} do not fit pages {pages}")
    _check(slots == TensorType((new.shape[0],), "int32"), f"paged_kv_append slots must be int32[{new.shape[0]}], got {slots}")
    return [pages]


def _paged_attention(ins, attrs):
    q, k, v, table, row_of, pos_of = ins
    heads, kv_heads, head_dim = _heads(attrs, "paged_attention")
    _act(q, 2, "paged_attention query")
    _check(q.shape[1] == heads * head_dim, f"paged_attention query {q} is not {heads} heads of {head_dim}")
    for pages, what in ((k, "key"), (v, "value")):
        _check(pages.dtype == "float32" and len(pages.shape) == 3 and pages.shape[2] == kv_heads * head_dim,
               f"paged_attention {what} pages {pages} are not [pages, block, {kv_heads} heads of {head_dim}]")
    _check(k.shape == v.shape, f"key pages {k} and value pages {v} differ")
    _check(table.dtype == "int32" and len(table.shape) == 2, f"paged_attention block table must be int32[rows, pages], got {table}")
    for t, what in ((row_of, "row_of"), (pos_of, "pos_of")):
        _check(t == TensorType((q.shape[0],), "int32"), f"paged_attention {what} must be int32[{q.shape[0]}], got {t}")
    return [q]


def _take_rows(ins, attrs):
    x, index = ins
    _act(x, 2, "take_rows input")
    _check(index.dtype == "int32" and len(index.shape) == 1, f"take_rows index must be an int32 vector, got {index}")
    return [TensorType((index.shape[0], x.shape[1]), "float32")]


def _elementwise(ins, attrs):
    a, b = ins
    _act(a, 2, "elementwise input")
    _check(a == b, f"elementwise inputs differ: {a} vs {b}")
    return [a]


@dataclass(frozen=True)
class OpSpec:
    """What an op kind takes and gives."""

    inputs: tuple[str, ...]
    attrs: tuple[str, ...]
    infer: Callable[[list[TensorType], dict], list[TensorType]]
    optional_inputs: tuple[str, ...] = ()
    inplace: tuple[int, ...] = ()
    """For each output, the input it overwrites in place, or -1 for a fresh one (empty: all fresh)."""
    optional_attrs: tuple[str, ...] = ()

    @property
    def overwritten(self) -> tuple[int, ...]:
        """The inputs this op writes in place."""
        return tuple(i for i in self.inplace if i >= 0)

    def sources(self, outputs: int) -> tuple[int, ...]:
        """For each of `outputs` outputs, the input it overwrites, or -1 for a fresh one."""
        return self.inplace or (-1,) * outputs


SEQUENCE_INPUTS = ("seq_start", "seq_len", "seq_pos", "seq_slot")
"""Per sequence of a batch: its first token row, its token count, its start position (0: start from a zero
state), and the slot of its recurrent state."""

OPS: dict[str, OpSpec] = {
    "embedding": OpSpec(("table", "ids"), (), _embedding),
    "rms_norm": OpSpec(("x", "weight"), ("eps",), _rms_norm, optional_attrs=("group", "weight_offset")),
    "add_rms_norm": OpSpec(("x", "residual", "weight"), ("eps",), _add_rms_norm, optional_attrs=("weight_offset",)),
    "linear": OpSpec(("x", "weight"), (), _linear, optional_inputs=("bias",)),
    "rope": OpSpec(("x", "pos"), ("head_dim", "inv_freq"), _rope, optional_attrs=("pos_axes",)),
    "layer_norm": OpSpec(("x", "weight", "bias"), ("eps",), _layer_norm),
    "gelu": OpSpec(("x",), ("approximate",), _gelu),
    "image_attention": OpSpec(("q", "k", "v", "images"), ("num_heads", "head_dim", "scale"), _image_attention),
    "interpolated_embedding": OpSpec(("table", "index", "weight"), (), _interpolated_embedding),
    "merge_rows": OpSpec(("x",), ("group", "rows"), _merge_rows),
    "merge_embeddings": OpSpec(("embedded", "inputs", "mask"), (), _merge_embeddings),
    "silu_mul": OpSpec(("gate", "up"), (), _elementwise),
    "add": OpSpec(("a", "b"), (), _elementwise),
    "paged_kv_append": OpSpec(("pages", "new", "slots"), (), _paged_kv_append, inplace=(0,)),
    "paged_attention": OpSpec(("q", "k_pages", "v_pages", "block_table", "row_of", "pos_of"),
                              ("num_heads", "num_kv_heads", "head_dim", "scale"), _paged_attention),
    "take_rows": OpSpec(("x", "index"), (), _take_rows),
    "slice_cols": OpSpec(("x",), ("period", "offset", "width"), _slice_cols),
    "sigmoid_mul": OpSpec(("gate", "x"), (), _elementwise),
    "delta_inputs": OpSpec(("qkv", "a", "b", "a_log", "dt_bias", "n"), ("num_k_heads", "k_dim"), _delta_inputs),
    "batch_causal_conv1d": OpSpec(("x", "pool", "weight") + SEQUENCE_INPUTS, (), _batch_causal_conv1d,
                                  inplace=(-1, 1)),
    "batch_gated_delta_rule": OpSpec(("qk", "qkv", "gates", "pool") + SEQUENCE_INPUTS,
                                     ("num_k_heads", "num_v_heads", "k_dim", "v_dim", "chunk"), _batch_gated_delta_rule,
                                     inplace=(-1, 3)),
    "gather_pages": OpSpec(("pages", "block_table"), (), _gather_pages),
    "padded_attention": OpSpec(("q", "k_history", "v_history", "row_of", "pos_of"),
                               ("num_heads", "num_kv_heads", "head_dim", "scale"), _padded_attention),
}


def infer_types(kind: str, inputs: list[TensorType], attrs: dict) -> list[TensorType]:
    """Output types of an op of `kind` on inputs of these types, or IRError."""
    spec = OPS.get(kind)
    _check(spec is not None, f"unknown op kind {kind!r}")
    lo, hi = len(spec.inputs), len(spec.inputs) + len(spec.optional_inputs)
    _check(lo <= len(inputs) <= hi, f"{kind} takes {lo}..{hi} inputs, got {len(inputs)}")
    missing = [a for a in spec.attrs if a not in attrs]
    _check(not missing, f"{kind} lacks attributes {missing}")
    unknown = [a for a in attrs if a not in spec.attrs + spec.optional_attrs]
    _check(not unknown, f"{kind} has unknown attributes {unknown}")
    return spec.infer(inputs, attrs)
