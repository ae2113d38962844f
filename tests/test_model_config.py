"""config.json -> DecoderConfig: validation errors, derived fields, and RoPE frequencies vs transformers."""

from __future__ import annotations

import json
import math

import pytest

import models
from ir import RudaError
from models import ModelConfigError, checkpoint_shapes, load_config, parse_config

SOURCE = "/models/tiny/config.json"

LLAMA = {
    "model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 256, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
QWEN2 = {
    "model_type": "qwen2", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 1, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "max_position_embeddings": 256, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "tie_word_embeddings": True, "eos_token_id": [5, 6],
}
BASE = {"llama": LLAMA, "qwen2": QWEN2}
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}
DROP = object()


def _raw(arch="llama", **changes) -> dict:
    raw = dict(BASE[arch])
    for k, v in changes.items():
        if v is DROP:
            raw.pop(k, None)
        else:
            raw[k] = v
    return raw


def _error(raw: dict, source: str = SOURCE) -> str:
    with pytest.raises(ModelConfigError) as e:
        parse_config(raw, source)
    return str(e.value)


# ---------------------------------------------------------------------------------------------------------------
# errors: each names the source and the field


ERRORS = [
    # (id, arch, changes, field the message must name, further text it must hold)
    ("missing hidden_size", "llama", {"hidden_size": DROP}, "hidden_size", "missing"),
    ("null hidden_size", "llama", {"hidden_size": None}, "hidden_size", "missing"),
    ("missing vocab_size", "qwen2", {"vocab_size": DROP}, "vocab_size", "missing"),
    ("missing intermediate_size", "llama", {"intermediate_size": DROP}, "intermediate_size", "missing"),
    ("missing num_hidden_layers", "llama", {"num_hidden_layers": DROP}, "num_hidden_layers", "missing"),
    ("missing num_attention_heads", "qwen2", {"num_attention_heads": DROP}, "num_attention_heads", "missing"),
    ("float hidden_size", "llama", {"hidden_size": 64.0}, "hidden_size", "integer"),
    ("string hidden_size", "llama", {"hidden_size": "64"}, "hidden_size", "integer"),
    ("bool hidden_size", "llama", {"hidden_size": True}, "hidden_size", "integer"),
    ("zero hidden_size", "llama", {"hidden_size": 0}, "hidden_size", "an integer in 1.."),
    ("negative intermediate_size", "qwen2", {"intermediate_size": -96}, "intermediate_size", "an integer in 1.."),
    ("zero layers", "llama", {"num_hidden_layers": 0}, "num_hidden_layers", "an integer in 1..1024"),
    ("a million layers", "llama", {"num_hidden_layers": 10**6}, "num_hidden_layers", "an integer in 1..1024"),
    ("zero vocab", "llama", {"vocab_size": 0}, "vocab_size", "an integer in 1.."),
    ("zero kv heads", "llama", {"num_key_value_heads": 0}, "num_key_value_heads", "an integer in 1.."),
    ("float kv heads", "qwen2", {"num_key_value_heads": 1.5}, "num_key_value_heads", "integer"),
    ("zero max positions", "llama", {"max_position_embeddings": 0}, "max_position_embeddings", "an integer in 1.."),
    ("kv heads do not divide heads", "llama", {"num_key_value_heads": 3}, "num_key_value_heads",
     "must divide num_attention_heads (4)"),
    ("hidden not a multiple of heads", "llama", {"hidden_size": 66}, "hidden_size", "head_dim"),
    ("null head_dim, hidden not a multiple of heads", "qwen2", {"hidden_size": 66, "head_dim": None}, "hidden_size",
     "head_dim"),
    ("zero head_dim", "llama", {"head_dim": 0}, "head_dim", "an integer in 1.."),
    ("odd head_dim", "llama", {"head_dim": 15}, "head_dim", "even"),
    ("unsupported model_type", "llama", {"model_type": "mistral"}, "model_type", "supported: llama, qwen2"),
    ("missing model_type", "llama", {"model_type": DROP}, "model_type", "missing"),
    ("awq without group_size", "qwen2", {"quantization_config": {"quant_method": "awq", "bits": 4}},
     "group_size", "missing"),
    ("gptq", "llama", {"quantization_config": {"quant_method": "gptq"}}, "quant_method", "supported: 'awq'"),
    ("hidden_act gelu", "llama", {"hidden_act": "gelu"}, "hidden_act", "silu"),
    ("hidden_act qwen2", "qwen2", {"hidden_act": "relu"}, "hidden_act", "silu"),
    ("llama attention_bias", "llama", {"attention_bias": True}, "attention_bias", "not supported"),
    ("llama mlp_bias", "llama", {"mlp_bias": True}, "mlp_bias", "not supported"),
    ("qwen2 sliding window", "qwen2", {"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window",
     "not supported"),
    ("rope yarn", "llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 4096}}, "rope_type", "yarn"),
    ("rope dynamic, old 'type' key", "qwen2", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling",
     "dynamic"),
    ("rope_parameters yarn", "llama", {"rope_theta": DROP, "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                                              "rope_theta": 10000.0}},
     "rope_parameters", "yarn"),
    ("rope_scaling not an object", "llama", {"rope_scaling": "linear"}, "rope_scaling", "object"),
    ("rope_parameters not an object", "llama", {"rope_parameters": [1, 2]}, "rope_parameters", "object"),
    ("llama3 high == low", "llama", {"rope_scaling": {**LLAMA3_SCALING, "high_freq_factor": 1.0}},
     "high_freq_factor", "low_freq_factor"),
    ("llama3 high < low", "llama", {"rope_scaling": {**LLAMA3_SCALING, "high_freq_factor": 0.5}},
     "high_freq_factor", "low_freq_factor"),
    ("llama3 missing factor", "llama", {"rope_scaling": {k: v for k, v in LLAMA3_SCALING.items() if k != "factor"}},
     "factor", "missing"),
    ("llama3 missing original length", "llama",
     {"rope_scaling": {k: v for k, v in LLAMA3_SCALING.items() if k != "original_max_position_embeddings"}},
     "original_max_position_embeddings", "missing"),
    ("linear zero factor", "llama", {"rope_scaling": {"rope_type": "linear", "factor": 0.0}}, "factor", "> 0"),
    ("zero rope_theta", "llama", {"rope_theta": 0}, "rope_theta", "> 0"),
    ("string rope_theta", "qwen2", {"rope_theta": "1e6"}, "rope_theta", "number"),
    ("nan rms_norm_eps", "llama", {"rms_norm_eps": float("nan")}, "rms_norm_eps", "finite"),
    ("negative rms_norm_eps", "llama", {"rms_norm_eps": -1e-6}, "rms_norm_eps", "> 0"),
    ("invalid torch_dtype", "llama", {"torch_dtype": "int8"}, "torch_dtype", "supported: float32, float16, bfloat16"),
    ("invalid v5 dtype", "qwen2", {"torch_dtype": DROP, "dtype": "float64"}, "dtype", "float64"),
    ("eos string", "llama", {"eos_token_id": "2"}, "eos_token_id", "integer"),
    ("eos float", "llama", {"eos_token_id": 2.0}, "eos_token_id", "integer"),
    ("eos bool", "llama", {"eos_token_id": True}, "eos_token_id", "integer"),
    ("eos list with a string", "qwen2", {"eos_token_id": [5, "6"]}, "eos_token_id", "integer"),
    ("eos object", "qwen2", {"eos_token_id": {"id": 5}}, "eos_token_id", "integer"),
    ("bos string", "llama", {"bos_token_id": "1"}, "bos_token_id", "integer"),
    ("tie not a bool", "qwen2", {"tie_word_embeddings": "yes"}, "tie_word_embeddings", "true or false"),
]


@pytest.mark.parametrize("arch, changes, field, text", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_config_errors(arch, changes, field, text):
    msg = _error(_raw(arch, **changes))
    assert msg.startswith(SOURCE), msg
    assert f"'{field}'" in msg or f"({field})" in msg, msg
    assert text in msg, msg


def test_errors_are_user_errors():
    assert issubclass(ModelConfigError, RudaError)


def test_unsupported_model_type_lists_supported():
    msg = _error(_raw(model_type="gpt2"))
    assert "'gpt2'" in msg and all(arch in msg for arch in models.ARCHITECTURES)


def test_error_in_rope_scaling_names_the_sub_object():
    msg = _error(_raw(rope_scaling={"rope_type": "yarn", "factor": 4.0}))
    assert msg.startswith(f"{SOURCE} (rope_scaling)")
    msg = _error(_raw(rope_theta=DROP, rope_parameters={**LLAMA3_SCALING, "rope_theta": 5e5, "low_freq_factor": 9.0}))
    assert msg.startswith(f"{SOURCE} (rope_parameters)") and "'high_freq_factor'" in msg


def test_default_source_name():
    raw = _raw(hidden_size=DROP)
    with pytest.raises(ModelConfigError, match=r"^config\.json: field 'hidden_size' is missing"):
        parse_config(raw)


# ---------------------------------------------------------------------------------------------------------------
# load_config on a directory


def test_load_config_missing_dir(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelConfigError, match="not a directory") as e:
        load_config(missing)
    assert str(missing) in str(e.value)


def test_load_config_file_instead_of_dir(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    with pytest.raises(ModelConfigError, match="not a directory"):
        load_config(path)


def test_load_config_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelConfigError, match="missing") as e:
        load_config(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)


@pytest.mark.parametrize("content, match", [
    ('{"model_type": "llama", ', "not valid JSON"),
    ("", "not valid JSON"),
    (b"\xff\xfe{}", "not valid JSON"),
    ("[1, 2, 3]", "must hold a JSON object"),
    ('"llama"', "must hold a JSON object"),
])
def test_load_config_invalid_json(tmp_path, content, match):
    path = tmp_path / "config.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(ModelConfigError, match=match) as e:
        load_config(tmp_path)
    assert str(path) in str(e.value)


def test_load_config_ok_and_errors_name_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN2))
    assert load_config(tmp_path) == parse_config(QWEN2)
    assert load_config(str(tmp_path)) == parse_config(QWEN2)
    path.write_text(json.dumps(_raw("qwen2", num_key_value_heads=3)))
    with pytest.raises(ModelConfigError) as e:
        load_config(tmp_path)
    assert str(e.value).startswith(f"{path}: field 'num_key_value_heads'")


# ---------------------------------------------------------------------------------------------------------------
# derived and defaulted fields


def test_llama_config_fields():
    c = parse_config(LLAMA)
    assert (c.model_type, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (
        "llama", 96, 64, 96, 2)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert (c.rms_norm_eps, c.max_position_embeddings, c.dtype) == (1e-5, 256, "bfloat16")
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))
    assert c.tie_word_embeddings is False and c.qkv_bias is False
    assert len(c.rope_inv_freq) == c.head_dim // 2


def test_head_dim_derived_vs_explicit():
    assert parse_config(_raw(head_dim=DROP)).head_dim == 64 // 4
    assert parse_config(_raw(head_dim=None)).head_dim == 64 // 4
    c = parse_config(_raw(head_dim=32))  # explicit, not hidden / heads
    assert c.head_dim == 32 and len(c.rope_inv_freq) == 16
    shapes = checkpoint_shapes(c)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4 * 32, 64)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (2 * 32, 64)
    assert shapes["model.layers.1.self_attn.o_proj.weight"] == (64, 4 * 32)
    # an explicit head_dim also covers a hidden size that heads do not divide
    assert parse_config(_raw(hidden_size=66, head_dim=16)).head_dim == 16
    models.build_program(c)


def test_kv_heads_default_to_heads():
    c = parse_config(_raw(num_key_value_heads=DROP))
    assert c.num_key_value_heads == c.num_attention_heads == 4
    assert checkpoint_shapes(c)["model.layers.0.self_attn.k_proj.weight"] == (64, 64)
    assert parse_config(_raw("qwen2", num_key_value_heads=None)).num_key_value_heads == 4


def test_defaults():
    minimal = {k: LLAMA[k] for k in ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                                     "num_hidden_layers", "num_attention_heads")}
    c = parse_config(minimal)
    assert (c.rms_norm_eps, c.max_position_embeddings, c.dtype) == (1e-6, 2048, "float32")
    assert (c.bos_token_id, c.eos_token_ids) == (None, ())
    assert c.rope_inv_freq == tuple(1.0 / 10000.0 ** (2 * i / 16) for i in range(8))
    assert parse_config({**minimal, "dtype": "float16"}).dtype == "float16"  # the transformers v5 field
    assert parse_config({**minimal, "torch_dtype": "float16", "dtype": "bfloat16"}).dtype == "float16"


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tie_word_embeddings(arch):
    untied = parse_config(_raw(arch, tie_word_embeddings=DROP))
    assert untied.tie_word_embeddings is False  # both transformers classes default to untied
    assert checkpoint_shapes(untied)["lm_head.weight"] == (96, 64)
    tied = parse_config(_raw(arch, tie_word_embeddings=True))
    assert tied.tie_word_embeddings is True
    assert "lm_head.weight" not in checkpoint_shapes(tied)
    assert "lm_head.weight" not in models.build_program(tied).params
    assert "lm_head.weight" in models.build_program(untied).params


def test_qkv_biases():
    q = checkpoint_shapes(parse_config(QWEN2))
    lm = checkpoint_shapes(parse_config(LLAMA))
    for i in range(2):
        p = f"model.layers.{i}.self_attn."
        assert q[p + "q_proj.bias"] == (64,)
        assert q[p + "k_proj.bias"] == q[p + "v_proj.bias"] == (16,)
        assert p + "o_proj.bias" not in q
    assert not [n for n in lm if n.endswith(".bias")]
    assert sorted(n for n in q if n.endswith(".bias")) == sorted(
        f"model.layers.{i}.self_attn.{x}_proj.bias" for i in range(2) for x in "qkv")
    assert parse_config(QWEN2).qkv_bias is True


@pytest.mark.parametrize("eos, expected", [(7, (7,)), ([7], (7,)), ([7, 8, 9], (7, 8, 9)), ([], ()), (None, ())])
def test_eos_forms(eos, expected):
    assert parse_config(_raw(eos_token_id=eos)).eos_token_ids == expected


def test_checkpoint_tensor_shapes_of_raw_config():
    assert models.checkpoint_tensor_shapes(QWEN2) == checkpoint_shapes(parse_config(QWEN2))
    with pytest.raises(ModelConfigError):
        models.checkpoint_tensor_shapes(_raw(hidden_size=DROP))


# ---------------------------------------------------------------------------------------------------------------
# against transformers: checkpoint names/shapes and RoPE frequencies


def _hf_config(raw: dict):
    transformers = pytest.importorskip("transformers")
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[raw["model_type"]]
    return cls(**{k: v for k, v in raw.items() if k != "model_type"})


@pytest.mark.parametrize("arch, changes", [
    ("llama", {}), ("llama", {"tie_word_embeddings": True}), ("llama", {"head_dim": 32, "num_key_value_heads": 4}),
    ("qwen2", {}), ("qwen2", {"tie_word_embeddings": False}),
])
def test_checkpoint_shapes_match_transformers(arch, changes):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    raw = _raw(arch, **changes)
    hf = _hf_config(raw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    hf_shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if hf.tie_word_embeddings:
        hf_shapes.pop("lm_head.weight")  # the same tensor as the embedding; checkpoints store it once
    assert checkpoint_shapes(parse_config(raw)) == hf_shapes


def _hf_inv_freq(raw: dict) -> list[float]:
    """inv_freq as transformers computes it for this config."""
    pytest.importorskip("torch")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    hf = _hf_config(raw)
    rope_type = hf.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        inv_freq, scaling = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, device=None)
    assert scaling == 1.0
    # the module the model actually runs agrees
    assert LlamaRotaryEmbedding(config=hf).inv_freq.tolist() == inv_freq.tolist()
    return inv_freq.double().tolist()


ROPE_CASES = {
    "default": {"rope_theta": 12345.0},
    "default, explicit head_dim": {"rope_theta": 500000.0, "head_dim": 32},
    "default via rope_scaling": {"rope_scaling": {"rope_type": "default"}},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "linear, old 'type' key": {"rope_theta": 1000.0, "rope_scaling": {"type": "linear", "factor": 2.5}},
    "llama3": {"rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_SCALING, original_max_position_embeddings=64)},
    "llama3, real 3.1 values": {"hidden_size": 512, "intermediate_size": 128, "rope_theta": 500000.0,
                                "rope_scaling": LLAMA3_SCALING},
    "llama3, other factors": {"rope_theta": 10000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 2.0, "high_freq_factor": 16.0,
        "original_max_position_embeddings": 512}},
}


@pytest.mark.parametrize("changes", list(ROPE_CASES.values()), ids=list(ROPE_CASES))
def test_rope_inv_freq_matches_transformers(changes):
    raw = _raw(**changes)
    ours = parse_config(raw).rope_inv_freq
    theirs = _hf_inv_freq(raw)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a == pytest.approx(b, rel=1e-6, abs=0)


def test_llama3_cases_cover_every_wavelength_band():
    """The llama3 cases above keep some frequencies, divide some by the factor and smooth the rest."""
    for name in ("llama3", "llama3, real 3.1 values", "llama3, other factors"):
        raw = _raw(**ROPE_CASES[name])
        s = raw["rope_scaling"]
        c = parse_config(raw)
        base = parse_config(_raw(**{**ROPE_CASES[name], "rope_scaling": None})).rope_inv_freq
        ratios = [b / f for f, b in zip(c.rope_inv_freq, base)]
        assert any(r == 1.0 for r in ratios), name
        assert any(r == pytest.approx(s["factor"]) for r in ratios), name
        assert any(1.0 < r < s["factor"] * (1 - 1e-9) for r in ratios), name
        assert all(1.0 <= r <= s["factor"] * (1 + 1e-12) for r in ratios), name
        old = s["original_max_position_embeddings"]
        for f, r in zip(base, ratios):
            wavelen = 2 * math.pi / f
            if wavelen < old / s["high_freq_factor"]:
                assert r == 1.0
            elif wavelen > old / s["low_freq_factor"]:
                assert r == pytest.approx(s["factor"])


def test_qwen2_rope_matches_transformers():
    pytest.importorskip("torch")
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    hf = _hf_config(QWEN2)
    theirs = Qwen2RotaryEmbedding(config=hf).inv_freq.double().tolist()
    ours = parse_config(QWEN2).rope_inv_freq
    assert ours == pytest.approx(theirs, rel=1e-6, abs=0)


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    LLAMA3_SCALING,
    dict(LLAMA3_SCALING, original_max_position_embeddings=64),
], ids=["default", "linear", "llama3", "llama3 short"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rope_parameters_form_equals_classic_form(arch, scaling):
    theta = 500000.0
    classic = parse_config(_raw(arch, rope_theta=theta, rope_scaling=scaling))
    params = {"rope_type": "default", "rope_theta": theta} if scaling is None else {**scaling, "rope_theta": theta}
    v5 = parse_config(_raw(arch, rope_theta=DROP, rope_parameters=params))
    assert v5.rope_inv_freq == classic.rope_inv_freq
    assert v5 == classic
    # rope_theta may also stay at the top level next to rope_parameters
    top = parse_config(_raw(arch, rope_theta=theta,
                            rope_parameters={k: v for k, v in params.items() if k != "rope_theta"}))
    assert top.rope_inv_freq == classic.rope_inv_freq
    if scaling is not None and arch == "llama":
        ours = v5.rope_inv_freq
        theirs = _hf_inv_freq(_raw(arch, rope_theta=DROP, rope_parameters=params))
        assert ours == pytest.approx(theirs, rel=1e-6, abs=0)


def test_rope_changes_program_hash():
    from ir import stable_hash

    a = stable_hash(models.build_program(parse_config(LLAMA)))
    b = stable_hash(models.build_program(parse_config(_raw(rope_scaling={"rope_type": "linear", "factor": 2.0}))))
    assert a != b


def test_partial_rotary_factor_is_refused():
    raw = {"model_type": "llama", "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 1, "num_attention_heads": 4, "partial_rotary_factor": 0.5}
    with pytest.raises(ModelConfigError, match="field 'partial_rotary_factor' must be 1.0"):
        parse_config(raw, "cfg.json")
