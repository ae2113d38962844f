"""On an NVIDIA GPU: CUDA artifacts from every path against transformers, as the CPU tests do (skipped elsewhere)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from conftest import TEST_BUCKETS, TEST_IMAGE_PATCHES
from test_cuda_build import nvrtc_available
from test_models_vs_transformers import assert_logits_close
from test_qwen35_vs_transformers import reference_model

from benchmarks.gpu_check import KERNEL_CASES, kernel_inputs
from compiler.build import build
from runtime import CompiledModel, GreedyGenerationConfig, generate, load_pipeline

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
          max_context=TEST_BUCKETS["max_context"], quiet=True)
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


def test_gpu_image_prompts_equal_cpu(tiny_factory, tmp_path):
    """The vision encoder and image prompts on the GPU: embeddings and greedy tokens as on the CPU."""
    from test_qwen35_vision import MODEL, prompt_with, write_images

    model_dir, cpu_artifact = tiny_factory(**MODEL)
    out = tmp_path / "artifact"
    build(model_dir, target="cuda", out=out, prefill_buckets=TEST_BUCKETS["prefill_tokens"],
          max_context=TEST_BUCKETS["max_context"], image_patches=TEST_IMAGE_PATCHES, quiet=True)
    gpu, cpu = load_pipeline(model_dir, out, device="cuda"), load_pipeline(model_dir, cpu_artifact)
    paths = write_images(tmp_path)
    files = [paths["wide.png"], paths["tall.jpg"]]
    for got, want in zip(gpu.vision.encode_files(files), cpu.vision.encode_files(files)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))
    config = GreedyGenerationConfig(16, eos_token_ids=[])
    prompt = prompt_with(cpu, 2)
    assert gpu.generate_image_files_greedy(prompt, files, config=config).generated_token_ids == \
        cpu.generate_image_files_greedy(prompt, files, config=config).generated_token_ids


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("case", sorted(KERNEL_CASES))
def test_gpu_kernels_match_the_cpu_kernels(case, compiler):
    """Each GPU schedule (split reductions through shared memory, tiled GEMM) against the same kernel on the CPU."""
    from compiler import cuda
    from compiler.kernels import make_kernel
    from compiler.target import cpu_target
    from ir import OPS, TensorType, infer_types
    from schedules import cpu, gpu

    kind, _, attrs = KERNEL_CASES[case]
    inputs = kernel_inputs(case)
    types = [TensorType(x.shape, str(x.dtype)) for x in inputs]
    every = infer_types(kind, types, attrs)
    outs = [o for o, src in zip(every, OPS[kind].sources(len(every))) if src < 0]
    target, host = cuda.cuda_target("sm_90", compiler), cpu_target()
    cuda.prepare_environment()
    results = []
    for func, tgt, dev, pipeline in ((gpu.schedule(make_kernel(kind, types, attrs).func, kind, attrs, target),
                                      target.tvm_target(), tvm.cuda(0), target.tir_pipeline()),
                                     (cpu.schedule(make_kernel(kind, types, attrs).func, kind, attrs, host),
                                      host.tvm_target(), tvm.cpu(), "default")):
        lib = tvm.compile(func, tgt, tir_pipeline=pipeline)
        args = [tvm.runtime.tensor(x, dev) for x in inputs] + \
            [tvm.runtime.empty(o.shape, o.dtype, dev) for o in outs]
        lib.mod["main"](*args)
        results.append([a.numpy() for a in args[len(inputs):]])
    for got, want in zip(*results):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
