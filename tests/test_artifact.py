"""Artifacts: manifest contents, reuse, atomic writes, and refusal of artifacts built for something else."""

from __future__ import annotations

import json
import shutil

import pytest
import tvm
from conftest import TEST_BUCKETS

from compiler import build as build_module
from compiler.build import BuildError, build, resolve_buckets
from models.tiny import write_tiny_checkpoint
from runtime import ArtifactError, CompiledModel, GenerationError, default_artifact_dir
from runtime.engine import StepFunctions
from ir.contract import MANIFEST, TargetSpec


def _build(model_dir, out, **kw):
    return build(model_dir, out=out, prefill_buckets=TEST_BUCKETS["prefill_tokens"],
                 max_context=TEST_BUCKETS["max_context"], quiet=True, **kw)


@pytest.fixture
def built(tmp_path, tiny_factory):
    model_dir, artifact = tiny_factory(arch="qwen2")
    model_copy, artifact_copy = tmp_path / "model", tmp_path / "artifact"
    shutil.copytree(model_dir, model_copy)
    shutil.copytree(artifact, artifact_copy)
    return model_copy, artifact_copy


def _edit_manifest(artifact, **changes):
    manifest = json.loads((artifact / MANIFEST).read_text())
    manifest.update(changes)
    (artifact / MANIFEST).write_text(json.dumps(manifest))


def test_manifest_describes_the_build(tiny_factory):
    model_dir, artifact = tiny_factory(arch="qwen2")
    m = json.loads((artifact / MANIFEST).read_text())
    assert m["model_type"] == "qwen2" and m["target"]["kind"] == "llvm"
    assert m["buckets"] == {"prefill_tokens": [8, 16], "batch_rows": [1], "max_context": 128, "kv_pages": 8,
                            "kv_block": 16, "entries": ["step", "step_hidden"], "image_patches": []}  # one row
    assert m["kind"] == "ruda-artifact" and set(m["files"]) == {"model.so"} and len(m["files"]["model.so"]) == 64
    assert len(m["ir_hash"]) == 64 and len(m["config_hash"]) == 64 and m["tvm_version"]
    steps = ["step_t1_r1", "step_t8_r1", "step_t16_r1"]  # a decode step, and the prefill chunks
    assert list(m["functions"]) == steps + [f"step_hidden_{name[5:]}" for name in steps]  # ... and without the head
    assert m["functions"]["step_t8_r1"] == {"shape": [1, m["vocab_size"]], "dtype": "float32"}  # one row's logits
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    assert m["functions"]["step_hidden_t8_r1"] == {"shape": [1, hidden], "dtype": "float32"}  # its last hidden row
    assert any(k.startswith("paged_attention_") for k in m["kernels"])
    step = {spec["name"]: (spec["role"], spec["layer"], spec["shape"]) for spec in m["inputs"]["step"]}
    assert step["ids"] == ("token_ids", None, ["tokens"]) and step["k_pages.1"] == ("k_pages", 1, [8, 16, 32])
    assert m["inputs"]["step_hidden"] == m["inputs"]["step"]
    assert set(m["inputs"]) == {"step", "step_hidden"}  # no legacy attention path built
    assert (artifact / "ir.txt").read_text().startswith("program qwen2")


def test_step_checks_its_inputs_but_not_each_weight(tiny_factory):
    """The VM checks a step's inputs and its output buffer at every call; its weights (hundreds of tensors at real
    size) it leaves to the kernels that take them, so a step does not spend VM instructions on each."""
    _, artifact = tiny_factory(arch="qwen2")
    manifest = json.loads((artifact / MANIFEST).read_text())
    tensors = len(manifest["inputs"]["step"]) + 1
    text = tvm.runtime.load_module(str(artifact / "model.so"))["as_text"]()
    step = text.split("@step_t1_r1:")[1].split("\n@")[0]
    assert step.count("vm.builtin.check_tensor_info") == tensors
    assert len(manifest["params"]) > tensors  # so checking the weights too would have shown in the count


def test_rebuild_with_nothing_changed_is_reused(built):
    model_dir, artifact = built
    before = (artifact / "model.so").stat().st_mtime_ns
    result = _build(model_dir, artifact)
    assert result.reused and (artifact / "model.so").stat().st_mtime_ns == before
    assert not _build(model_dir, artifact, force=True).reused


def test_changed_config_rebuilds(built):
    model_dir, artifact = built
    config = json.loads((model_dir / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5
    (model_dir / "config.json").write_text(json.dumps(config))
    assert not _build(model_dir, artifact).reused


def test_failed_build_leaves_old_artifact_and_no_temp(built, monkeypatch):
    model_dir, artifact = built
    old_manifest = (artifact / MANIFEST).read_text()

    def explode(*args, **kwargs):
        raise RuntimeError("simulated crash while compiling")

    monkeypatch.setattr(build_module.tvm, "compile", explode)
    with pytest.raises(RuntimeError):
        _build(model_dir, artifact, force=True)
    assert (artifact / MANIFEST).read_text() == old_manifest
    assert [p.name for p in artifact.parent.iterdir() if p.name.startswith(".")] == []


def test_failed_first_build_leaves_nothing(tmp_path, monkeypatch):
    model_dir = write_tiny_checkpoint(tmp_path / "m")
    monkeypatch.setattr(build_module.tvm, "compile", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError):
        _build(model_dir, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_missing_artifact_names_the_build_command(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "m")
    with pytest.raises(ArtifactError, match=f"python -m compiler build {model_dir} --target llvm"):
        CompiledModel(model_dir, tmp_path / "nowhere")


def test_default_artifact_place_is_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model_dir = write_tiny_checkpoint(tmp_path / "m")
    result = build(model_dir, prefill_buckets=(8,), max_context=32, quiet=True)
    assert result.path == default_artifact_dir(model_dir, "llvm")
    assert CompiledModel(model_dir).artifact == result.path


def test_refuses_artifact_of_another_model(built, tmp_path):
    _, artifact = built
    other = write_tiny_checkpoint(tmp_path / "other", arch="llama")
    with pytest.raises(ArtifactError, match="built for another model or config.json"):
        CompiledModel(other, artifact)


def test_refuses_artifact_after_config_change(built):
    model_dir, artifact = built
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_theta"] = 20000.0
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ArtifactError, match="another model or config.json.*rebuild: python -m compiler build .* --out "):
        CompiledModel(model_dir, artifact)


def test_refuses_artifact_for_other_weights(built, tmp_path):
    model_dir, artifact = built
    bf16 = write_tiny_checkpoint(tmp_path / "bf16", arch="qwen2", dtype="bfloat16", overwrite=True)
    for f in model_dir.glob("*.safetensors"):
        f.unlink()
    shutil.copy(bf16 / "model.safetensors", model_dir / "model.safetensors")
    with pytest.raises(ArtifactError, match="built for other weights \\(model.embed_tokens.weight is bfloat16 here, float32 in the artifact\\)"):
        CompiledModel(model_dir, artifact)


def test_refuses_other_tvm_version(built):
    model_dir, artifact = built
    _edit_manifest(artifact, tvm_version="0.1.0")
    with pytest.raises(ArtifactError, match="built with TVM 0.1.0"):
        CompiledModel(model_dir, artifact)


def test_refuses_other_target(built):
    model_dir, artifact = built
    _edit_manifest(artifact, target={"kind": "cuda", "arch": "sm_90", "cuda_compiler": "ptx", "ptx_version": None})
    with pytest.raises(ArtifactError, match="built for --target cuda: run it with --device cuda, or build one for "
                                           "this device: python -m compiler build .* --target llvm --out "):
        CompiledModel(model_dir, artifact)


def test_refuses_cpu_features_this_machine_lacks(built):
    model_dir, artifact = built
    manifest = json.loads((artifact / MANIFEST).read_text())
    manifest["target"]["features"].append("amx-fp8")
    (artifact / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="'amx-fp8'.*this machine lacks"):
        CompiledModel(model_dir, artifact)


def test_refuses_incomplete_artifact(built):
    model_dir, artifact = built
    (artifact / "model.so").unlink()
    with pytest.raises(ArtifactError, match="incomplete"):
        CompiledModel(model_dir, artifact)


def test_request_longer_than_the_context(tiny_factory):
    model = CompiledModel(*tiny_factory(arch="qwen2"))
    with pytest.raises(GenerationError, match="exceed the artifact's --max-context 128.*rebuild with a larger"):
        model.new_cache(129)
    cache = model.new_cache(10)
    assert cache.capacity == 10 and cache.pages == []  # pages are taken as the sequence grows
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        model.forward([model.config.vocab_size], cache)
    with pytest.raises(GenerationError, match="empty"):
        model.forward([], cache)
    with pytest.raises(GenerationError, match="exceeds its cache's capacity 10"):
        model.forward(list(range(11)), cache)


def test_single_sequences_take_pages_as_they_grow_and_give_them_back(tiny_factory, monkeypatch):
    model = CompiledModel(*tiny_factory(arch="qwen2"))  # arena: 8 pages of 16 tokens
    calls, call = [], StepFunctions.__call__
    monkeypatch.setattr(StepFunctions, "__call__", lambda self, name, *a: calls.append(name) or call(self, name, *a))
    first = model.new_cache()
    model.forward(list(range(20)), first)
    assert len(first.pages) == 2 and first.length == 20
    model.forward([3], first)
    assert len(first.pages) == 2
    # 20 prompt tokens as 16 (no logits wanted: no head) + 4 (padded to 8), then 1
    assert calls == ["step_hidden_t16_r1", "step_t8_r1", "step_t1_r1"]
    second = model.new_cache()
    model.forward(list(range(96)), second)
    assert len(second.pages) == 6 and not set(first.pages) & set(second.pages)
    with pytest.raises(GenerationError, match="the KV arena has 0 free pages; this sequence needs 1 more.*release"):
        model.forward(list(range(12)), first)
    first.release()
    assert first.released and first.pages == []
    with pytest.raises(GenerationError, match="released"):
        model.forward([1], first)
    del second  # dropping the last reference gives the pages back too
    third = model.new_cache()
    model.forward(list(range(128)), third)
    assert sorted(third.pages) == list(range(8))


@pytest.mark.parametrize("prefill,context,message", [
    ((0, 8), 64, "positive"),
    ((8,), 0, "--max-context must be positive"),
    ((8,), 4096, "exceeds the model's max_position_embeddings"),
])
def test_bad_buckets(prefill, context, message):
    with pytest.raises(BuildError, match=message):
        resolve_buckets(prefill, context, max_positions=2048)


def test_bad_arena_options():
    with pytest.raises(BuildError, match="--batch-rows 32 exceeds the largest prefill bucket 16"):
        resolve_buckets((8, 16), 64, 2048, batch_rows=(32,))
    with pytest.raises(BuildError, match="--kv-pages 3 cannot hold one sequence of 64 tokens"):
        resolve_buckets((8, 16), 64, 2048, kv_pages=3)


def test_default_buckets_are_capped_by_max_positions():
    buckets = resolve_buckets(None, None, max_positions=1024)
    assert buckets.max_context == 1024 and buckets.prefill_tokens == (16, 64, 256) and buckets.batch_rows == (1,)
    assert buckets.kv_pages == 64  # one sequence at the longest context
    assert resolve_buckets(None, None, max_positions=100_000).max_context == 4096


@pytest.mark.parametrize("remaining,step_cost,plan", [
    (1, 8, [1]), (2, 8, [1, 1]), (4, 8, [16]), (16, 8, [16]), (20, 8, [16, 16]), (63, 8, [64]), (100, 8, [64, 64]),
    (200, 8, [64, 64, 64, 16]), (255, 8, [256]), (1000, 8, [256, 256, 256, 256]),  # float32 products
    (20, 40, [64]), (100, 40, [64, 64]), (200, 40, [256]), (300, 40, [256, 64]),  # AMX tiles: steps cost more
    (100, 128, [256]), (600, 128, [256, 256, 256])])  # a GPU
def test_prefill_chunks_weigh_padding_against_steps(remaining, step_cost, plan):
    """A prompt runs in the chunks that cost least, a step costing its rows (padding too) and a fixed share that
    grows with how much faster the target multiplies than it reads weights (runtime.engine.STEP_COST_ROWS)."""
    from runtime.engine import prefill_chunk
    chunks = []
    while remaining > sum(chunks):
        chunks.append(prefill_chunk(remaining - sum(chunks), (1, 16, 64, 256), step_cost))
    assert chunks == plan


def test_a_model_plans_its_chunks_by_its_artifacts_target(tiny_factory):
    """With steps of 1, 16 and 64 tokens, two prompt tokens run as two one-row steps with float32 products, as one
    padded 16-row step where steps cost more (AMX tiles, a GPU); 20 as 16 + 16 or one padded 64."""
    import dataclasses

    model = CompiledModel(*tiny_factory(arch="qwen2"))
    model.buckets = dataclasses.replace(model.buckets, prefill_tokens=(16, 64))
    assert model.manifest.target.bf16_products is None and (model._chunk(2), model._chunk(20)) == (1, 16)
    for target in (dataclasses.replace(model.manifest.target, bf16_products="amx"), TargetSpec("cuda", arch="sm_90")):
        model.manifest = dataclasses.replace(model.manifest, target=target)
        assert (model._chunk(2), model._chunk(20)) == (16, 64)
