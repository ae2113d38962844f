"""models.tiny: tiny random Llama / Qwen2 checkpoints in the exact Hugging Face format."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from models.tiny import main, write_tiny_checkpoint

ARCHS = ("qwen2", "llama")
ASCII_TEXTS = (
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  two leading spaces, a\ttab,\n\nand blank lines  ",
    "x = [i ** 2 for i in range(10)]  # 0123456789 $19.99 (7.5%)",
    "It's fine; we'll see... \"quoted\" & <angled> {braces} ~tilde~ `tick`",
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2 + 2?"},
]


def _files(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _weights(directory):
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors |= load_file(str(path))
    return tensors


def _config(directory):
    return json.loads((directory / "config.json").read_text())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One default checkpoint per arch (shared by the read-only tests)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny_checkpoint(root / arch, arch=arch) for arch in ARCHS}


@pytest.mark.parametrize("arch", ARCHS)
def test_same_seed_gives_identical_bytes(tmp_path, arch):
    a = write_tiny_checkpoint(tmp_path / "a", arch=arch, seed=3, shards=2, dtype="bfloat16")
    b = write_tiny_checkpoint(tmp_path / "b", arch=arch, seed=3, shards=2, dtype="bfloat16")
    assert _files(a) == _files(b)


@pytest.mark.parametrize("arch", ARCHS)
def test_other_seed_changes_every_weight_but_not_the_rest(tmp_path, arch):
    a = write_tiny_checkpoint(tmp_path / "a", arch=arch, seed=0)
    b = write_tiny_checkpoint(tmp_path / "b", arch=arch, seed=1)
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    assert all(not np.array_equal(wa[name], wb[name]) for name in wa)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_weights_are_stored_in_the_requested_dtype(tmp_path, dtype):
    out = write_tiny_checkpoint(tmp_path / "m", dtype=dtype)
    assert _config(out)["torch_dtype"] == dtype
    header_len = int.from_bytes((out / "model.safetensors").read_bytes()[:8], "little")
    header = json.loads((out / "model.safetensors").read_bytes()[8:8 + header_len])
    assert header.pop("__metadata__") == {"format": "pt"}
    assert {t["dtype"] for t in header.values()} == {{"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[dtype]}


@pytest.mark.parametrize("arch", ARCHS)
def test_sharded_index_lists_every_tensor_once(tmp_path, arch):
    out = write_tiny_checkpoint(tmp_path / "m", arch=arch, shards=3)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    stored = {name: file for file in files for name in load_file(str(out / file))}
    assert index["weight_map"] == stored
    weights = _weights(out)
    assert index["metadata"]["total_size"] == sum(w.nbytes for w in weights.values())
    assert index["metadata"]["total_parameters"] == sum(w.size for w in weights.values())


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("vocab_size", [300, 320, 517])
def test_vocab_is_exactly_vocab_size_with_specials_last(tmp_path, arch, vocab_size):
    out = write_tiny_checkpoint(tmp_path / "m", arch=arch, vocab_size=vocab_size)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size == _config(out)["vocab_size"]
    assert _weights(out)["model.embed_tokens.weight"].shape[0] == vocab_size
    added = json.loads((out / "tokenizer_config.json").read_text())["added_tokens_decoder"]
    assert sorted(map(int, added)) == list(range(vocab_size - len(added), vocab_size))
    assert all(token["special"] for token in added.values())


@pytest.mark.parametrize("vocab_size", [100, 5000])
def test_unsupported_vocab_size_is_refused(tmp_path, vocab_size):
    with pytest.raises(ValueError, match="vocab_size"):
        write_tiny_checkpoint(tmp_path / "m", vocab_size=vocab_size)
    assert list(tmp_path.iterdir()) == []


def _special_ids(directory):
    config, tokenizer = _config(directory), Tokenizer.from_file(str(directory / "tokenizer.json"))
    ids = {token.content: i for i, token in tokenizer.get_added_tokens_decoder().items()}
    return config, ids, json.loads((directory / "generation_config.json").read_text())


def test_special_token_ids_agree_across_files(checkpoints):
    config, ids, generation = _special_ids(checkpoints["qwen2"])
    endoftext, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    assert (config["bos_token_id"], config["eos_token_id"]) == (endoftext, im_end)
    assert generation == {"bos_token_id": endoftext, "eos_token_id": [im_end, endoftext], "pad_token_id": endoftext}
    config, ids, generation = _special_ids(checkpoints["llama"])
    bos, eos = ids["<|begin_of_text|>"], [ids["<|end_of_text|>"], ids["<|eot_id|>"]]
    assert (config["bos_token_id"], config["eos_token_id"]) == (bos, eos)
    assert generation == {"bos_token_id": bos, "eos_token_id": eos}


def test_config_fields_follow_the_arch(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
    qwen = _config(write_tiny_checkpoint(tmp_path / "q"))
    llama = _config(write_tiny_checkpoint(tmp_path / "l", arch="llama", head_dim=32, rope_scaling=scaling))
    assert (qwen["architectures"], qwen["tie_word_embeddings"]) == (["Qwen2ForCausalLM"], True)
    assert (llama["architectures"], llama["tie_word_embeddings"]) == (["LlamaForCausalLM"], False)
    assert "attention_bias" not in qwen and llama["attention_bias"] is False
    assert "head_dim" not in qwen and llama["head_dim"] == 32
    assert "rope_scaling" not in qwen and llama["rope_scaling"] == scaling


def test_refuses_a_non_empty_directory_unless_overwriting(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty"):
        write_tiny_checkpoint(out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    write_tiny_checkpoint(out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_failed_write_leaves_nothing_behind(tmp_path):
    with pytest.raises(ValueError, match="shards"):
        write_tiny_checkpoint(tmp_path / "m", shards=1000)
    assert list(tmp_path.iterdir()) == []


def test_fills_an_existing_empty_directory(tmp_path):
    (tmp_path / "m").mkdir()
    assert (write_tiny_checkpoint(tmp_path / "m") / "model.safetensors").is_file()


def test_cli_writes_and_prints_the_path(tmp_path, capsys):
    out = tmp_path / "cli"
    main([str(out), "--arch", "llama", "--seed", "2", "--dtype", "float16", "--shards", "2"])
    assert capsys.readouterr().out.strip() == str(out.resolve())
    assert _config(out)["model_type"] == "llama"
    assert (out / "model-00002-of-00002.safetensors").is_file()
    with pytest.raises(SystemExit):
        main([str(out)])
    assert "not empty" in capsys.readouterr().err
    main([str(out), "--overwrite"])
    assert _config(out)["model_type"] == "qwen2"


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trips_in_transformers(checkpoints, arch):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints[arch])
    raw = Tokenizer.from_file(str(checkpoints[arch] / "tokenizer.json"))
    assert len(tokenizer) == 320
    for text in ASCII_TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == raw.encode(text).ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
        assert (ids[0] == tokenizer.convert_tokens_to_ids("<|begin_of_text|>")) == (arch == "llama")


def test_qwen2_chat_template_renders_chatml(checkpoints):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints["qwen2"])
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    default_system = tokenizer.apply_chat_template(MESSAGES[1:2], tokenize=False)
    assert default_system.startswith("<|im_start|>system\nYou are Qwen")
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and ids.count(tokenizer.eos_token_id) == 4


def test_llama_chat_template_renders_llama3_headers(checkpoints):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoints["llama"])
    text = tokenizer.apply_chat_template(MESSAGES[:2], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


@pytest.mark.parametrize(
    "arch, tie", [("qwen2", None), ("qwen2", False), ("llama", None), ("llama", True)]
)
def test_tensor_names_and_shapes_match_the_hf_model(tmp_path, arch, tie):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    out = write_tiny_checkpoint(tmp_path / "m", arch=arch, tie_word_embeddings=tie, head_dim=24)
    config = transformers.AutoConfig.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_config(config)
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        del expected["lm_head.weight"]
    assert {k: v.shape for k, v in _weights(out).items()} == expected


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shards, dtype", [(1, "float32"), (3, "bfloat16"), (2, "float16")])
def test_loads_in_transformers_with_every_weight(tmp_path, arch, shards, dtype):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    out = write_tiny_checkpoint(tmp_path / "m", arch=arch, shards=shards, dtype=dtype)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert all(not problems for problems in info.values()), info
    state = model.state_dict()
    for name, array in _weights(out).items():
        assert torch.equal(state[name], torch.from_numpy(array.astype(np.float32))), name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_decoding_has_clear_top1_margins(tmp_path, arch, seed):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    out = write_tiny_checkpoint(tmp_path / "m", arch=arch, seed=seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = transformers.AutoTokenizer.from_pretrained(out)("The quick brown fox", return_tensors="pt")
    with torch.no_grad():
        result = model.generate(**prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                output_logits=True, return_dict_in_generate=True)
    top2 = torch.stack([torch.topk(scores[0], 2).values for scores in result.logits])
    margins = top2[:, 0] - top2[:, 1]
    assert margins.median() > 0.5 and (margins > 0.05).float().mean() >= 0.9, margins
