"""Qwen3.5 text through the user-facing API: its loader, config validation, and the generate CLI."""

from __future__ import annotations

import copy
import json

import pytest
from test_cli import run

from models import ModelConfigError, parse_config
from models.tiny import tiny_config, write_tiny_checkpoint
from runtime import GreedyGenerationConfig, load_huggingface_qwen2_pipeline, load_huggingface_qwen35_text, load_pipeline

TEXT = tiny_config("qwen3_5_text", num_hidden_layers=2)
COMPOSITE = tiny_config("qwen3_5", num_hidden_layers=2)


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_5"])
def test_loader_generates_and_drives_by_hand(tiny_factory, arch):
    model_dir, artifact = tiny_factory(arch=arch, num_hidden_layers=2)
    pipeline = load_huggingface_qwen35_text(model_dir, artifact)
    assert load_pipeline(model_dir, artifact).config.model_type == arch
    result = pipeline.generate_text("Hello world", GreedyGenerationConfig(6, eos_token_ids=[]))
    assert len(result.generated_token_ids) == 6
    cache = pipeline.model.new_cache()
    logits = pipeline.model.forward_cached_last(result.prompt_token_ids, cache)
    for token in result.generated_token_ids[:-1]:
        assert int(logits.argmax()) == token
        logits = pipeline.model.forward_cached_last([token], cache)


def test_loaders_name_the_right_one(tiny_factory):
    qwen35_dir, _ = tiny_factory(arch="qwen3_5_text", num_hidden_layers=2)
    qwen2_dir, _ = tiny_factory(arch="qwen2")
    with pytest.raises(ModelConfigError, match="use load_huggingface_qwen35_text"):
        load_huggingface_qwen2_pipeline(qwen35_dir)
    with pytest.raises(ModelConfigError, match="not qwen3_5 or qwen3_5_text; use load_huggingface_qwen2_pipeline"):
        load_huggingface_qwen35_text(qwen2_dir)


def _composite(**text_changes):
    config = copy.deepcopy(COMPOSITE)
    config["text_config"].update(text_changes)
    return config


@pytest.mark.parametrize("config,match", [
    (TEXT | {"layer_types": ["linear_attention"]}, "'layer_types' must list one of"),
    (TEXT | {"layer_types": ["linear_attention", "sliding_attention"]}, "'layer_types' must list one of"),
    (TEXT | {"attention_bias": True}, "'attention_bias' is true"),
    (TEXT | {"linear_num_value_heads": 3}, "'linear_num_value_heads' \\(3\\) must be a multiple"),
    (TEXT | {"quantization_config": {"quant_method": "awq"}}, "quantised checkpoint"),
    (_composite(quantization_config={"quant_method": "gptq"}), "quantised checkpoint"),
    (COMPOSITE | {"text_config": None}, "'text_config' is missing"),
    (COMPOSITE | {"text_config": [1]}, "'text_config' must be an object"),
    (_composite(model_type="llama"), "expected 'qwen3_5_text'"),
    (_composite(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6}), "'rope_type' is 'yarn'"),
    (_composite(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.01}),
     "'partial_rotary_factor' \\(0.01\\) rotates 0 of 16"),
    (_composite(hidden_act="gelu"), "config.json \\(text_config\\): field 'hidden_act'"),
])
def test_bad_configs_name_the_field(config, match):
    with pytest.raises(ModelConfigError, match=match):
        parse_config(config)


def test_layer_types_default_to_every_fourth_full():
    config = {k: v for k, v in TEXT.items() if k != "layer_types"} | {"num_hidden_layers": 8}
    assert parse_config(config).layer_types == ("linear_attention",) * 3 + ("full_attention",) + (
        "linear_attention",) * 3 + ("full_attention",)


def test_top_level_fields_fill_in_for_the_text_config():
    config = _composite()
    del config["text_config"]["tie_word_embeddings"]
    config["tie_word_embeddings"] = True
    parsed = parse_config(config)
    assert parsed.tie_word_embeddings and parsed.weight_prefix == "model.language_model."


def test_generate_cli_defaults_to_8_new_tokens(tmp_path):
    write_tiny_checkpoint(tmp_path / "models" / "qwen35", arch="qwen3_5", num_hidden_layers=2)
    built = run("compiler", "build", "models/qwen35", "--prefill-buckets", "8", "--max-context", "32", cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    result = run("runtime.generate", "models/qwen35", "Hello", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    runs = [json.loads(line) for line in result.stdout.splitlines() if '"run"' in line]
    assert len(runs) == 1 and len(runs[0]["generated_token_ids"]) == 8
