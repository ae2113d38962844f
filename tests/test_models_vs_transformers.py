"""Whole models against Hugging Face transformers on tiny random checkpoints in the real format.

Tolerance: every logit within 1e-4 * max(1, max |reference logit|) of transformers (float32 reference,
weights upcast from the checkpoint dtype exactly as ours are); greedy tokens must be identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime import CompiledModel, GreedyGenerationConfig, generate
from runtime.engine import StepFunctions

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASES = {
    "qwen2-gqa-tied-f32": dict(arch="qwen2", tie_word_embeddings=True),
    "qwen2-mha-untied-bf16-sharded": dict(arch="qwen2", num_key_value_heads=4, tie_word_embeddings=False,
                                          dtype="bfloat16", shards=3, seed=1),
    "llama-gqa-untied-f16": dict(arch="llama", dtype="float16", seed=2),
    "llama-mqa-headdim-llama3rope-bf16": dict(
        arch="llama", num_attention_heads=4, num_key_value_heads=1, head_dim=24, dtype="bfloat16", seed=3,
        rope_theta=500000.0, tie_word_embeddings=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32}),
}
PROMPT_LENGTHS = (1, 5, 24)  # 24 spans two chunks of the largest test prefill bucket (16)
DECODE_STEPS = 32


def assert_logits_close(ours: np.ndarray, theirs: np.ndarray) -> None:
    tol = 1e-4 * max(1.0, float(np.abs(theirs).max()))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=tol)


def assert_steps_match(ours, hf, prompt: list[int], steps: int):
    """The prompt's last logits and those of `steps` greedy decode steps (transformers' argmax fed to both) match;
    returns our cache."""
    cache = ours.new_cache(len(prompt) + steps + 1)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        assert_logits_close(ours.forward(prompt, cache), out.logits[0, -1].numpy())
        past, token = out.past_key_values, int(out.logits[0, -1].argmax())
        for _ in range(steps):
            out = hf(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            assert_logits_close(ours.forward([token], cache), out.logits[0, -1].numpy())
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())
    return cache


def assert_greedy_matches(ours, hf, prompt: list[int], steps: int):
    """`steps` greedy tokens without EOS are transformers' generate()'s; returns our result."""
    result = generate(ours, prompt, GreedyGenerationConfig(steps, eos_token_ids=[]))
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert result.generated_token_ids == want
    return result


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tiny_factory):
    model_dir, artifact = tiny_factory(**CASES[request.param])
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return CompiledModel(model_dir, artifact), hf


@pytest.mark.parametrize("prompt_len", PROMPT_LENGTHS)
def test_prefill_and_every_decode_step_match(case, prompt_len):
    ours, hf = case
    prompt = [int(t) for t in np.random.default_rng(prompt_len).integers(0, ours.config.vocab_size, prompt_len)]
    cache = assert_steps_match(ours, hf, prompt, DECODE_STEPS - 1)
    assert cache.length == prompt_len + DECODE_STEPS - 1


def test_prompt_chunks_before_the_last_skip_the_head(case, monkeypatch):
    """A 40-token prompt runs as chunks of 16, 16 and 8: the first two call the step variant without the vocabulary
    head, whose output, the last row's final normalised hidden state, is transformers' (last_hidden_state); the head
    runs once, after the last chunk, and its logits are transformers'."""
    ours, hf = case
    prompt = [int(t) for t in np.random.default_rng(40).integers(0, ours.config.vocab_size, 40)]
    calls, call = [], StepFunctions.__call__
    monkeypatch.setattr(StepFunctions, "__call__",
                        lambda self, name, *a: calls.append((self, name)) or call(self, name, *a))
    logits = ours.forward(prompt, ours.new_cache(len(prompt)))
    assert [name for _, name in calls] == ["step_hidden_t16_r1", "step_hidden_t16_r1", "step_t8_r1"]
    hidden = calls[0][0].buffers("step_hidden_t16_r1")[1].numpy()[0]  # after the second chunk: position 31's row
    with torch.no_grad():
        assert_logits_close(hidden, hf.model(torch.tensor([prompt[:32]])).last_hidden_state[0, -1].numpy())
        assert_logits_close(logits, hf(torch.tensor([prompt])).logits[0, -1].numpy())


def test_32_greedy_tokens_identical(case):
    ours, hf = case
    prompt = [int(t) for t in np.random.default_rng(7).integers(0, ours.config.vocab_size, 11)]
    assert not assert_greedy_matches(ours, hf, prompt, DECODE_STEPS).stopped_on_eos


def test_greedy_stops_on_eos_and_keeps_it(case):
    ours, _ = case
    prompt = [3, 4, 5]
    free = generate(ours, prompt, GreedyGenerationConfig(8, eos_token_ids=[]))
    stop_at = free.generated_token_ids[2]
    first = free.generated_token_ids.index(stop_at)
    result = generate(ours, prompt, GreedyGenerationConfig(8, eos_token_ids=[stop_at]))
    assert result.generated_token_ids == free.generated_token_ids[:first + 1]
    assert result.stopped_on_eos and result.finish_reason == "eos"
