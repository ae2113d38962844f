"""Qwen3.5 text (Gated DeltaNet + gated attention) against transformers' Qwen3_5ForCausalLM.

Tiny random checkpoints in both config forms (text-only, and the image-text checkpoint's config with
a `text_config` and weights under `model.language_model.`), mixed layer types. Tolerance as for the
other models: every logit within 1e-4 * max(1, max |reference logit|); greedy tokens identical.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from runtime import CompiledModel
from test_models_vs_transformers import assert_greedy_matches

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASES = {
    "text-f32-gqa": dict(arch="qwen3_5_text", num_hidden_layers=3,
                         layer_types=["linear_attention", "full_attention", "linear_attention"]),
    "composite-bf16-tied-2shards": dict(arch="qwen3_5", dtype="bfloat16", tie_word_embeddings=True, shards=2, seed=4,
                                        num_hidden_layers=4, linear_num_key_heads=4, linear_num_value_heads=4,
                                        layer_types=["full_attention", "linear_attention", "linear_attention",
                                                     "full_attention"], partial_rotary_factor=0.5),
}
PROMPT_LENGTHS = (1, 5, 24)  # 24 = 16 + 8: two prefill chunks, the state carried between them
DECODE_STEPS = 16


def reference_model(model_dir):
    """transformers' Qwen3_5ForCausalLM with the checkpoint's weights, in float32."""
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    fields = {k: v for k, v in text.items() if k != "model_type"} | {"tie_word_embeddings": config.get(
        "tie_word_embeddings", text["tie_word_embeddings"])}
    hf = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**fields))
    weights = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        for name, value in load_file(file).items():
            weights[name.replace("model.language_model.", "model.")] = torch.from_numpy(np.asarray(value, np.float32))
    missing, unexpected = hf.float().load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if hf.config.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()


def assert_logits_close(ours: np.ndarray, theirs: np.ndarray) -> None:
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * max(1.0, float(np.abs(theirs).max())))


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_factory):
    model_dir, artifact = tiny_factory(**CASES[request.param])
    return CompiledModel(model_dir, artifact), reference_model(model_dir)


@pytest.mark.parametrize("prompt_len", PROMPT_LENGTHS)
def test_prefill_and_every_decode_step_match(case, prompt_len):
    ours, hf = case
    prompt = [int(t) for t in np.random.default_rng(prompt_len).integers(0, ours.config.vocab_size, prompt_len)]
    cache = ours.new_cache()
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        assert_logits_close(ours.forward_cached_last(prompt, cache), out.logits[0, -1].numpy())
        past, token = out.past_key_values, int(out.logits[0, -1].argmax())
        for _ in range(DECODE_STEPS):
            out = hf(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            assert_logits_close(ours.forward_cached_last([token], cache), out.logits[0, -1].numpy())
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())


def test_prompt_fed_in_pieces_equals_prompt_at_once(case):
    """After the first call only new tokens are passed: the recurrent states carry the prefix."""
    ours, _ = case
    prompt = [int(t) for t in np.random.default_rng(9).integers(0, ours.config.vocab_size, 21)]
    whole = ours.forward_cached_last(prompt, ours.new_cache())
    cache = ours.new_cache()
    for piece in (prompt[:3], prompt[3:4], prompt[4:20], prompt[20:]):
        parts = ours.forward_cached_last(piece, cache)
    assert_logits_close(parts, whole)


def test_16_greedy_tokens_identical(case):
    ours, hf = case
    prompt = [int(t) for t in np.random.default_rng(7).integers(0, ours.config.vocab_size, 11)]
    assert_greedy_matches(ours, hf, prompt, DECODE_STEPS)
