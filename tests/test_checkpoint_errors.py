"""Weight files: single and sharded checkpoints, and a clear error for each way they can be broken."""

from __future__ import annotations

import json
import shutil

import pytest

import models
from compiler.build import build
from models.checkpoint import CheckpointError, check_tensors, scan_checkpoint
from models.tiny import write_tiny_checkpoint


def _check(model_dir):
    config = models.load_config(model_dir)
    return check_tensors(scan_checkpoint(model_dir), models.checkpoint_shapes(config), model_dir)


@pytest.fixture
def sharded(tmp_path):
    return write_tiny_checkpoint(tmp_path / "m", arch="qwen2", shards=3, dtype="bfloat16")


def test_sharded_checkpoint_is_read_whole(sharded):
    dtypes = _check(sharded)
    assert set(dtypes.values()) == {"bfloat16"}
    assert len(dtypes) == len(models.checkpoint_shapes(models.load_config(sharded)))


def test_missing_shard(sharded):
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}.*missing"):
        _check(sharded)


def test_no_weights_at_all(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors and no model.safetensors.index.json"):
        _check(model_dir)


def test_missing_tensor(sharded):
    index = sharded / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
        _check(sharded)


def test_index_points_at_wrong_shard(sharded):
    index = sharded / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shards = sorted(set(data["weight_map"].values()))
    name = next(n for n, s in data["weight_map"].items() if s == shards[0])
    data["weight_map"][name] = shards[1]
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=f"does not hold tensor '{name}'"):
        _check(sharded)


def test_wrong_shape_against_config(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "m", arch="llama")
    config = json.loads((model_dir / "config.json").read_text())
    config["intermediate_size"] = 96
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"gate_proj.weight' has shape \[128, 64\], config.json implies \[96, 64\]"):
        _check(model_dir)


def test_corrupt_header(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "m")
    path = model_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe{{"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="header is not valid JSON"):
        _check(model_dir)


def test_truncated_file(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path / "m")
    path = model_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated"):
        _check(model_dir)


def test_unsupported_dtype(tmp_path):
    np = pytest.importorskip("numpy")
    from safetensors.numpy import load_file, save_file
    model_dir = write_tiny_checkpoint(tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.float64)
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(CheckpointError, match="'model.norm.weight' has dtype F64"):
        _check(model_dir)


def test_build_refuses_broken_checkpoint_and_leaves_nothing(tmp_path, sharded):
    shutil.copy(sorted(sharded.glob("model-*.safetensors"))[0], sorted(sharded.glob("model-*.safetensors"))[2])
    out = tmp_path / "artifact"
    with pytest.raises(CheckpointError):
        build(sharded, out=out, quiet=True)
    assert not out.exists()
    assert not list(tmp_path.glob(".artifact*"))


def test_header_that_is_not_an_object(tmp_path):
    import struct
    model_dir = write_tiny_checkpoint(tmp_path / "m")
    header = b"[1, 2, 3]"
    (model_dir / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(CheckpointError, match="header is not a JSON object"):
        _check(model_dir)
