"""Continuous batching through the compiled model: many requests at once give exactly their solo tokens."""

from __future__ import annotations

import numpy as np
import pytest

from compiler.build import build
from ir.contract import ATTENTION_ENTRIES, hidden_entry
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

BATCH_BUILD = dict(prefill_buckets=(8, 32), max_context=64, batch_rows=(1, 4, 8), kv_pages=40, kv_block=8,
                   legacy_attention=True)


def _batched_model(root, arch, **options):
    model_dir = write_tiny_checkpoint(root / "model", arch=arch, dtype="bfloat16", seed=4)
    build_options = {**BATCH_BUILD, **options}
    return CompiledModel(model_dir, build(model_dir, out=root / "artifact", quiet=True, **build_options).path)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return _batched_model(tmp_path_factory.mktemp("batch"), "qwen2")


def test_llama_batches_equal_solo_runs(tmp_path, monkeypatch):
    llama = _batched_model(tmp_path, "llama", legacy_attention=False)  # the fused path only, the default
    monkeypatch.setenv("RUDA_PAGED_ATTENTION", "legacy")
    with pytest.raises(GenerationError, match="no legacy attention path; rebuild with --legacy-paged-attention: "
                                              "python -m compiler build .* --legacy-paged-attention"):
        llama.new_batch_cache()
    monkeypatch.delenv("RUDA_PAGED_ATTENTION")
    prompts = _prompts(12, llama.config.vocab_size, seed=7)
    configs = [GreedyGenerationConfig(10, eos_token_ids=[]) for _ in prompts]
    executor = BatchExecutor(llama, ContinuousBatchConfig(8, 32), PagedKvCacheConfig(8, 16, 64))
    for prompt, config, finished in zip(prompts, configs, _run_all(executor, prompts, configs)):
        assert finished.generated_token_ids == generate(llama, prompt, config).generated_token_ids


def _prompts(n, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 30)))] for _ in range(n)]


def _run_all(executor, prompts, configs):
    ids = {executor.submit(p, c): i for i, (p, c) in enumerate(zip(prompts, configs))}
    out = {ids[f.request_id]: f for f in executor.run()}
    assert sorted(out) == list(range(len(prompts)))
    executor.scheduler.check_invariants()
    assert executor.scheduler.free_pages == executor.scheduler.num_pages
    return [out[i] for i in range(len(prompts))]


def test_32_concurrent_requests_equal_solo_runs(model, attention_path):
    prompts = _prompts(32, model.config.vocab_size)
    configs = [GreedyGenerationConfig(int(n), eos_token_ids=[]) for n in np.random.default_rng(1).integers(1, 20, 32)]
    executor = BatchExecutor(model, ContinuousBatchConfig(max_active_sequences=8, max_batch_tokens=32))
    for prompt, config, finished in zip(prompts, configs, _run_all(executor, prompts, configs)):
        assert finished.generated_token_ids == generate(model, prompt, config).generated_token_ids
        assert finished.finish_reason == "length"


def test_preemption_under_a_tiny_page_budget_keeps_every_token(model, attention_path):
    prompts = _prompts(32, model.config.vocab_size, seed=2)
    configs = [GreedyGenerationConfig(16, eos_token_ids=[]) for _ in prompts]
    executor = BatchExecutor(model, ContinuousBatchConfig(4, 16), PagedKvCacheConfig(8, 12, 64))
    for prompt, config, finished in zip(prompts, configs, _run_all(executor, prompts, configs)):
        assert finished.generated_token_ids == generate(model, prompt, config).generated_token_ids
    assert executor.scheduler.stats.preemptions > 0


def test_shared_prefixes_give_solo_tokens(model, attention_path):
    prefix = [int(t) for t in np.random.default_rng(3).integers(0, model.config.vocab_size, 16)]
    prompts = [prefix + [5], prefix + [9, 11], prefix, prefix + [5]]
    configs = [GreedyGenerationConfig(8, eos_token_ids=[]) for _ in prompts]
    executor = BatchExecutor(model, ContinuousBatchConfig(4, 32))
    for prompt, config, finished in zip(prompts, configs, _run_all(executor, prompts, configs)):
        assert finished.generated_token_ids == generate(model, prompt, config).generated_token_ids
    stats = executor.scheduler.stats
    assert stats.prefix_hit_pages >= 4 and stats.copy_on_write >= 1  # the bare prefix recomputes its last token


def test_sampled_requests_keep_their_own_seeded_streams(model):
    prompts = _prompts(5, model.config.vocab_size, seed=5)
    configs = [SamplingGenerationConfig(12, eos_token_ids=[], sampling=SamplingConfig(1.0, 20, 0.95, seed=i))
               for i in range(5)]
    executor = BatchExecutor(model, ContinuousBatchConfig(4, 16))
    for prompt, config, finished in zip(prompts, configs, _run_all(executor, prompts, configs)):
        assert finished.generated_token_ids == generate(model, prompt, config).generated_token_ids


def test_steps_of_only_unfinished_prompt_chunks_skip_the_head(model, attention_path, monkeypatch):
    """With 8 tokens a step, a 20-token prompt fills the cache in steps of 8, 8 and 4 tokens: the first two want no
    token, so they run the step variant without the vocabulary head; the tokens are a solo run's."""
    prompt = [int(t) for t in np.random.default_rng(9).integers(0, model.config.vocab_size, 20)]
    config = GreedyGenerationConfig(4, eos_token_ids=[])
    calls, call = [], StepFunctions.__call__
    monkeypatch.setattr(StepFunctions, "__call__", lambda self, name, *a: calls.append(name) or call(self, name, *a))
    (finished,) = _run_all(BatchExecutor(model, ContinuousBatchConfig(2, 8)), [prompt], [config])
    entry = ATTENTION_ENTRIES[attention_path]
    assert calls[:3] == [f"{hidden_entry(entry)}_t8_r1", f"{hidden_entry(entry)}_t8_r1", f"{entry}_t4_r1"]
    assert all("_hidden_" not in name for name in calls[3:])  # decode steps: each wants its token
    assert finished.generated_token_ids == generate(model, prompt, config).generated_token_ids


def test_eos_finishes_a_request_early(model):
    prompt = [3, 4, 5]
    free = generate(model, prompt, GreedyGenerationConfig(10, eos_token_ids=[])).generated_token_ids
    executor = BatchExecutor(model, ContinuousBatchConfig(2, 8))
    (finished,) = _run_all(executor, [prompt], [GreedyGenerationConfig(10, eos_token_ids=[free[2]])])
    assert finished.generated_token_ids == free[:free.index(free[2]) + 1] and finished.finish_reason == "eos"


def test_configs_that_do_not_fit_the_artifact(model, tiny_factory):
    with pytest.raises(GenerationError, match="exceeds the artifact's batch steps"):
        BatchExecutor(model, ContinuousBatchConfig(16, 32))
    with pytest.raises(GenerationError, match="does not fit the artifact's KV arena"):
        BatchExecutor(model, ContinuousBatchConfig(4, 32), PagedKvCacheConfig(16, 10, 64))
    single = CompiledModel(*tiny_factory(arch="qwen2"))  # built with the default --batch-rows 1
    with pytest.raises(GenerationError, match=r"exceeds the artifact's batch steps \(rows up to 1"):
        BatchExecutor(single, ContinuousBatchConfig(4, 16))
    (done,) = _run_all(BatchExecutor(single, ContinuousBatchConfig(1, 16)), [[5, 6, 7]],
                       [GreedyGenerationConfig(4, eos_token_ids=[])])
    assert done.generated_token_ids == generate(single, [5, 6, 7], GreedyGenerationConfig(4, eos_token_ids=[])) \
        .generated_token_ids


def test_generate_cli_serves_a_file_of_prompts(model, tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from runtime import load_pipeline

    prompts = ["Hello there", "The quick brown fox", "1 2 3 4 5 6 7 8 9 10 11 12"]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n\n")
    root = Path(__file__).resolve().parent.parent
    result = subprocess.run([sys.executable, "-m", "runtime.generate", str(model.model_dir), "--batch",
                             str(tmp_path / "prompts.txt"), "--max-new-tokens", "6", "--artifact", str(model.artifact)],
                            capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert lines[0]["event"] == "load" and lines[-1]["event"] == "summary" and lines[-1]["requests"] == 3
    assert lines[-1]["scheduler"]["batches"] >= 6 and lines[-1]["scheduler"]["preemptions"] == 0
    results = sorted((line for line in lines if line["event"] == "result"), key=lambda line: line["index"])
    pipeline = load_pipeline(model.model_dir, model.artifact)
    for prompt, line in zip(prompts, results):
        want = pipeline.generate_text(prompt, GreedyGenerationConfig(6))
        assert line["generated_token_ids"] == want.generated_token_ids and line["text"] == want.text
    both = subprocess.run([sys.executable, "-m", "runtime.generate", str(model.model_dir), "Hi", "--batch", "x"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)
    assert both.returncode == 2 and "either PROMPT or --batch FILE" in both.stderr


def test_copy_page_copies_one_page_of_every_kv_arena_on_the_device(model):
    cache = model.new_batch_cache()
    data = [np.random.default_rng(i).standard_normal(t.shape).astype(np.float32) for i, t in enumerate(cache.tensors)]
    for tensor, values in zip(cache.tensors, data):
        tensor.copyfrom(values)
    model.copy_page(cache, 3, 7)
    for tensor, values in zip(cache.tensors, data):
        want = values.copy()
        want[7] = values[3]
        np.testing.assert_array_equal(tensor.numpy(), want)


def test_steps_reuse_their_buffers_and_each_cache_has_its_own(model):
    """A function's inputs are copied into the same device buffers at every call, and it writes its logits into the
    same output buffer (what a CUDA graph captured at the first call replays); every batch cache has functions (a
    virtual machine) of its own."""
    cache = model.new_cache()
    model.forward([5, 6, 7], cache)
    decode = model.buckets.function_name("step", {"tokens": 1, "rows": 1})
    functions = cache.arena.cache.functions
    logits = model.forward([8], cache)
    inputs, output = functions.buffers(decode)
    assert len(inputs) == len([s for s in model.manifest.inputs["step"] if not s.is_state])
    np.testing.assert_array_equal(inputs[0].numpy(), [8])
    np.testing.assert_array_equal(output.numpy()[0], logits)
    again = model.forward([9], cache)
    assert all(a is b for a, b in zip(functions.buffers(decode)[0], inputs, strict=True))
    assert functions.buffers(decode)[1] is output
    np.testing.assert_array_equal(inputs[0].numpy(), [9])
    np.testing.assert_array_equal(output.numpy()[0], again)
    assert not np.array_equal(logits, again)
    other = model.new_batch_cache()
    assert other.functions is not functions and other.functions.buffers(decode) is None
    cache.release()


def test_a_failed_step_is_recovered_and_the_others_keep_their_tokens(model, monkeypatch):
    """The first run of a step function fails: the executor rebuilds its cache, the requests recompute, and
    every request still gets its solo tokens; one whose steps always fail finishes with "error"."""
    prompts = _prompts(6, model.config.vocab_size, seed=9)
    configs = [GreedyGenerationConfig(6, eos_token_ids=[]) for _ in prompts]
    executor = BatchExecutor(model, ContinuousBatchConfig(4, 32))
    call, failed = StepFunctions.__call__, []

    def flaky(self, name, *args):
        if not failed:
            failed.append(name)
            raise RuntimeError("device append failed")
        return call(self, name, *args)

    monkeypatch.setattr(StepFunctions, "__call__", flaky)
    for prompt, config, finished in zip(prompts, configs, _run_all(executor, prompts, configs)):
        assert finished.generated_token_ids == generate(model, prompt, config).generated_token_ids
    assert failed and executor.scheduler.stats.cache_resets == 1 and "device append failed" in str(executor.last_error)

    def broken(self, *args):
        raise RuntimeError("always fails")

    monkeypatch.setattr(StepFunctions, "__call__", broken)
    executor = BatchExecutor(model, ContinuousBatchConfig(4, 32))
    executor.submit([1, 2, 3], GreedyGenerationConfig(4))
    (finished,) = list(executor.run())
    assert finished.finish_reason == "error" and executor.scheduler.stats.cache_resets == BatchExecutor.MAX_FAILURES
