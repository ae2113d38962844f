"""The IR on its own: builder type inference, verifier, per-op type checks, printer, JSON, hash, passes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import models
from ir import (
    BLOCK,
    OPS,
    PAGES,
    PAGES_PER_ROW,
    ROWS,
    SLOTS,
    TOKENS,
    Graph,
    GraphBuilder,
    IRError,
    Op,
    Param,
    Program,
    Role,
    TensorType,
    eliminate_dead_values,
    format_program,
    from_json,
    fuse_add_rms_norm,
    infer_types,
    stable_hash,
    to_json,
    verify,
)

F32, I32 = "float32", "int32"
SCALAR = TensorType((), I32)
COUNT = TensorType((1,), I32)
HIDDEN, KV = 8, 4

RAW = {
    "llama": {
        "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 128,
    },
    "qwen2": {
        "model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 128, "tie_word_embeddings": True,
    },
}


def _program(arch: str, param_dtypes=None, **overrides) -> Program:
    return models.build_program(models.parse_config({**RAW[arch], **overrides}), param_dtypes)


def _t(*shape, dtype=F32) -> TensorType:
    return TensorType(tuple(shape), dtype)


PARAMS = {
    "norm.w": Param("norm.w", _t(HIDDEN)),
    "norm2.w": Param("norm2.w", _t(HIDDEN)),
    "proj.w": Param("proj.w", _t(HIDDEN, HIDDEN, dtype="bfloat16")),
    "k_proj.w": Param("k_proj.w", _t(KV, HIDDEN, dtype="float16")),
    "cache_param": Param("cache_param", _t(4, 4, KV)),
}


def _wrap(graph: Graph, params=PARAMS) -> Program:
    return Program("test", dict(params), {graph.name: graph})


def _builder() -> tuple[GraphBuilder, str, str, str]:
    g = GraphBuilder("g", PARAMS)
    x = g.input("x", (TOKENS, HIDDEN), F32, "input_embeddings")
    slots = g.input("slots", (TOKENS,), I32, "kv_slots")
    n = g.input("n", (1,), I32, "token_count")
    return g, x, slots, n


def _small_graph() -> Graph:
    """x -> linear -> add(x) -> rms_norm -> output: a well-formed graph to break in the verifier tests."""
    g, x, _, _ = _builder()
    y = g.op("linear", [x, "proj.w"], "y")
    s = g.op("add", [x, y], "s")
    out = g.op("rms_norm", [s, "norm.w"], "out", eps=1e-6)
    return g.finish([out])


def _cache_graph() -> Graph:
    """paged_kv_append onto a runtime KV pages input, returning the new keys and the written pages."""
    g, x, slots, _ = _builder()
    cache = g.input("cache", (PAGES, BLOCK, KV), F32, "k_pages", 0)
    k = g.op("linear", [x, "k_proj.w"], "k")
    new_cache = g.op("paged_kv_append", [cache, k, slots], "cache2")
    return g.finish([k, new_cache])


# ---------------------------------------------------------------------------------------------------------------
# builder and the real model programs


def test_builder_infers_types():
    g, x, slots, n = _builder()
    cache = g.input("cache", (PAGES, BLOCK, KV), F32, "k_pages", 0)
    last_rows = g.input("last", (ROWS,), I32, "last_tokens")
    assert g.type_of(x) == _t(TOKENS, HIDDEN)
    h = g.op("rms_norm", [x, "norm.w"], "h", eps=1e-6)
    k = g.op("linear", [h, "k_proj.w"], "k")
    assert g.type_of(k) == _t(TOKENS, KV)
    s, y = g.op("add_rms_norm", [x, h, "norm2.w"], "fused", eps=1e-6)
    assert (s, y) == ("fused.0", "fused.1")
    assert g.type_of(s) == g.type_of(y) == _t(TOKENS, HIDDEN)
    c2 = g.op("paged_kv_append", [cache, k, slots], "c2")
    assert g.type_of(c2) == _t(PAGES, BLOCK, KV)
    last = g.op("take_rows", [y, last_rows], "last_rows")
    assert g.type_of(last) == _t(ROWS, HIDDEN)
    graph = g.finish([last, c2])
    assert graph.inputs == ["x", "slots", "n", "cache", "last"]
    assert [op.kind for op in graph.ops] == ["rms_norm", "linear", "add_rms_norm", "paged_kv_append", "take_rows"]
    verify(_wrap(graph))


def test_builder_rejects_undefined_and_duplicate_values():
    g, x, _, _ = _builder()
    with pytest.raises(IRError, match="not defined"):
        g.op("add", [x, "nope"], "y")
    with pytest.raises(IRError, match="defined twice"):
        g.input("x", (TOKENS, HIDDEN), F32, "input_embeddings")
    with pytest.raises(IRError, match="defined twice"):
        g.op("add", [x, x], "norm.w")  # a value may not take a param's name
    with pytest.raises(IRError, match="not defined"):
        g.finish(["nope"])


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_programs_verify(arch):
    p = _program(arch)
    assert verify(p) is p
    # one execution path (and its legacy attention variant), each also without the vocabulary head
    assert set(p.entries) == {"step", "step_gather", "step_hidden", "step_gather_hidden"}
    cfg = models.parse_config(RAW[arch])
    assert set(p.params) == set(models.checkpoint_shapes(cfg))
    for name, shape in models.checkpoint_shapes(cfg).items():
        assert p.params[name].type == TensorType(shape, "float32")
    step = p.entries["step"]
    assert step.types["ids"] == _t(TOKENS, dtype=I32)
    # the passes ran: residual adds are fused, and every paged_kv_append survives dead-value elimination
    assert "add_rms_norm" in [op.kind for op in step.ops]
    assert step.types["block_table"] == _t(ROWS, PAGES_PER_ROW, dtype=I32)
    assert step.types[step.outputs[0]] == _t(ROWS, cfg.vocab_size)
    step_kinds = [op.kind for op in step.ops]
    assert step_kinds.count("paged_kv_append") == 2 * cfg.num_hidden_layers
    assert step_kinds.count("paged_attention") == cfg.num_hidden_layers
    gather_kinds = [op.kind for op in p.entries["step_gather"].ops]  # the legacy path: history gathered, then attended
    assert gather_kinds.count("gather_pages") == 2 * cfg.num_hidden_layers
    assert gather_kinds.count("padded_attention") == cfg.num_hidden_layers and "paged_attention" not in gather_kinds


# ---------------------------------------------------------------------------------------------------------------
# the verifier rejects ill-formed graphs


def _rejects(graph: Graph, match: str, params=PARAMS) -> None:
    with pytest.raises(IRError, match=match):
        verify(_wrap(graph, params))


def test_verify_accepts_hand_built_graphs():
    verify(_wrap(_small_graph()))
    verify(_wrap(_cache_graph()))


def test_verify_rejects_undefined_input_value():
    g = _small_graph()
    ops = list(g.ops)
    ops[1] = replace(ops[1], inputs=("x", "undefined"))
    _rejects(replace(g, ops=ops), "undefined value 'undefined'")


def test_verify_rejects_use_before_definition():
    g = _small_graph()
    _rejects(replace(g, ops=[g.ops[1], g.ops[0], g.ops[2]]), "undefined value 'y'")


def test_verify_rejects_value_defined_twice():
    g = _small_graph()
    # an op output redefining a runtime input
    ops = list(g.ops)
    ops[1] = replace(ops[1], outputs=("x",))
    _rejects(replace(g, ops=ops), "defined twice")
    # two ops defining the same value
    dup = Op("add", ("x", "x"), ("y",))
    _rejects(replace(g, ops=[g.ops[0], dup, *g.ops[1:]]), "defined twice")
    # an op output with a param's name
    ops = list(g.ops)
    ops[0] = replace(ops[0], outputs=("norm.w",))
    _rejects(replace(g, ops=ops, types={**g.types, "norm.w": _t(TOKENS, HIDDEN)}), "defined twice")
    # an input shadowing a param, or given twice
    _rejects(replace(g, inputs=[*g.inputs, "norm.w"]), "shadows")
    _rejects(replace(g, inputs=[*g.inputs, "x"]), "shadows")


@pytest.mark.parametrize("role", [None, Role("hidden_states"), Role("k_pages"), Role("token_ids", 3)])
def test_verify_rejects_an_input_without_a_valid_role(role):
    """Every input has a known role (the runtime fills inputs by role); state roles, and only they, name a layer."""
    g = _small_graph()
    roles = {k: v for k, v in g.roles.items() if k != "n"} | ({"n": role} if role else {})
    _rejects(replace(g, roles=roles), "no valid role")


@pytest.mark.parametrize("wrong", [_t(TOKENS, HIDDEN + 1), _t(TOKENS, HIDDEN, dtype="float16"), _t(HIDDEN), None])
def test_verify_rejects_wrong_declared_type(wrong):
    g = _small_graph()
    types = dict(g.types)
    if wrong is None:
        del types["s"]
    else:
        types["s"] = wrong
    _rejects(replace(g, types=types), "'s' is typed")


def test_verify_rejects_bad_input_types():
    g = _small_graph()
    # a runtime input whose declared type disagrees with what its reader needs
    _rejects(replace(g, types={**g.types, "x": _t(TOKENS, HIDDEN, dtype=I32)}), "linear input")
    # a runtime input with no declared type at all
    types = dict(g.types)
    del types["x"]
    _rejects(replace(g, types=types), "'x'")


def test_verify_rejects_stray_types():
    g = _small_graph()
    _rejects(replace(g, types={**g.types, "ghost": _t(TOKENS, HIDDEN)}), "never defined")


@pytest.mark.parametrize("change, match", [
    (lambda op: replace(op, attrs={}), "lacks attributes"),
    (lambda op: replace(op, attrs={"eps": 1e-6, "bogus": 1}), "unknown attributes"),
    (lambda op: replace(op, inputs=("s",)), "takes 2..2 inputs"),
    (lambda op: replace(op, inputs=("s", "norm.w", "norm2.w")), "takes 2..2 inputs"),
    (lambda op: replace(op, kind="group_norm"), "unknown op kind"),
    (lambda op: replace(op, outputs=("out", "extra")), "gives 1 outputs"),
])
def test_verify_rejects_bad_op_signature(change, match):
    g = _small_graph()
    ops = list(g.ops)
    assert ops[2].kind == "rms_norm"
    ops[2] = change(ops[2])
    _rejects(replace(g, ops=ops), match)


def test_verify_rejects_add_with_attrs():
    g = _small_graph()
    ops = list(g.ops)
    ops[1] = replace(ops[1], attrs={"eps": 1e-6})
    _rejects(replace(g, ops=ops), "unknown attributes")


def test_verify_rejects_read_after_in_place_overwrite():
    g = _cache_graph()
    # reading the old pages after paged_kv_append overwrote them
    stale = Op("paged_kv_append", ("cache", "k", "slots"), ("cache3",))
    _rejects(replace(g, ops=[*g.ops, stale], types={**g.types, "cache3": _t(PAGES, BLOCK, KV)}),
             "after an in-place op overwrote it")
    # returning the old cache
    _rejects(replace(g, outputs=["cache"]), "overwritten")


def test_verify_rejects_a_first_output_no_caller_buffer_can_take():
    """A compiled function writes its first output into its caller's buffer: so it must be the one fresh output of
    its op, not pages written in place, nor one of an op's several outputs."""
    g = _cache_graph()
    _rejects(replace(g, outputs=["cache2"]), "must come from an op with one output that writes no input")
    b, x, _, _ = _builder()
    _, y = b.op("add_rms_norm", [x, x, "norm.w"], "fused", eps=1e-6)
    _rejects(b.finish([y]), "must come from an op with one output that writes no input")


def test_verify_rejects_in_place_write_to_param():
    g = _cache_graph()
    ops = list(g.ops)
    assert ops[1].kind == "paged_kv_append"
    ops[1] = replace(ops[1], inputs=("cache_param", *ops[1].inputs[1:]))
    types = {**g.types, "cache2": _t(4, 4, KV)}
    _rejects(replace(g, ops=ops, types=types), "overwrite param 'cache_param'")


def test_verify_rejects_undefined_output():
    g = _small_graph()
    _rejects(replace(g, outputs=["nowhere"]), "output 'nowhere' is undefined")


def test_verify_checks_every_entry():
    p = _program("llama")
    step = p.entries["step_gather"]
    bad = replace(step, outputs=["missing"])
    with pytest.raises(IRError, match="llama.step_gather"):
        verify(replace(p, entries={**p.entries, "step_gather": bad}))


# ---------------------------------------------------------------------------------------------------------------
# per-op type inference: one good case and bad cases for every op kind

ATTN = {"num_heads": 4, "num_kv_heads": 2, "head_dim": 2, "scale": 0.5}
ROPE = {"head_dim": 4, "inv_freq": [1.0, 0.01]}
X = _t(TOKENS, HIDDEN)
SLICE = {"period": 4, "offset": 2, "width": 2}
DELTA_IN = {"num_k_heads": 2, "k_dim": 2}  # q, k: 2 heads of 2; v: 2 heads of 3 (14 = 4 + 4 + 6 columns)
DELTA = {**DELTA_IN, "num_v_heads": 2, "v_dim": 3, "chunk": 16}
IMAGE_ATTN = {"num_heads": 2, "head_dim": HIDDEN // 2, "scale": 0.5}

GOOD = {
    "embedding": ([_t(64, HIDDEN, dtype="bfloat16"), _t(TOKENS, dtype=I32)], {}, [X]),
    "rms_norm": ([X, _t(HIDDEN, dtype="float16")], {"eps": 1e-6}, [X]),
    "add_rms_norm": ([X, X, _t(HIDDEN)], {"eps": 1e-6}, [X, X]),
    "linear": ([X, _t(KV, HIDDEN), _t(KV)], {}, [_t(TOKENS, KV)]),
    "rope": ([X, _t(TOKENS, dtype=I32)], ROPE, [X]),
    "silu_mul": ([X, X], {}, [X]),
    "add": ([X, X], {}, [X]),
    "paged_kv_append": ([_t(9, 4, KV), _t(TOKENS, KV), _t(TOKENS, dtype=I32)], {}, [_t(9, 4, KV)]),
    "paged_attention": ([X, _t(9, 4, KV), _t(9, 4, KV), _t(3, 5, dtype=I32), _t(TOKENS, dtype=I32),
                         _t(TOKENS, dtype=I32)], ATTN, [X]),
    "take_rows": ([X, _t(3, dtype=I32)], {}, [_t(3, HIDDEN)]),
    "slice_cols": ([X], SLICE, [_t(TOKENS, HIDDEN // 2)]),
    "sigmoid_mul": ([X, X], {}, [X]),
    "delta_inputs": ([_t(TOKENS, 14), _t(TOKENS, 2), _t(TOKENS, 2), _t(2), _t(2, dtype="bfloat16"), COUNT], DELTA_IN,
                     [_t(TOKENS, 8), _t(TOKENS, 2, 2)]),
    "batch_causal_conv1d": ([X, _t(SLOTS, 3, HIDDEN), _t(HIDDEN, 1, 4), *[_t(ROWS, dtype=I32)] * 4], {},
                            [X, _t(SLOTS, 3, HIDDEN)]),
    "batch_gated_delta_rule": ([_t(TOKENS, 8), _t(TOKENS, 14), _t(TOKENS, 2, 2), _t(SLOTS, 2, 2, 3),
                                *[_t(ROWS, dtype=I32)] * 4], DELTA,
                               [_t(TOKENS, 6), _t(SLOTS, 2, 2, 3)]),
    "gather_pages": ([_t(9, 4, KV), _t(ROWS, 3, dtype=I32)], {}, [_t(ROWS, 12, KV)]),
    "padded_attention": ([X, _t(ROWS, 12, KV), _t(ROWS, 12, KV), _t(TOKENS, dtype=I32), _t(TOKENS, dtype=I32)], ATTN,
                         [X]),
    "layer_norm": ([X, _t(HIDDEN, dtype="bfloat16"), _t(HIDDEN, dtype="bfloat16")], {"eps": 1e-6}, [X]),
    "gelu": ([X], {"approximate": "tanh"}, [X]),
    "image_attention": ([X, X, X, _t(TOKENS, dtype=I32)], IMAGE_ATTN, [X]),
    "interpolated_embedding": ([_t(16, HIDDEN), _t(TOKENS, 4, dtype=I32), _t(TOKENS, 4)], {}, [X]),
    "merge_rows": ([_t(8, HIDDEN)], {"group": 4, "rows": 2}, [_t(2, 4 * HIDDEN)]),
    "merge_embeddings": ([X, X, _t(TOKENS, dtype=I32)], {}, [X]),
}


def _with(kind, i, t):
    ins, attrs, _ = GOOD[kind]
    return kind, [*ins[:i], t, *ins[i + 1:]], attrs


BAD = [
    ("embedding ids float", _with("embedding", 1, _t(TOKENS))),
    ("embedding table int", _with("embedding", 0, _t(64, HIDDEN, dtype=I32))),
    ("embedding ids rank 2", _with("embedding", 1, _t(TOKENS, 1, dtype=I32))),
    ("rms_norm input rank 1", _with("rms_norm", 0, _t(HIDDEN))),
    ("rms_norm input float16", _with("rms_norm", 0, _t(TOKENS, HIDDEN, dtype="float16"))),
    ("rms_norm weight size", _with("rms_norm", 1, _t(HIDDEN + 1))),
    ("rms_norm weight int", _with("rms_norm", 1, _t(HIDDEN, dtype=I32))),
    ("add_rms_norm residual shape", _with("add_rms_norm", 1, _t(TOKENS, HIDDEN * 2))),
    ("add_rms_norm weight size", _with("add_rms_norm", 2, _t(HIDDEN * 2))),
    ("linear in-features", _with("linear", 1, _t(KV, HIDDEN + 1))),
    ("linear weight rank", _with("linear", 1, _t(KV * HIDDEN))),
    ("linear weight int", _with("linear", 1, _t(KV, HIDDEN, dtype=I32))),
    ("linear bias size", _with("linear", 2, _t(KV + 1))),
    ("linear input int", _with("linear", 0, _t(TOKENS, HIDDEN, dtype=I32))),
    ("rope pos scalar", _with("rope", 1, SCALAR)),
    ("rope pos float", _with("rope", 1, _t(TOKENS))),
    ("rope features not multiple of head_dim", ("rope", [_t(TOKENS, 6), GOOD["rope"][0][1]], ROPE)),
    ("rope too many freqs", ("rope", GOOD["rope"][0], {"head_dim": 4, "inv_freq": [1.0, 0.1, 0.01]})),
    ("rope no freqs", ("rope", GOOD["rope"][0], {"head_dim": 4, "inv_freq": []})),
    ("silu_mul shapes differ", _with("silu_mul", 1, _t(1, HIDDEN))),
    ("silu_mul rank 3", ("silu_mul", [_t(1, TOKENS, HIDDEN)] * 2, {})),
    ("add dtypes differ", _with("add", 1, _t(TOKENS, HIDDEN, dtype="bfloat16"))),
    ("add bfloat16 activations", ("add", [_t(TOKENS, HIDDEN, dtype="bfloat16")] * 2, {})),
    ("paged_kv_append pages rank 2", _with("paged_kv_append", 0, _t(36, KV))),
    ("paged_kv_append slots float", _with("paged_kv_append", 2, _t(TOKENS))),
    ("paged_kv_append width mismatch", _with("paged_kv_append", 1, _t(TOKENS, KV + 1))),
    ("paged_attention pages width", _with("paged_attention", 1, _t(9, 4, KV + 2))),
    ("paged_attention key/value differ", _with("paged_attention", 2, _t(8, 4, KV))),
    ("paged_attention table rank 1", _with("paged_attention", 3, _t(15, dtype=I32))),
    ("paged_attention row_of length", _with("paged_attention", 4, _t(2, dtype=I32))),
    ("take_rows index float", _with("take_rows", 1, _t(3))),
    ("rope positions length", _with("rope", 1, _t(2, dtype=I32))),
    ("rms_norm group does not divide", ("rms_norm", [X, _t(3)], {"eps": 1e-6, "group": 3})),
    ("rms_norm weight not one group", ("rms_norm", [X, _t(HIDDEN)], {"eps": 1e-6, "group": 2})),
    ("rms_norm weight_offset int", ("rms_norm", [X, _t(HIDDEN)], {"eps": 1e-6, "weight_offset": 1})),
    ("add_rms_norm grouped", ("add_rms_norm", [X, X, _t(2)], {"eps": 1e-6, "group": 2})),
    ("slice_cols beyond its period", ("slice_cols", [X], {**SLICE, "offset": 3})),
    ("slice_cols period not dividing", ("slice_cols", [_t(TOKENS, 6)], SLICE)),
    ("sigmoid_mul shapes differ", _with("sigmoid_mul", 1, _t(1, HIDDEN))),
    ("delta_inputs no values", _with("delta_inputs", 0, _t(TOKENS, 8))),
    ("delta_inputs a heads", _with("delta_inputs", 1, _t(TOKENS, 3))),
    ("delta_inputs n scalar", _with("delta_inputs", 5, SCALAR)),
    ("delta_inputs A_log size", _with("delta_inputs", 3, _t(3))),
    ("delta_inputs heads zero", ("delta_inputs", GOOD["delta_inputs"][0], {**DELTA_IN, "k_dim": 0})),
    ("batch_causal_conv1d pool rank", _with("batch_causal_conv1d", 1, _t(3, HIDDEN))),
    ("batch_causal_conv1d seq_len float", _with("batch_causal_conv1d", 4, _t(ROWS))),
    ("batch_causal_conv1d seq lengths differ", _with("batch_causal_conv1d", 6, _t(2, dtype=I32))),
    ("batch_gated_delta_rule pool", _with("batch_gated_delta_rule", 3, _t(SLOTS, 2, 3, 2))),
    ("batch_gated_delta_rule qk width", _with("batch_gated_delta_rule", 0, _t(TOKENS, 6))),
    ("batch_gated_delta_rule v heads", ("batch_gated_delta_rule", GOOD["batch_gated_delta_rule"][0],
                                        {**DELTA, "num_v_heads": 3})),
    ("batch_gated_delta_rule gates", _with("batch_gated_delta_rule", 2, _t(TOKENS, 2))),
    ("batch_gated_delta_rule chunk", ("batch_gated_delta_rule", GOOD["batch_gated_delta_rule"][0],
                                      {**DELTA, "chunk": -1})),
    ("batch_causal_conv1d pool width", _with("batch_causal_conv1d", 1, _t(SLOTS, 3, HIDDEN + 1))),
    ("batch_causal_conv1d kernel size", _with("batch_causal_conv1d", 2, _t(HIDDEN, 1, 3))),
    ("batch_gated_delta_rule seq_slot rank", _with("batch_gated_delta_rule", 7, _t(ROWS, 1, dtype=I32))),
    ("gather_pages table float", _with("gather_pages", 1, _t(ROWS, 3))),
    ("gather_pages pages rank", _with("gather_pages", 0, _t(9, KV))),
    ("padded_attention histories differ", _with("padded_attention", 2, _t(ROWS, 8, KV))),
    ("padded_attention history width", _with("padded_attention", 1, _t(ROWS, 12, KV + 1))),
    ("padded_attention pos_of length", _with("padded_attention", 4, _t(2, dtype=I32))),
    ("rope pos_axes without per-axis positions", ("rope", GOOD["rope"][0], {**ROPE, "pos_axes": [0, 0]})),
    ("rope pos_axes beyond the axes", ("rope", [X, _t(TOKENS, 2, dtype=I32)], {**ROPE, "pos_axes": [0, 2]})),
    ("rope pos_axes too few", ("rope", [X, _t(TOKENS, 3, dtype=I32)], {**ROPE, "pos_axes": [0]})),
    ("layer_norm bias size", _with("layer_norm", 2, _t(HIDDEN + 1))),
    ("layer_norm input rank 1", _with("layer_norm", 0, _t(HIDDEN))),
    ("gelu unknown approximation", ("gelu", [X], {"approximate": "sigmoid"})),
    ("gelu input int", ("gelu", [_t(TOKENS, HIDDEN, dtype=I32)], {"approximate": "none"})),
    ("image_attention heads do not fit", ("image_attention", GOOD["image_attention"][0], {**IMAGE_ATTN, "num_heads": 3})),
    ("image_attention key differs", _with("image_attention", 1, _t(TOKENS, HIDDEN * 2))),
    ("image_attention images float", _with("image_attention", 3, _t(TOKENS))),
    ("interpolated_embedding weight int", _with("interpolated_embedding", 2, _t(TOKENS, 4, dtype=I32))),
    ("interpolated_embedding taps differ", _with("interpolated_embedding", 2, _t(TOKENS, 2))),
    ("merge_rows wrong row count", ("merge_rows", [_t(8, HIDDEN)], {"group": 4, "rows": 3})),
    ("merge_rows group zero", ("merge_rows", [_t(8, HIDDEN)], {"group": 0, "rows": 2})),
    ("merge_embeddings mask float", _with("merge_embeddings", 2, _t(TOKENS))),
    ("merge_embeddings inputs width", _with("merge_embeddings", 1, _t(TOKENS, HIDDEN + 1))),
]


@pytest.mark.parametrize("kind", sorted(OPS))
def test_infer_types_good(kind):
    ins, attrs, expected = GOOD[kind]
    assert infer_types(kind, ins, attrs) == expected


def test_every_op_kind_has_cases():
    assert set(GOOD) == set(OPS)
    assert {case[0] for _, case in BAD} == set(OPS)


@pytest.mark.parametrize("case", [case for _, case in BAD], ids=[name for name, _ in BAD])
def test_infer_types_rejects(case):
    kind, ins, attrs = case
    with pytest.raises(IRError):
        infer_types(kind, ins, attrs)


def test_infer_types_rejects_bad_signatures():
    with pytest.raises(IRError, match="unknown op kind"):
        infer_types("softmax", [X], {})
    with pytest.raises(IRError, match="inputs"):
        infer_types("linear", [X], {})
    with pytest.raises(IRError, match="inputs"):
        infer_types("linear", [X, _t(KV, HIDDEN), _t(KV), _t(KV)], {})
    with pytest.raises(IRError, match="lacks attributes"):
        infer_types("paged_attention", GOOD["paged_attention"][0], {k: v for k, v in ATTN.items() if k != "scale"})
    with pytest.raises(IRError, match="unknown attributes"):
        infer_types("rope", GOOD["rope"][0], {**ROPE, "theta": 10000.0})


# ---------------------------------------------------------------------------------------------------------------
# printer


def test_printer_shows_params_entries_ops_and_abbreviates_long_attrs():
    p = _program("llama", head_dim=16)  # 8 rotary frequencies: a long attr list
    text = format_program(p)
    assert text.splitlines()[0] == f"program llama ({len(p.params)} params)"
    for name, param in p.params.items():
        assert f"param {name}: {param.type}" in text
    for entry in p.entries.values():
        assert f"entry {entry.name}(" in text
        assert all(f"%{v}: {entry.types[v]}" in text for v in entry.inputs)
    assert {op.kind for g in p.entries.values() for op in g.ops} <= {"embedding", "rms_norm", "add_rms_norm",
                                                                     "linear", "rope", "silu_mul", "add",
                                                                     "paged_kv_append", "paged_attention",
                                                                     "take_rows", "gather_pages", "padded_attention"}
    for kind in {op.kind for g in p.entries.values() for op in g.ops}:
        assert f"= {kind}(" in text
    inv_freq = p.entries["step"].ops[[op.kind for op in p.entries["step"].ops].index("rope")].attrs["inv_freq"]
    assert len(inv_freq) == 8
    assert f"inv_freq=[{inv_freq[0]!r}, ... 8 values]" in text
    assert repr(inv_freq[-1]) not in text
    assert "eps=1e-05" in text and "num_heads=4" in text
    assert "@model.embed_tokens.weight" in text and "%ids" in text  # params and values are marked apart
    assert text.count("return %logits") == text.count("return %last_rows") == len(p.entries) / 2 == 2


def test_printer_keeps_short_lists():
    g = GraphBuilder("g", PARAMS)
    x = g.input("x", (TOKENS, HIDDEN), F32, "input_embeddings")
    pos = g.input("pos", (TOKENS,), I32, "token_positions")
    y = g.op("rope", [x, pos], "y", head_dim=4, inv_freq=[1.0, 0.5])
    text = format_program(_wrap(g.finish([y])))
    assert "inv_freq=[1.0, 0.5]" in text


# ---------------------------------------------------------------------------------------------------------------
# JSON round trip and the stable hash


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_json_round_trip(arch):
    p = _program(arch, param_dtypes={"model.norm.weight": "bfloat16"})
    text = to_json(p)
    q = from_json(text)
    assert to_json(q) == text
    assert stable_hash(q) == stable_hash(p)
    assert verify(q) is q
    assert q.param_types() == p.param_types()
    for name, g in p.entries.items():
        h = q.entries[name]
        assert (h.inputs, h.outputs, h.types) == (g.inputs, g.outputs, g.types)
        assert [(o.kind, o.inputs, o.outputs, o.attrs) for o in h.ops] == [(o.kind, o.inputs, o.outputs, o.attrs)
                                                                           for o in g.ops]


def test_stable_hash_is_stable_and_sensitive():
    base = stable_hash(_program("llama"))
    assert stable_hash(_program("llama")) == base  # two separately built equal programs
    assert len(base) == 64 and int(base, 16) >= 0
    changed = {
        stable_hash(_program("llama", rms_norm_eps=1e-6)),
        stable_hash(_program("llama", rope_theta=500000.0)),
        stable_hash(_program("llama", num_key_value_heads=4)),
        stable_hash(_program("llama", param_dtypes={"model.layers.0.mlp.up_proj.weight": "bfloat16"})),
        stable_hash(_program("llama", param_dtypes={"model.layers.0.mlp.up_proj.weight": "float16"})),
        stable_hash(_program("llama", torch_dtype="bfloat16")),
        stable_hash(_program("qwen2")),
    }
    assert base not in changed and len(changed) == 7


def test_from_json_refuses_unknown_format():
    d = json.loads(to_json(_program("qwen2")))
    for version in (1, 2, 3, 4, 6, 0, None, "5"):
        bad = {**d, "format": version}
        with pytest.raises(ValueError, match="format"):
            from_json(json.dumps(bad))
    without = {k: v for k, v in d.items() if k != "format"}
    with pytest.raises(ValueError, match="format"):
        from_json(json.dumps(without))


# ---------------------------------------------------------------------------------------------------------------
# passes, each alone


def _norm_after_add(read_between: bool) -> Graph:
    g, x, _, _ = _builder()
    y = g.op("linear", [x, "proj.w"], "y")
    s = g.op("add", [x, y], "s")
    extra = g.op("silu_mul", [s, y], "between") if read_between else g.op("silu_mul", [y, y], "between")
    out = g.op("rms_norm", [s, "norm.w"], "out", eps=1e-5)
    final = g.op("add", [out, extra], "final")
    res = g.op("add", [s, final], "res")
    return g.finish([res])


def test_fuse_add_rms_norm_fuses():
    g = _norm_after_add(read_between=False)
    fused = fuse_add_rms_norm(g)
    assert [op.kind for op in fused.ops] == ["linear", "silu_mul", "add_rms_norm", "add", "add"]
    op = fused.ops[2]
    assert op.inputs == ("x", "y", "norm.w")
    assert op.outputs == ("s", "out")  # the original names of the sum and the normed value
    assert op.attrs == {"eps": 1e-5}
    assert fused.types == g.types and fused.outputs == g.outputs and fused.inputs == g.inputs
    verify(_wrap(fused))
    assert [op.kind for op in g.ops] == ["linear", "add", "silu_mul", "rms_norm", "add", "add"]  # input untouched


def test_fuse_add_rms_norm_skips_when_sum_is_read_in_between():
    g = _norm_after_add(read_between=True)
    fused = fuse_add_rms_norm(g)
    assert [op.kind for op in fused.ops] == [op.kind for op in g.ops]
    verify(_wrap(fused))


def test_fuse_add_rms_norm_leaves_norm_of_non_add_alone():
    g, x, _, _ = _builder()
    y = g.op("linear", [x, "proj.w"], "y")
    out = g.op("rms_norm", [y, "norm.w"], "out", eps=1e-5)
    graph = g.finish([out])
    assert fuse_add_rms_norm(graph).ops == graph.ops


def test_fuse_add_rms_norm_two_norms_of_one_sum():
    g, x, _, _ = _builder()
    s = g.op("add", [x, x], "s")
    a = g.op("rms_norm", [s, "norm.w"], "a", eps=1e-5)
    b = g.op("rms_norm", [s, "norm2.w"], "b", eps=1e-5)
    graph = g.finish([g.op("add", [a, b], "out")])
    fused = fuse_add_rms_norm(graph)
    assert [op.kind for op in fused.ops] == ["add_rms_norm", "rms_norm", "add"]
    verify(_wrap(fused))


def test_eliminate_dead_values():
    g, x, slots, n = _builder()
    cache = g.input("cache", (PAGES, BLOCK, KV), F32, "k_pages", 0)
    k = g.op("linear", [x, "k_proj.w"], "k")
    g.op("paged_kv_append", [cache, k, slots], "cache2")  # output unused, but it writes the pages: kept
    dead1 = g.op("linear", [x, "proj.w"], "dead1")
    dead2 = g.op("add", [dead1, dead1], "dead2")
    g.op("rms_norm", [dead2, "norm.w"], "dead3", eps=1e-5)  # a chain of dead values: all dropped
    out = g.op("rms_norm", [x, "norm.w"], "out", eps=1e-5)
    graph = g.finish([out])
    live = eliminate_dead_values(graph)
    assert [op.kind for op in live.ops] == ["linear", "paged_kv_append", "rms_norm"]
    assert [op.outputs[0] for op in live.ops] == ["k", "cache2", "out"]
    assert set(live.types) == {"x", "slots", "n", "cache", "k", "cache2", "out"}
    assert live.inputs == graph.inputs and live.outputs == graph.outputs
    verify(_wrap(live))
    assert len(graph.ops) == 6 and "dead3" in graph.types  # input untouched


def test_eliminate_dead_values_keeps_unused_inputs_and_live_graphs():
    g = _small_graph()
    assert eliminate_dead_values(g) == g
    cache = _cache_graph()
    assert eliminate_dead_values(cache) == cache


def test_weight_map_transforms_are_checked_and_implemented():
    """Each param names the checkpoint tensors it is made from and a known transform, which the loader has."""
    from ir.graph import WEIGHT_TRANSFORMS
    from runtime.weights import TRANSFORMS

    assert set(TRANSFORMS) == set(WEIGHT_TRANSFORMS)
    program = _program("qwen2")
    name = next(iter(program.params))
    assert program.params[name].source_tensors == (name,)  # float checkpoints: each param is its own tensor
    for changed, match in [({"transform": "dequantise"}, "transform 'dequantise'"),
                           ({"sources": ("a", "b")}, "needs .copy. or .flatten. of 1 source")]:
        bad = replace(program, params={**program.params, name: replace(program.params[name], **changed)})
        with pytest.raises(IRError, match=match):
            verify(bad)
    assert from_json(to_json(program)).params == program.params


def test_entries_declare_their_bucket_axes_and_the_build_compiles_each_over_them():
    """The model builder says which dims of an entry vary per VM function; `Buckets.functions` needs nothing else
    (a new entry, e.g. an image encoder over patch counts, plugs in without compiler changes)."""
    from ir.contract import Buckets

    p = _program("qwen2")
    assert p.entries["step"].bucket_dims == (TOKENS, ROWS) and not p.entries["step"].optional
    assert p.entries["step_gather"].optional and p.entries["step_gather_hidden"].optional  # legacy: on request
    assert not p.entries["step_hidden"].optional
    assert from_json(to_json(p)).entries["step_gather"] == p.entries["step_gather"]
    buckets = Buckets((8, 16), (1, 4), 64, 8, entries=("step", "step_gather"))
    names = [name for name, _, _ in buckets.functions(p)]
    assert names == ["step_t1_r1", "step_t4_r1", "step_t4_r4", "step_t8_r1", "step_t8_r4", "step_t16_r1",
                     "step_t16_r4", "step_gather_t1_r1", "step_gather_t4_r1", "step_gather_t4_r4",
                     "step_gather_t8_r1", "step_gather_t8_r4", "step_gather_t16_r1", "step_gather_t16_r4"]
    _, _, dims = buckets.functions(p)[2]
    assert dims[TOKENS] == 4 and dims[ROWS] == 4 and dims[PAGES] == 8 and dims[BLOCK] == 16
    # one graph compiled over nothing but the arena: a single function named after the entry
    g = GraphBuilder("encode", PARAMS)
    g.input("x", (3, HIDDEN), F32, "input_embeddings")
    assert Buckets((8,), (1,), 64, 8, entries=("encode",)).functions(_wrap(g.finish(["x"])))[0][0] == "encode"


@pytest.mark.parametrize("dims", [("pages",), (TOKENS, TOKENS), (ROWS,)])
def test_verify_rejects_bad_bucket_dims(dims):
    g = _small_graph()  # its inputs use TOKENS only
    _rejects(replace(g, bucket_dims=dims), "bucket dims")
