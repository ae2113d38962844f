"""AutoAWQ GEMM INT4 checkpoints: the packing, every config error, the loaders, the kernels against numpy, and whole
models against transformers on the same weights dequantised into a plain float checkpoint.

The dequantiser here is written independently of ours: it reads each column's nibble by the documented order
(nibble slot i of word c holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import tvm
from bf16_cases import packed_parts
from numpy_reference import packed_dequantise, unpack
from safetensors.numpy import load_file, save_file

import models
from compiler.build import build
from compiler.kernels import make_kernel
from compiler.target import cpu_target
from ir import IRError, Packing, TensorType, infer_types
from ir.cpu_features import host_cpu_flags
from ir.packing import KQ_BLOCK, pair_column, pair_index, pair_position, pair_scale, pair_tile_words
from models.checkpoint import CheckpointError
from models.quantization import awq_pack
from models.tiny import awq_quantize, tiny_config, write_tiny_checkpoint
from runtime import (CompiledModel, GreedyGenerationConfig, load_huggingface_awq_qwen2_pipeline,
                     load_huggingface_llama_pipeline, load_huggingface_qwen2_pipeline, load_pipeline)
from runtime.weights import TRANSFORMS, pair_scales, pair_words
from schedules import cpu
from schedules.cpu import schedule


def dequantised_checkpoint(awq_dir, out_dir):
    """A float32 copy of an AWQ checkpoint (no quantization_config), for transformers to read as a plain model."""
    shutil.copytree(awq_dir, out_dir)
    tensors = load_file(awq_dir / "model.safetensors")
    plain = {}
    for name, array in tensors.items():
        if name.endswith(".qweight"):
            module = name.removesuffix(".qweight")
            plain[f"{module}.weight"] = packed_dequantise(array, tensors[f"{module}.qzeros"],
                                                          tensors[f"{module}.scales"])
        elif not name.endswith((".qzeros", ".scales")):
            plain[name] = np.ascontiguousarray(array, dtype=np.float32)
    save_file(plain, out_dir / "model.safetensors")
    config = json.loads((out_dir / "config.json").read_text())
    del config["quantization_config"]
    (out_dir / "config.json").write_text(json.dumps(config | {"torch_dtype": "float32"}))
    return out_dir


def test_packing_matches_the_documented_nibble_order():
    values = np.arange(16, dtype=np.int64).reshape(1, 16)  # column c holds c
    words = awq_pack(values).view(np.uint32)
    # slot i of word 0 holds column [0, 2, 4, 6, 1, 3, 5, 7][i]: nibbles 0, 2, 4, 6, 1, 3, 5, 7 from the bottom
    assert words[0, 0] == 0x75316420 and words[0, 1] == 0xFDB9ECA8
    np.testing.assert_array_equal(unpack(awq_pack(values), 16), values)


@pytest.mark.parametrize("group", [32, 64, -1])
def test_quantised_matrix_dequantises_close_to_the_float_one(group):
    weight = np.random.default_rng(0).standard_normal((24, 128)).astype(np.float32)
    qweight, qzeros, scales = awq_quantize(weight, group)
    groups = 1 if group == -1 else 128 // group
    assert qweight.shape == (128, 3) and qzeros.shape == (groups, 3) and scales.shape == (groups, 24)
    assert scales.dtype == np.float16
    err = np.abs(packed_dequantise(qweight, qzeros, scales) - weight)
    assert (err <= np.repeat(scales.astype(np.float32), 128 // groups, axis=0).T * 0.5 + 1e-3).all()


def _awq_config(**quant):
    """A tiny Qwen2 config.json dict with an AWQ quantization_config (fields given None are left out)."""
    fields = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True} | quant
    return tiny_config("qwen2", dtype="float16") | {
        "quantization_config": {k: v for k, v in fields.items() if v is not None}}


CONFIG_ERRORS = [
    ({"quant_method": "gptq"}, "quant_method", "'gptq'; supported: 'awq'"),
    ({"bits": 8}, "bits", "is 8; supported: 4"),
    ({"bits": None}, "bits", "missing"),
    ({"version": "gemv"}, "version", "'gemv'; supported: 'gemm'"),
    ({"version": "marlin"}, "version", "supported: 'gemm'"),
    ({"zero_point": False}, "zero_point", "False; supported: true"),
    ({"group_size": 0}, "group_size", "is 0; supported: a positive group size, or -1"),
    ({"group_size": -2}, "group_size", "supported: a positive group size, or -1"),
    ({"group_size": "128"}, "group_size", "'128'"),
    ({"group_size": 48}, "group_size", "is 48, but model.layers.0.self_attn.q_proj.weight [64, 64] cannot be packed: "
                                       "group 48 does not divide the 64 input rows"),
    ({"group_size": 1}, "group_size", "is 1, but model.layers.0.self_attn.q_proj.weight [64, 64] cannot be packed: "
                                      "group 1 is odd; the kernels read input rows in pairs, so groups must be even"),
    ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert", "must be a list of module names"),
    ({"packed_modules": {"model.layers.0.mlp.down_proj": ["awq_int4", 32, 2]}}, "packed_modules",
     "must map module names to [kind, group, planes, block]"),
    ({"packed_modules": {"model.layers.0.mlp.down_proj": ["awq_int4", 32, 2, 128]}}, "packed_modules",
     "[kind, group, planes, block]"),  # two-level scales come in blocks of 256 rows
]


@pytest.mark.parametrize("changes, field, text", CONFIG_ERRORS, ids=[f"{e[1]}={e[0][e[1]]!r}" for e in CONFIG_ERRORS])
def test_quantization_config_errors_name_the_field_value_and_what_is_supported(changes, field, text):
    raw = _awq_config(**changes)
    with pytest.raises(models.ModelConfigError) as e:
        models.parse_config(raw, "m/config.json")
    msg = str(e.value)
    assert msg.startswith("m/config.json: quantization_config: field ") and f"'{field}'" in msg and text in msg, msg


def test_quantization_config_must_be_an_object():
    raw = _awq_config()
    raw["quantization_config"] = "awq"
    with pytest.raises(models.ModelConfigError, match="field 'quantization_config' must be an object"):
        models.parse_config(raw, "m/config.json")


def test_accepted_config_and_what_it_packs():
    raw = _awq_config(group_size=-1, version="GEMM", modules_to_not_convert=["mlp.down_proj"])
    config = models.parse_config(raw)
    assert config.quantization.group_size == -1
    shapes = models.tensor_shapes(config)
    assert shapes["model.layers.0.self_attn.q_proj.qweight"] == (64, 8)
    assert shapes["model.layers.0.self_attn.q_proj.qzeros"] == (1, 8)
    assert shapes["model.layers.0.mlp.up_proj.scales"] == (1, 128)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 128)  # left unquantised
    assert "model.layers.0.self_attn.q_proj.weight" not in shapes and "model.embed_tokens.weight" in shapes


def test_packed_types_are_checked_by_the_verifier():
    good = TensorType((32, 64), "float16", Packing("awq_int4", 32))
    assert [str(t) for t in good.parts()] == ["int32[1, 64, 4]", "int32[2, 4]", "float16[2, 32]"]  # 4-word tiles
    wide = TensorType((1024, 64), "float16", Packing("awq_int4", 32))
    assert str(wide.parts()[0]) == "int32[8, 64, 16]"  # 128 words a row: tiles of a 64-byte line
    pairs = TensorType((1024, 64), "float16", Packing("awq_int4_pairs", 32))
    assert [str(t) for t in pairs.parts()] == ["int32[16, 32, 16]", "int32[16, 1, 16]", "float16[16, 2, 64]"]
    x = TensorType((3, 64), "float32")
    with pytest.raises(IRError, match="group 31 is odd"):
        infer_types("linear", [TensorType((3, 62), "float32"),
                               TensorType((32, 62), "float16", Packing("awq_int4_pairs", 31))], {})
    with pytest.raises(IRError, match="group 48 does not divide the 64 input rows"):
        infer_types("linear", [x, TensorType((32, 64), "float16", Packing("awq_int4", 48))], {})
    k_quant = TensorType((64, 512), "float32", Packing("affine_int4_pairs", 32, 1, KQ_BLOCK))
    assert [str(t) for t in k_quant.parts()] == ["int32[1, 256, 16]", "int32[1, 6, 64]", "int32[1, 6, 64]"]  # two
    # blocks of a float and two words of eight bytes
    with pytest.raises(IRError, match="blocks of 256 rows must hold a multiple of 4 groups of 128"):
        infer_types("linear", [TensorType((3, 512), "float32"),
                               TensorType((64, 512), "float32", Packing("affine_int4_pairs", 128, 1, KQ_BLOCK))], {})
    with pytest.raises(IRError, match="divide the 320 input rows"):
        infer_types("linear", [TensorType((3, 320), "float32"),
                               TensorType((64, 320), "float32", Packing("affine_int4_pairs", 32, 1, KQ_BLOCK))], {})
    with pytest.raises(IRError, match="block 128; two-level scales come in blocks of 256"):
        infer_types("linear", [TensorType((3, 512), "float32"),
                               TensorType((64, 512), "float32", Packing("affine_int4_pairs", 32, 1, 128))], {})
    with pytest.raises(IRError, match="not a multiple of the 8"):
        infer_types("linear", [x, TensorType((30, 64), "float16", Packing("awq_int4", 32))], {})
    with pytest.raises(IRError, match="rms_norm weight cannot be packed"):
        infer_types("rms_norm", [x, TensorType((64,), "float16", Packing("awq_int4", 32))], {"eps": 1e-6})


LAYOUTS = {"cpu": ("awq_int4_pairs", None, 1, 64, 0), "cpu-avx2": ("awq_int4_pairs", "x86-64-v3", 1, 64, 0),
           "gpu": ("awq_int4", None, 1, 64, 0), "cpu-affine": ("affine_int4_pairs", None, 1, 64, 0),
           "gpu-affine": ("affine_int4", None, 1, 64, 0), "cpu-planes": ("awq_int4_pairs", None, 2, 64, 0),
           "cpu-affine-planes": ("affine_int4_pairs", None, 2, 64, 0), "gpu-planes": ("awq_int4", None, 2, 64, 0),
           # two-level scales (a GGUF file's K-quants), groups of 32 (Q4_K, Q5_K: two words of bytes a block) and
           # of 16 (Q6_K's planes; Q2_K's and Q3_K's values in one plane: four words a block)
           "cpu-k": ("affine_int4_pairs", None, 1, 32, KQ_BLOCK),
           "cpu-k-planes": ("awq_int4_pairs", None, 2, 32, KQ_BLOCK),
           "cpu-k-affine-planes": ("affine_int4_pairs", None, 2, 32, KQ_BLOCK),
           "cpu-k16": ("awq_int4_pairs", None, 1, 16, KQ_BLOCK),
           "cpu-k16-affine": ("affine_int4_pairs", None, 1, 16, KQ_BLOCK),
           "gpu-k": ("affine_int4", None, 1, 32, KQ_BLOCK), "gpu-k-planes": ("awq_int4", None, 2, 32, KQ_BLOCK),
           "gpu-k16-affine": ("affine_int4", None, 1, 16, KQ_BLOCK)}


def _packing(layout: str) -> Packing:
    """The packing of a test layout."""
    kind, _, planes, group, block = LAYOUTS[layout]
    return Packing(kind, group, planes, block)


def _activations(rng, rows, inp):
    """Rows of x with what the integer activations must survive: a block of zeros, an outlier 3e4 times the rest."""
    x = rng.standard_normal((rows, inp)).astype(np.float32)
    x[:, 64:128] = 0
    x[-1, 130] = 3e4
    return x


@pytest.mark.parametrize("layout,rows", [(layout, rows) for layout in LAYOUTS for rows in (1, 3, 8, 16, 32)
                                         if layout != "cpu-avx2" or rows <= 3])  # AVX2: its 8-lane kernel
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out", [40, 384, 512])  # pairs layout: 2-word tiles (too narrow for SIMD); 6 and 8 tiles
# of 16 words (one row: a tile a task; two a task)
def test_packed_linear_kernel_matches_numpy(rows, bias, out, layout):
    """Each layout's kernel (the GPU's: its definition, run here) against the independent dequantiser; rows of 16 or
    fewer, and rows no multiple of the SIMD width, take the integer dot products on a CPU. Affine kinds take float
    offsets in place of the zero points; a weight of planes, the sum of each group's planes."""
    mcpu, planes = LAYOUTS[layout][1:3]
    packing = _packing(layout)
    rng = np.random.default_rng(rows)
    inp = 512
    stored = packed_parts(rng, packing, out, inp)
    x = _activations(rng, rows, inp)
    b = rng.standard_normal(out).astype(np.float16)
    types = [TensorType(x.shape, "float32"), TensorType((out, inp), "float16", packing)]
    types += [TensorType((out,), "float16")] if bias else []
    target = cpu_target(mcpu) if mcpu else cpu_target()
    func = make_kernel("linear", types, {}).func
    lib = tvm.compile(schedule(func, "linear", {}, target), target.tvm_target())
    if packing.paired and out % (4 * target.lanes) == 0 and (rows <= 16 or rows % target.lanes):
        asm = lib.mod.inspect_source("s")  # the integer pair dot products are the kernel here
        assert "vpdpwssd" in asm or "vpmaddwd" in asm
    y = tvm.runtime.empty((rows, out), "float32")
    parts = TRANSFORMS[packing.transform](stored)
    lib["main"](*[tvm.runtime.tensor(a) for a in (x, *parts) + ((b,) if bias else ())], y)
    weight = packed_dequantise(*stored, planes, packing.affine)
    want = x.astype(np.float64) @ weight.T.astype(np.float64) + (b.astype(np.float64) if bias else 0)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("layout", [layout for layout in LAYOUTS if layout != "cpu-avx2"])
def test_packed_embedding_rows_match_numpy(layout):
    """A packed table's rows looked up by id (a GGUF file's embedding), each layout, against the independent
    dequantiser: ids in every column tile and every slot of a word, repeated and out of order."""
    packing, out, inp = _packing(layout), 384, 512
    planes = packing.planes
    stored = packed_parts(np.random.default_rng(3), packing, out, inp)
    ids = np.array([383, 0, 17, 17, 200, 129, 64, 255, 1, 8], np.int32)
    target = cpu_target()
    func = make_kernel("embedding", [TensorType((out, inp), "float16", packing), TensorType(ids.shape, "int32")],
                       {}).func
    lib = tvm.compile(schedule(func, "embedding", {}, target), target.tvm_target())
    y = tvm.runtime.empty((len(ids), inp), "float32")
    lib["main"](*[tvm.runtime.tensor(a) for a in (*TRANSFORMS[packing.transform](stored), ids)], y)
    weight = packed_dequantise(*stored, planes, packing.affine)
    np.testing.assert_allclose(y.numpy(), weight[ids], rtol=1e-6, atol=1e-7 * np.abs(weight).max())


@pytest.mark.parametrize("mcpu", [None, "x86-64-v3", "skylake-avx512", "znver4"])
def test_integer_pair_dot_products_are_the_instructions_used(mcpu):
    """The decode kernel multiplies 16-bit pairs: vpdpwssd where the CPU has AVX512-VNNI, else pmaddwd."""
    target = cpu_target(mcpu) if mcpu else cpu_target()
    types = [TensorType((1, 256), "float32"), TensorType((256, 256), "float16", Packing("awq_int4_pairs", 64))]
    lib = tvm.compile(schedule(make_kernel("linear", types, {}).func, "linear", {}, target), target.tvm_target())
    asm = lib.mod.inspect_source("s")
    vnni = "avx512vnni" in target.features and target.lanes == 16
    assert (asm.count("vpdpwssd"), asm.count("vpmaddwd") > 0) == ((16, False) if vnni else (0, True))


def test_pairs_layout_holds_each_value_where_pair_position_says():
    """The CPU layout of a packed weight, read back by the documented column order and `pair_position`."""
    rng = np.random.default_rng(3)
    for rows, out in [(6, 40), (5, 128), (4, 64)]:  # 2-word tiles; an odd row count (padded); one 16-word tile
        words = rng.integers(-2 ** 31, 2 ** 31, (rows, out // 8), dtype=np.int64).astype(np.int32)
        values, tile = unpack(words, out), pair_tile_words(out)
        paired = pair_words(words, out).view(np.uint32)
        assert paired.shape == (out // (4 * tile), (rows + 1) // 2, tile)
        for row in range(rows):
            for column in range(out):
                t, pair, word, shift = pair_position(column, row, tile)
                assert (int(paired[t, pair, word]) >> shift) & 15 == values[row, column]
                assert pair_column(t, shift % 16 // 4, word, tile) == column
        if rows % 2:
            assert not (paired[:, -1] >> 16).any()  # the padding row: zeros
        scales = rng.standard_normal((2, out)).astype(np.float16)
        laid = pair_scales(scales)
        assert all(laid[pair_scale(pair_index(c, tile), g, tile)] == scales[g, c] for g in range(2) for c in range(out))


CASES = {
    "qwen2-tied-bias-g32": dict(arch="qwen2", tie_word_embeddings=True, awq_group_size=32),
    "qwen2-untied-g64-keep-down": dict(arch="qwen2", tie_word_embeddings=False, awq_group_size=64, seed=1,
                                       modules_to_not_convert=("mlp.down_proj",)),
    "qwen2-one-group": dict(arch="qwen2", awq_group_size=-1, seed=2),
    "llama-g128-no-bias": dict(arch="llama", hidden_size=128, intermediate_size=256, awq_group_size=128, seed=3),
}


@pytest.fixture(scope="module", params=list(CASES))
def awq_case(request, tiny_factory, tmp_path_factory):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model_dir, artifact = tiny_factory(dtype="float16", **CASES[request.param])
    plain = dequantised_checkpoint(model_dir, tmp_path_factory.mktemp("dequantised") / "model")
    hf = transformers.AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    return CompiledModel(model_dir, artifact), hf, model_dir, artifact


def test_prefill_and_decode_logits_match_transformers_on_the_dequantised_weights(awq_case):
    from test_models_vs_transformers import assert_steps_match  # needs torch, as the fixture does
    ours, hf, _, _ = awq_case
    assert_steps_match(ours, hf, [int(t) for t in np.random.default_rng(5).integers(0, ours.config.vocab_size, 24)], 8)


def test_greedy_tokens_identical_to_transformers(awq_case):
    from test_models_vs_transformers import DECODE_STEPS, assert_greedy_matches
    ours, hf, _, _ = awq_case
    assert_greedy_matches(ours, hf, [int(t) for t in np.random.default_rng(7).integers(0, ours.config.vocab_size, 11)],
                          DECODE_STEPS)


def test_weights_stay_packed_in_memory_and_the_manifest_records_the_quantisation(awq_case):
    ours, _, model_dir, _ = awq_case
    manifest = ours.manifest
    config = json.loads((model_dir / "config.json").read_text())["quantization_config"]
    assert manifest.quantization.method == "awq" and manifest.quantization.bits == 4
    assert manifest.quantization.group_size == config["group_size"]
    packed = [p for p in manifest.params if p.packing]
    assert manifest.quantization.packed_params == len(packed) > 0
    held = [tuple(a.shape) + (str(a.dtype),) for a in ours._params]
    for p in packed:  # the runtime holds the packed words, zeros and scales, never an [out, in] float matrix
        out, inp = p.shape
        group = inp if config["group_size"] == -1 else config["group_size"]
        tile = next(t for t in (16, 8, 4, 2) if out % (4 * t) == 0)
        assert p.packing == f"awq_int4_pairs(g{group})" and p.transform == "awq_pairs"  # the CPU layout
        assert (out // 4 // tile, inp // 2, tile, "int32") in held
        assert (out // 4 // tile, inp // group, 4 * tile, "float16") in held
    floats = {shape[:2] for shape in held if shape[-1] != "int32"}
    assert not any((p.shape[0], p.shape[1]) in floats for p in packed if p.shape[0] != p.shape[1])


def test_loaders_take_their_own_kind_of_checkpoint(awq_case, tiny_factory):
    ours, _, model_dir, artifact = awq_case
    arch = ours.config.model_type
    if arch == "qwen2":
        pipe = load_huggingface_awq_qwen2_pipeline(model_dir, artifact)
        assert pipe.generate_text("Hello", GreedyGenerationConfig(4)).text is not None
        with pytest.raises(models.ModelConfigError, match="holds AWQ INT4 weights.*use load_huggingface_awq_qwen2_pipeline"):
            load_huggingface_qwen2_pipeline(model_dir, artifact)
    else:
        with pytest.raises(models.ModelConfigError, match="holds AWQ INT4 weights.*use load_pipeline"):
            load_huggingface_llama_pipeline(model_dir, artifact)
        with pytest.raises(models.ModelConfigError, match="model_type is 'llama', not qwen2; use load_pipeline"):
            load_huggingface_awq_qwen2_pipeline(model_dir, artifact)
    assert load_pipeline(model_dir, artifact).model.manifest.quantization is not None
    float_dir, float_artifact = tiny_factory(arch="qwen2")
    with pytest.raises(models.ModelConfigError, match="holds float weights.*use load_huggingface_qwen2_pipeline"):
        load_huggingface_awq_qwen2_pipeline(float_dir, float_artifact)


def test_packed_tensor_of_the_wrong_dtype_is_a_clear_error(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "m", dtype="float16", awq_group_size=32)
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.qweight"] = tensors["model.layers.1.mlp.up_proj.qweight"].view(np.float32)
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj.qweight' has dtype F32; supported: I32"):
        models.load_checkpoint(model_dir)


def test_checkpoint_without_packed_tensors_is_a_clear_error(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "m", dtype="float16")
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm",
                                     "zero_point": True}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'model.layers.0.self_attn.q_proj.qweight' is missing"):
        models.load_checkpoint(model_dir)


@pytest.mark.parametrize("path,flags", [("amx", {"amx_tile", "amx_bf16"}), ("avx512bf16", {"avx512f", "avx512_bf16"})])
def test_bf16_prefill_of_an_awq_model_tracks_transformers(tmp_path, monkeypatch, path, flags):
    """--matmul-precision bfloat16 on an AWQ checkpoint: prefill products on AMX tiles (schedules.amx amx_awq_gemm)
    or on AVX512-BF16 dot products (schedules.avx512_bf16 dpbf16_awq_gemm: an AMX Xeon builds for Zen 4 to run
    them), off the float32 model by the activations' bfloat16 rounding and no more; decode on the integer pairs
    with AMX, on dot products too with AVX512-BF16 (schedules.cpu_awq with bf16_ir)."""
    if not flags <= host_cpu_flags():
        pytest.skip(f"this CPU has no {' or '.join(sorted(flags))}")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model_dir = write_tiny_checkpoint(tmp_path / "model", arch="qwen2", dtype="float16", awq_group_size=32, seed=4)
    mcpu = None if cpu_target(None, "bfloat16").bf16_products == path else "znver4"
    written = []  # the AWQ products the build wrote for the path (the 128-wide gate and up projections)
    gemm = cpu.BF16_AWQ_GEMMS[path]
    monkeypatch.setitem(cpu.BF16_AWQ_GEMMS, path, lambda func: written.append(gemm(func)) or written[-1])
    decode_dots = []  # whether each few-row AWQ product was written on bfloat16 dot products
    rows_kernel = cpu.awq_linear
    monkeypatch.setattr(cpu, "awq_linear", lambda func, lanes, vnni, bf16_ir: decode_dots.append(
        bf16_ir is not None) or rows_kernel(func, lanes, vnni, bf16_ir))
    artifact = build(model_dir, out=tmp_path / path, prefill_buckets=(32,), max_context=64, mcpu=mcpu,
                     matmul_precision="bfloat16", quiet=True).path
    ours = CompiledModel(model_dir, artifact)
    assert ours.manifest.target.bf16_products == path and any(w is not None for w in written)
    assert decode_dots and all(decode_dots) == (path == "avx512bf16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(dequantised_checkpoint(model_dir, tmp_path / "plain"),
                                                           dtype=torch.float32).eval()
    from bf16_cases import assert_bf16_prefill_tracks
    prompt = [int(t) for t in np.random.default_rng(9).integers(0, ours.config.vocab_size, 32)]
    assert_bf16_prefill_tracks(ours, hf, prompt)
