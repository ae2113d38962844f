"""Qwen3.5 under continuous batching: KV pages for attention layers, per-sequence state slots for linear
layers, both attention paths (RUDA_PAGED_ATTENTION fused / legacy); every request gets its solo tokens."""

from __future__ import annotations

import numpy as np
import pytest
from test_batching import BATCH_BUILD, _prompts, _run_all

from compiler.build import build
from models.tiny import write_tiny_checkpoint
from runtime import (
    BatchExecutor,
    CompiledModel,
    ContinuousBatchConfig,
    GenerationError,
    GreedyGenerationConfig,
    PagedKvCacheConfig,
    SamplingConfig,
    SamplingGenerationConfig,
    generate,
)
from runtime.engine import StepFunctions


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35-batch")
    model_dir = write_tiny_checkpoint(root / "model", arch="qwen3_5", dtype="bfloat16", seed=5, num_hidden_layers=4,
                                      layer_types=["linear_attention", "full_attention", "linear_attention",
                                                   "full_attention"])
    return CompiledModel(model_dir, build(model_dir, out=root / "artifact", quiet=True, **BATCH_BUILD).path)


def _assert_solo(model, executor, prompts, configs):
    for prompt, config, finished in zip(prompts, configs, _run_all(executor, prompts, configs)):
        assert finished.generated_token_ids == generate(model, prompt, config).generated_token_ids


def test_concurrent_requests_with_chunked_prefill_equal_solo_runs(model, attention_path):
    prompts = _prompts(16, model.config.vocab_size, seed=11)  # up to 29 tokens: prefills span several 16-token steps
    configs = [GreedyGenerationConfig(int(n), eos_token_ids=[]) for n in np.random.default_rng(4).integers(1, 16, 16)]
    executor = BatchExecutor(model, ContinuousBatchConfig(max_active_sequences=8, max_batch_tokens=16))
    assert executor.cache.attention == attention_path
    _assert_solo(model, executor, prompts, configs)


def test_preemption_recomputes_the_recurrent_state(model, attention_path):
    prompts = _prompts(12, model.config.vocab_size, seed=2)
    configs = [GreedyGenerationConfig(16, eos_token_ids=[]) for _ in prompts]
    executor = BatchExecutor(model, ContinuousBatchConfig(4, 16), PagedKvCacheConfig(8, 10, 64))
    _assert_solo(model, executor, prompts, configs)
    assert executor.scheduler.stats.preemptions > 0


def test_shared_prefixes_are_computed_not_shared(model, attention_path):
    """KV pages alone do not hold a linear layer's state, so a cached prefix is never reused: same tokens as solo."""
    prefix = [int(t) for t in np.random.default_rng(3).integers(0, model.config.vocab_size, 16)]
    prompts = [prefix + [5], prefix, prefix + [9, 11], prefix]
    executor = BatchExecutor(model, ContinuousBatchConfig(4, 32))
    _assert_solo(model, executor, prompts, [GreedyGenerationConfig(8, eos_token_ids=[]) for _ in prompts])
    assert executor.scheduler.stats.prefix_hit_pages == 0


def test_sampled_requests_keep_their_seeded_streams(model):
    prompts = _prompts(4, model.config.vocab_size, seed=8)
    configs = [SamplingGenerationConfig(10, eos_token_ids=[], sampling=SamplingConfig(0.9, 20, 0.95, seed=i))
               for i in range(4)]
    _assert_solo(model, BatchExecutor(model, ContinuousBatchConfig(4, 16)), prompts, configs)


def test_attention_path_is_fixed_when_the_cache_is_made(model, monkeypatch):
    monkeypatch.delenv("RUDA_PAGED_ATTENTION", raising=False)
    cache = model.new_batch_cache()
    assert cache.attention == "fused"
    monkeypatch.setenv("RUDA_PAGED_ATTENTION", "legacy")
    assert cache.attention == "fused" and model.new_batch_cache().attention == "legacy"
    monkeypatch.setenv("RUDA_PAGED_ATTENTION", "flash")
    with pytest.raises(GenerationError, match="RUDA_PAGED_ATTENTION='flash' is not valid; use 'fused'"):
        model.new_batch_cache()


def test_a_failed_step_makes_the_cache_unusable(model, monkeypatch):
    cache = model.new_batch_cache()
    row = ([1, 2, 3], 0, [0], 0)
    before = model.step([row], cache)

    def broken(self, *args):
        raise RuntimeError("device append failed")

    monkeypatch.setattr(StepFunctions, "__call__", broken)
    with pytest.raises(GenerationError, match=r"create a new one \(new_cache\(\) for one sequence, new_batch_cache"):
        model.step([row], cache)
    monkeypatch.undo()
    with pytest.raises(GenerationError, match="unusable after a failed step"):
        model.step([row], cache)
    np.testing.assert_array_equal(model.step([row], model.new_batch_cache()), before)


def test_a_failed_step_of_one_sequence_leaves_a_fresh_arena_for_new_ones(model, monkeypatch):
    alone = model.forward([1, 2, 3], model.new_cache())
    cache = model.new_cache()
    monkeypatch.setattr(StepFunctions, "__call__", lambda self, *args: (_ for _ in ()).throw(RuntimeError("lost")))
    with pytest.raises(GenerationError, match=r"the step failed \(lost\).*new_cache\(\) for one sequence"):
        model.forward([1, 2, 3], cache)
    monkeypatch.undo()
    with pytest.raises(GenerationError, match="unusable after a failed step"):
        model.forward([1, 2, 3], cache)
    np.testing.assert_array_equal(model.forward([1, 2, 3], model.new_cache()), alone)


def test_single_sequences_hold_a_recurrent_state_slot_each(model):
    """One slot per live cache (one per row of the largest step: 8 here); a released cache's slot is reused."""
    held = [model.new_cache(16) for _ in range(8)]
    assert sorted(cache.slot for cache in held) == list(range(8))
    with pytest.raises(GenerationError, match="all 8 recurrent-state slots are held by live caches.*release"):
        model.new_cache(16)
    slot = held[3].slot
    held[3].release()
    assert model.new_cache(16).slot == slot
