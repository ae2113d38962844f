"""Artifacts: manifest contents, reuse, atomic writes, and refusal of artifacts built for something else."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import TEST_BUCKETS

from compiler import build as build_module
from compiler.build import BuildError, build, resolve_buckets
from models.tiny import write_tiny_checkpoint
from runtime import ArtifactError, CompiledModel, GenerationError, default_artifact_dir
from ir.contract import MANIFEST


def _build(model_dir, out, **kw):
    return build(model_dir, out=out, prefill_buckets=TEST_BUCKETS["prefill_tokens"],
                 context_buckets=TEST_BUCKETS["context"], quiet=True, **kw)


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
    _, artifact = tiny_factory(arch="qwen2")
    m = json.loads((artifact / MANIFEST).read_text())
    assert m["model_type"] == "qwen2" and m["target"]["kind"] == "llvm"
    assert m["buckets"] == {"prefill_tokens": [8, 16], "context": [64, 128], "batch_rows": [], "kv_pages": 0,
                            "kv_block": 16, "legacy_attention": False}
    assert m["kind"] == "ruda-artifact" and set(m["files"]) == {"model.so"} and len(m["files"]["model.so"]) == 64
    assert len(m["ir_hash"]) == 64 and len(m["config_hash"]) == 64 and m["tvm_version"]
    assert "decode_c64" in m["functions"] and "prefill_t16_c128" in m["functions"]
    assert any(k.startswith("attention_") for k in m["kernels"])
    decode = {spec["name"]: (spec["role"], spec["layer"]) for spec in m["inputs"]["decode"]}
    assert decode["ids"] == ("token_ids", None) and decode["k_cache.1"] == ("k_cache", 1)
    assert set(m["inputs"]) == {"prefill", "decode"}  # no batched steps built
    assert (artifact / "ir.txt").read_text().startswith("program qwen2")


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
    result = build(model_dir, prefill_buckets=(8,), context_buckets=(32,), quiet=True)
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


def test_request_longer_than_largest_context_bucket(tiny_factory):
    model = CompiledModel(*tiny_factory(arch="qwen2"))
    with pytest.raises(GenerationError, match="exceed the largest context bucket 128.*--context-buckets"):
        model.new_cache(129)
    cache = model.new_cache(10)
    assert cache.capacity == 64
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        model.forward([model.config.vocab_size], cache)
    with pytest.raises(GenerationError, match="empty"):
        model.forward([], cache)


@pytest.mark.parametrize("prefill,context,message", [
    ((0, 8), (64,), "positive"),
    ((64,), (16, 128), "smaller than the smallest prefill bucket"),
    ((8,), (4096,), "exceeds the model's max_position_embeddings"),
])
def test_bad_buckets(prefill, context, message):
    with pytest.raises(BuildError, match=message):
        resolve_buckets(prefill, context, max_positions=2048)


def test_default_buckets_are_capped_by_max_positions():
    buckets = resolve_buckets(None, None, max_positions=1024)
    assert buckets.context == (512,) and buckets.prefill_tokens == (16, 64, 256)
    assert resolve_buckets(None, None, max_positions=300).context == (300,)


@pytest.mark.parametrize("remaining,chunk", [(1, 16), (16, 16), (20, 16), (4, 16), (63, 16), (64, 64), (100, 64),
                                             (255, 64), (256, 256), (1000, 256)])
def test_prefill_chunks_waste_little_padding(remaining, chunk):
    from runtime.engine import prefill_chunk
    assert prefill_chunk(remaining, [16, 64, 256]) == chunk
