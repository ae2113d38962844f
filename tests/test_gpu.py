"""On an NVIDIA GPU: CUDA artifacts from every path against transformers, as the CPU tests do (skipped elsewhere)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from conftest import TEST_BUCKETS
from test_cuda_build import nvrtc_available
from test_models_vs_transformers import assert_logits_close
from test_qwen35_vs_transformers import reference_model

from compiler.build import build
from runtime import CompiledModel, GreedyGenerationConfig, generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not tvm.cuda(0).exist, reason="no CUDA GPU on this machine")

COMPILERS = ["ptx", "nvcc"] + (["nvrtc"] if nvrtc_available() else [])
CASES = {"qwen2-bf16": dict(arch="qwen2", dtype="bfloat16"), "llama-f32-mha": dict(arch="llama", num_key_value_heads=4),
         "qwen3_5-bf16": dict(arch="qwen3_5", dtype="bfloat16", num_hidden_layers=3)}


@pytest.fixture(scope="module", params=[(c, k) for c in COMPILERS for k in CASES], ids=lambda p: f"{p[0]}-{p[1]}")
def models(request, tiny_factory, tmp_path_factory):
    compiler, case = request.param
    model_dir, cpu_artifact = tiny_factory(**CASES[case])
    out = tmp_path_factory.mktemp("gpu") / "artifact"
    build(model_dir, target="cuda", out=out, cuda_compiler=compiler, prefill_buckets=TEST_BUCKETS["prefill_tokens"],
          context_buckets=TEST_BUCKETS["context"], quiet=True)
    gpu = CompiledModel(model_dir, out, device="cuda")
    hf = reference_model(model_dir) if case.startswith("qwen3_5") else \
        transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return gpu, CompiledModel(model_dir, cpu_artifact), hf


def test_gpu_logits_match_transformers(models):
    gpu, _, hf = models
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, gpu.config.vocab_size, 24)]
    cache = gpu.new_cache(len(prompt) + 16)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        assert_logits_close(gpu.forward(prompt, cache), out.logits[0, -1].numpy())
        past, token = out.past_key_values, int(out.logits[0, -1].argmax())
        for _ in range(15):
            out = hf(torch.tensor([[token]]), past_key_values=past, use_cache=True)
            assert_logits_close(gpu.forward([token], cache), out.logits[0, -1].numpy())
            past, token = out.past_key_values, int(out.logits[0, -1].argmax())


def test_gpu_greedy_tokens_equal_cpu(models):
    gpu, cpu, _ = models
    config = GreedyGenerationConfig(32, eos_token_ids=[])
    assert generate(gpu, [5, 6, 7], config).generated_token_ids == generate(cpu, [5, 6, 7], config).generated_token_ids
