"""GGUF model files: Llama and Qwen2 in every supported tensor type run as transformers runs the same values, their
tokenizers encode as the checkpoints' own, and each way a file can be wrong gets an error naming it."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess

import gguf
import numpy as np
import pytest
from gguf_fixture import PACKED, permute_for_llama_cpp, random_blocks, write_gguf
from numpy_reference import packed_dequantise

import models
from ir import Packing
from compiler.build import build
from models.checkpoint import CheckpointError, read_tensor, scan_checkpoint
from models.config import ModelConfigError
from models.ggml_types import BLOCK_TYPES, INT_TYPES, dequantise, int4_part, rope_rows_in_order
from models.gguf import VOCABULARY_MATRICES, GgufFile
from models.tiny import write_tiny_checkpoint
from runtime import CompiledModel, GreedyGenerationConfig, load_pipeline
from runtime.gguf_tokenizer import gguf_tokenizer
from runtime.tokenizer import Tokenizer, TokenizerError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from test_models_vs_transformers import assert_greedy_matches, assert_steps_match  # noqa: E402

CASES = {
    "qwen2-q8_0-tied": (dict(arch="qwen2", tie_word_embeddings=True, seed=5), "Q8_0", False),
    "llama-gqa-q4_0": (dict(arch="llama", seed=6), "Q4_0", False),
    "llama-mqa-headdim-llama3rope-q4_1": (dict(
        arch="llama", num_attention_heads=4, num_key_value_heads=1, head_dim=24, seed=7, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}), "Q4_1", True),
    "qwen2-untied-bf16": (dict(arch="qwen2", tie_word_embeddings=False, seed=8), "BF16", False),
    "llama-f16": (dict(arch="llama", seed=9), "F16", False),
    "qwen2-q5_0": (dict(arch="qwen2", seed=10), "Q5_0", False),
    # the K-quants' blocks of 256 need rows of 256 and more
    "llama-q4_k": (dict(arch="llama", hidden_size=256, intermediate_size=512, seed=11), "Q4_K", False),
    "qwen2-q6_k": (dict(arch="qwen2", hidden_size=256, intermediate_size=512, seed=12), "Q6_K", False),
    "llama-q3_k": (dict(arch="llama", hidden_size=256, intermediate_size=512, seed=16), "Q3_K", False),
    "qwen2-q2_k": (dict(arch="qwen2", hidden_size=256, intermediate_size=512, seed=17), "Q2_K", False),
    "llama-iq4_nl": (dict(arch="llama", seed=18), "IQ4_NL", False),
    "qwen2-iq4_xs": (dict(arch="qwen2", hidden_size=256, intermediate_size=512, seed=19), "IQ4_XS", False),
}
TEXTS = ["Hello world, 12345 don't stop", "  two  spaces\n\nand\ttabs!", "héllo 北京 ünïcode",
         "<|im_start|>user x", "<|begin_of_text|>a", ""]


def llama3_rope_freqs(config: dict) -> np.ndarray:
    """The frequency divisors llama.cpp's converter stores for a Llama 3 rope_scaling (transformers' frequencies)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    hf = LlamaConfig(**config)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    dim = config["head_dim"]
    base = 1.0 / config["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    return (base / scaled.double().numpy()).astype(np.float32)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(our model on the GGUF, transformers on a float32 checkpoint of the values the GGUF stores, qtype, dirs)."""
    options, qtype, rope_freqs = CASES[request.param]
    root = tmp_path_factory.mktemp("gguf")
    model_dir = write_tiny_checkpoint(root / "hf", **options)
    config = json.loads((model_dir / "config.json").read_text())
    path = write_gguf(model_dir, root / "gguf", qtype, reference=root / "reference",
                      rope_freqs=llama3_rope_freqs(config) if rope_freqs else None)
    artifact = build(path.parent, out=root / "artifact", prefill_buckets=(8, 16), max_context=128, quiet=True).path
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "reference", dtype=torch.float32).eval()
    return CompiledModel(path.parent, artifact), hf, qtype, model_dir


@pytest.mark.parametrize("prompt_len", (1, 24))
def test_gguf_model_prefill_and_decode_match_transformers_on_the_stored_values(case, prompt_len):
    ours, hf, _, _ = case
    prompt = [int(t) for t in np.random.default_rng(prompt_len).integers(0, ours.config.vocab_size, prompt_len)]
    assert_steps_match(ours, hf, prompt, 12)


def test_gguf_model_greedy_generation_matches_transformers(case):
    ours, hf, _, _ = case
    assert_greedy_matches(ours, hf, [3, 14, 15, 92, 65], 16)


def test_gguf_weights_are_decoded_or_packed_and_reordered_at_load(case):
    """Block types are dequantised (the entries say so), 4-bit projections become INT4 parts instead, Llama's q and
    k rows come back in Hugging Face's order: each equals the reference checkpoint's tensor bit for bit (Q4_K's to
    float32's rounding: gguf-py multiplies its scales in another order than llama.cpp, whose we keep)."""
    ours, _, qtype, _ = case
    entries = scan_checkpoint(ours.model_dir)
    reference = {e.name: e for e in scan_checkpoint(ours.model_dir.parent / "reference").values()}
    module = "model.layers.0.self_attn.q_proj"
    q = entries[f"{module}.qweight" if qtype in PACKED else f"{module}.weight"]
    assert (q.encoding, q.part) == ((qtype, "qweight") if qtype in PACKED else ("", ""))
    assert q.rope_rows == (ours.config.head_dim if ours.config.model_type == "llama" else 0)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.norm.weight", "model.embed_tokens.weight"):
        with open(reference[name].file, "rb") as f:
            want = read_tensor(reference[name], f.read())
        tolerance = np.abs(want).max() * 2.0 ** -23 if qtype == "Q4_K" else 0
        np.testing.assert_allclose(_stored_values(entries, name), want, rtol=0, atol=tolerance)


def _stored_values(entries, name: str) -> np.ndarray:
    """The float32 values of weight `name`: its entry's, or those its INT4 parts hold (their planes summed)."""
    module = name.removesuffix(".weight")
    if name in entries:
        with open(entries[name].file, "rb") as f:
            return np.asarray(read_tensor(entries[name], f.read()), np.float32)
    qweight = entries[f"{module}.qweight"]
    kind, group, planes, block, _ = INT_TYPES[qweight.encoding]
    affine = kind.startswith("affine")
    parts = [entries[f"{module}.{part}"] for part in ("qweight", "offsets" if affine else "qzeros", "scales")]
    with open(qweight.file, "rb") as f:
        data = f.read()
    arrays = [read_tensor(entry, data) for entry in parts]
    return packed_dequantise(*arrays, planes, affine)


def test_integer_weights_run_packed_in_the_int4_kernels(case):
    """A file with projections of an integer block type is an INT4 model: its projections, embedding and head are
    packed params (AWQ's zero points, or float offsets; two planes for 5-, 6- and 8-bit values; a K-quant's scales
    as their two levels; the embedding's rows unpacked as they are looked up), everything else the file's values;
    other types hold every weight as values."""
    ours, _, qtype, _ = case
    packings = {p.name: p.packing for p in ours.manifest.params}
    words = sum(str(a.dtype) == "int32" for a in ours._params)  # what the runtime holds: packed words, zeros and
    # two-level scales and offsets
    if qtype not in PACKED:
        assert ours.manifest.quantization is None and not any(packings.values()) and words == 0
        return
    packed = [name for name in packings if name.endswith("_proj.weight") or name in VOCABULARY_MATRICES]
    assert {"model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"} < set(packed)
    assert ours.config.tie_word_embeddings or "lm_head.weight" in packed
    kind, group, planes, block, _ = INT_TYPES[qtype]
    assert all(packings[name] == str(Packing(f"{kind}_pairs", group, planes, block)) for name in packed)
    assert ours.manifest.quantization.packed_params == len(packed)
    two_level = 2 if kind.startswith("affine") else 1  # a K-quant's scales (and offsets) as int32 words
    assert words == ((1 if kind.startswith("affine") else 2) + (two_level if block else 0)) * len(packed)


def test_gguf_tokenizer_and_chat_template_are_the_checkpoints(case):
    ours, _, _, model_dir = case
    theirs = transformers.AutoTokenizer.from_pretrained(model_dir)
    tok = Tokenizer(ours.model_dir)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == theirs.encode(text), text
        assert tok.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    pipeline = load_pipeline(ours.model_dir, ours.artifact)
    assert pipeline.render_chat(messages) == theirs.apply_chat_template(messages, tokenize=False,
                                                                       add_generation_prompt=True)
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    assert pipeline.default_eos_token_ids == [eos[0] if isinstance(eos, list) else eos]


def test_a_file_of_mixed_types_packs_each_projection_its_way(tmp_path):
    """In a Q4_0 file with projections of other types (llama.cpp's mixes), the quantization_config's packed_modules
    name each one packed otherwise than Q4_0 (Q4_1's float offsets, Q8_0's two planes), its modules_to_not_convert
    those it cannot pack (F16); the model still runs as transformers runs the stored values."""
    model_dir = write_tiny_checkpoint(tmp_path / "hf", arch="qwen2", seed=13)
    path = write_gguf(model_dir, tmp_path / "gguf", "Q4_0", reference=tmp_path / "reference",
                      types={"mlp.down_proj.weight": "Q8_0", "layers.1.self_attn.o_proj.weight": "F16",
                             "mlp.gate_proj.weight": "Q4_1"})
    config = models.load_config(path.parent)
    layers = range(config.num_hidden_layers)
    assert config.quantization.modules_to_not_convert == ("model.layers.1.self_attn.o_proj",)
    assert dict(config.quantization.packed_modules) == {  # and the tied Q4_0 embedding, named: not a projection
        "model.embed_tokens": Packing("awq_int4", 32)} | {
        f"model.layers.{i}.mlp.{name}": packing for i in layers
        for name, packing in (("gate_proj", Packing("affine_int4", 32)), ("down_proj", Packing("awq_int4", 32, 2)))}
    artifact = build(path.parent, out=tmp_path / "artifact", prefill_buckets=(8,), max_context=64, quiet=True).path
    ours = CompiledModel(path.parent, artifact)
    packings = {p.name: p.packing for p in ours.manifest.params}
    assert not packings["model.layers.1.self_attn.o_proj.weight"]
    assert packings["model.layers.0.self_attn.o_proj.weight"] == packings["model.layers.1.mlp.up_proj.weight"] \
        == "awq_int4_pairs(g32)"
    assert packings["model.layers.1.mlp.gate_proj.weight"] == "affine_int4_pairs(g32)"
    assert packings["model.layers.0.mlp.down_proj.weight"] == "awq_int4_pairs(g32,x2)"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "reference", dtype=torch.float32).eval()
    assert_steps_match(ours, hf, [5, 17, 2, 9, 40], 6)


def test_a_vocabulary_no_packing_takes_stays_float16_beside_packed_projections(tmp_path):
    """A Q4_0 file whose 322-row embedding and head do not split into 8-column words (ir.packing): they are held
    decoded to float16, the projections packed, and the model runs as transformers runs the stored values."""
    model_dir = write_tiny_checkpoint(tmp_path / "hf", arch="llama", tie_word_embeddings=False, vocab_size=322,
                                      seed=14)
    path = write_gguf(model_dir, tmp_path / "gguf", "Q4_0", reference=tmp_path / "reference")
    artifact = build(path.parent, out=tmp_path / "artifact", prefill_buckets=(8,), max_context=64, quiet=True).path
    ours = CompiledModel(path.parent, artifact)
    packings = {p.name: p.packing for p in ours.manifest.params}
    assert not packings["model.embed_tokens.weight"] and not packings["lm_head.weight"]
    assert packings["model.layers.0.mlp.down_proj.weight"] == "awq_int4_pairs(g32)"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "reference", dtype=torch.float32).eval()
    assert_steps_match(ours, hf, [5, 17, 2, 9, 321], 4)


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("ptxas") is None, reason="no CUDA toolkit installed")
def test_a_4_bit_gguf_model_builds_for_cuda(tmp_path):
    """Q4_0's zero points, Q4_1's offsets, Q8_0's planes and the K-quants' two-level scales (Q4_K's with offsets,
    Q6_K's with planes, Q3_K's and Q2_K's in groups of 16) as the GPU kernels read them (column tiles): the model
    builds for CUDA and ptxas accepts every kernel."""
    model_dir = write_tiny_checkpoint(tmp_path / "hf", arch="qwen2", hidden_size=256, intermediate_size=512, seed=14)
    path = write_gguf(model_dir, tmp_path / "gguf", "Q4_0", types={
        "mlp.up_proj.weight": "Q4_1", "mlp.down_proj.weight": "Q8_0", "mlp.gate_proj.weight": "Q4_K",
        "self_attn.v_proj.weight": "Q6_K", "self_attn.q_proj.weight": "Q3_K", "self_attn.o_proj.weight": "Q2_K"})
    out = build(path.parent, target="cuda", out=tmp_path / "artifact", prefill_buckets=(16,), max_context=64,
                quiet=True).path
    packings = {p["packing"] for p in json.loads((out / "manifest.json").read_text())["params"]}
    assert {"awq_int4(g32)", "affine_int4(g32)", "awq_int4(g32,x2)", "affine_int4(g32,b256)",
            "awq_int4(g16,x2,b256)", "awq_int4(g16,b256)", "affine_int4(g16,b256)"} <= packings
    assembled = subprocess.run(["ptxas", "-arch=sm_90", str(out / "kernels.ptx"), "-o", "/dev/null"],
                               capture_output=True, text=True)
    assert assembled.returncode == 0, assembled.stderr


def test_a_4_bit_gguf_model_runs_from_a_deploy_bundle(tmp_path):
    """`compiler bundle` of a GGUF model carries the file; under another Python without TVM (or gguf-py) the bundle
    reads it, repacks its 4-bit projections and gives the tokens of the full install."""
    from test_bundle import PYTHON, PROMPT, TARGET_PYTHON, make_bundle, run_bundle
    if PYTHON is None:
        pytest.skip(f"no Python {TARGET_PYTHON} interpreter on this machine")
    model_dir = write_tiny_checkpoint(tmp_path / "hf", arch="llama", seed=15)
    path = write_gguf(model_dir, tmp_path / "gguf", "Q4_0", types={"mlp.up_proj.weight": "Q4_1"})
    artifact = build(path.parent, out=tmp_path / "artifact", prefill_buckets=(16,), max_context=64, quiet=True).path
    make_bundle(artifact, tmp_path / "bundle")
    assert (tmp_path / "bundle" / "model" / "model.gguf").is_file()
    result = run_bundle(tmp_path / "bundle", "generate", PROMPT, "10")
    assert result.returncode == 0, result.stderr
    run = json.loads(result.stdout.splitlines()[-1])
    want = load_pipeline(path.parent, artifact).generate_text(PROMPT, GreedyGenerationConfig(10), add_special_tokens=True,
                                                              skip_special_tokens=True)
    assert run["generated_token_ids"] == want.generated_token_ids


@pytest.mark.parametrize("qtype", sorted(name for name, _, _ in BLOCK_TYPES.values()))
def test_block_dequantisation_matches_gguf_py(qtype):
    """Random blocks (random quants and scale bits, scales kept finite) decode bit for bit as llama.cpp's gguf-py
    decodes them."""
    kind = gguf.GGMLQuantizationType[qtype]
    blocks = random_blocks(6, 4 * gguf.GGML_QUANT_SIZES[kind][0], qtype, np.random.default_rng(0))
    got = dequantise(qtype, blocks.reshape(-1), (6, 4 * gguf.GGML_QUANT_SIZES[kind][0]))
    assert np.isfinite(got).all() and np.abs(got).max() > 0
    np.testing.assert_array_equal(got, gguf.quants.dequantize(blocks, kind).astype(np.float32))


@pytest.mark.parametrize("qtype", sorted(INT_TYPES))
def test_integer_blocks_pack_into_int4_parts_that_hold_their_values(qtype):
    """Each integer type's INT4 parts (planes summed) hold what llama.cpp decodes, which the test above holds to
    gguf-py: exactly, the K-quants with offsets to float32's rounding (another order of the same products)."""
    kind, group, planes, block, _ = INT_TYPES[qtype]
    out, inp = 16, 512
    blocks = random_blocks(out, inp, qtype, np.random.default_rng(1)).reshape(-1)
    packing = Packing(kind, group, planes, block)
    parts = [int4_part(qtype, blocks, shape, name) for name, (shape, _) in zip(
        packing.part_names, packing.checkpoint_parts((out, inp), "float32"))]
    got = packed_dequantise(*parts, planes, packing.affine)
    want = dequantise(qtype, blocks, (out, inp))
    np.testing.assert_allclose(got, want, rtol=0, atol=np.abs(want).max() * 2.0 ** -23 if packing.affine else 0)


def test_every_end_of_generation_token_stops_generation(tmp_path):
    """llama.cpp stops on the end-of-turn token (Llama 3 and Qwen2 instruct models mark it) as on EOS."""
    model_dir = write_tiny_checkpoint(tmp_path / "hf", arch="qwen2")
    eos = json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"]
    eos = eos[0] if isinstance(eos, list) else eos
    path = write_gguf(model_dir, tmp_path / "gguf", "F16", metadata={"tokenizer.ggml.eot_token_id": eos - 1})
    assert models.load_config(path.parent).eos_token_ids == (eos, eos - 1)


def test_llama_rope_rows_undo_the_converters_permutation():
    w = np.arange(48 * 3, dtype=np.float32).reshape(48, 3)
    np.testing.assert_array_equal(rope_rows_in_order(permute_for_llama_cpp(w, 4), 12), w)


def test_sentencepiece_gguf_tokenizer_encodes_as_sentencepiece(tmp_path):
    """A SentencePiece BPE vocabulary (Llama 2, TinyLlama) as llama.cpp stores it: pieces, scores and types, no
    merges; ours encodes and decodes as sentencepiece itself, BOS first, unknown characters as bytes (trained as
    Llama 2's was: no normalisation, spaces kept)."""
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["The quick brown fox jumps over the lazy dog.", "Hello, world! Hello again.",
                                 "Numbers like 12345 and 678 are here.", "a b c d e f g h i j k l m n o p"] * 20))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=400,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   normalization_rule_name="identity", remove_extra_whitespaces=False,
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    types = [3 if sp.is_control(i) else 2 if sp.is_unknown(i) else 6 if sp.is_byte(i) else 1
             for i in range(len(pieces))]
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": [sp.get_score(i) for i in range(len(pieces))], "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    tok = gguf_tokenizer(GgufFile(tmp_path / "x.gguf", meta, {}))
    for text in ["The quick brown fox", "Hello, world!  Two spaces", "unseen: zebra QX 北", "12345678", " lead"]:
        want = sp.encode(text)
        assert tok.encode(text).ids == [1] + want, text
        assert tok.decode(want) == sp.decode(want)


# ---- errors: each names the file and what to do ----

@pytest.fixture
def gguf_dir(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "hf", arch="qwen2")
    return model_dir, write_gguf(model_dir, tmp_path / "gguf", "Q8_0")


def _build(path, tmp_path):
    return build(path.parent, out=tmp_path / "artifact", prefill_buckets=(8,), max_context=32, quiet=True)


def test_a_file_that_is_not_gguf(gguf_dir, tmp_path):
    _, path = gguf_dir
    path.write_bytes(b"PK\x03\x04" + path.read_bytes()[4:])
    with pytest.raises(CheckpointError, match=r"not a GGUF file .*pass a llama.cpp GGUF model file"):
        _build(path, tmp_path)
    assert not (tmp_path / "artifact").exists()


def test_an_unsupported_gguf_version(gguf_dir, tmp_path):
    _, path = gguf_dir
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 1)
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="GGUF version 1; supported: 2, 3"):
        _build(path, tmp_path)


def test_a_file_truncated_in_its_header_or_its_data(gguf_dir, tmp_path):
    _, path = gguf_dir
    data = path.read_bytes()
    path.write_bytes(data[:200])
    with pytest.raises(CheckpointError, match="ends inside its header .*download it again"):
        _build(path, tmp_path)
    path.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="lies beyond the end of the file; the file is truncated"):
        _build(path, tmp_path)


def test_an_unsupported_tensor_type_is_named(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "hf", arch="qwen2", hidden_size=256, intermediate_size=512)
    path = write_gguf(model_dir, tmp_path / "gguf", "IQ2_XXS")
    with pytest.raises(CheckpointError, match=r"'token_embd.weight' is stored as IQ2_XXS; supported: F32, F16, BF16, "
                                              r"Q4_0, .*, IQ4_XS; convert or quantise"):
        _build(path, tmp_path)


def test_an_unsupported_architecture_or_split_file(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "hf", arch="qwen2")
    path = write_gguf(model_dir, tmp_path / "gemma", "F16", metadata={"general.architecture": "gemma"})
    with pytest.raises(ModelConfigError, match="general.architecture is 'gemma'; GGUF files of llama, qwen2"):
        _build(path, tmp_path)
    path = write_gguf(model_dir, tmp_path / "split", "F16", metadata={"split.count": 3})
    with pytest.raises(ModelConfigError, match="one of 3 parts; merge them"):
        _build(path, tmp_path)


def test_metadata_that_does_not_match_the_tensors(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "hf", arch="qwen2")
    config = json.loads((model_dir / "config.json").read_text())
    path = write_gguf(model_dir, tmp_path / "gguf", "F16",
                      metadata={"qwen2.feed_forward_length": config["intermediate_size"] * 2})
    with pytest.raises(CheckpointError, match="has shape .*its GGUF metadata implies .*the weights do not match its "
                                              "GGUF metadata"):
        _build(path, tmp_path)


def test_two_gguf_files_in_one_directory(gguf_dir, tmp_path):
    _, path = gguf_dir
    shutil.copy(path, path.parent / "other.gguf")
    with pytest.raises(CheckpointError, match="holds 2 GGUF files .*move the others out"):
        _build(path, tmp_path)


def test_an_unsupported_tokenizer_model(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "hf", arch="qwen2")
    path = write_gguf(model_dir, tmp_path / "gguf", "F16", metadata={"tokenizer.ggml.model": "bert"})
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model 'bert'; supported: 'gpt2'"):
        Tokenizer(path.parent)
