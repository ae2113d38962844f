"""Qwen3.5 image preprocessing (runtime.images) against transformers' Qwen2VLImageProcessorPil, and its errors."""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFile, ImageOps

from runtime.images import ImageError, PreprocessedImages, Qwen35ImageProcessor, RgbImage

ROOT = Path(__file__).resolve().parent.parent
NO_TORCH = Path(__file__).parent / "no_torch"
SIZES = [(32, 32), (50, 87), (123, 45), (300, 200), (17, 640), (5, 7)]  # (height, width)
# Qwen2-VL style: top-level min/max pixels, CLIP mean/std by default; 300x200 shrinks, 5x7 and 32x32 grow.
QWEN2_CONFIG = {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 16, "patch_size": 14, "merge_size": 2,
                "temporal_patch_size": 2}
# Qwen3.5 style: a size dict, patch 16, mean/std 0.5, the Fast processor named (as real checkpoints do).
QWEN35_CONFIG = {"size": {"longest_edge": 64 * 64 * 4, "shortest_edge": 64 * 64}, "patch_size": 16,
                 "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessorFast",
                 "processor_class": "Qwen3VLProcessor"}
CONFIGS = {"qwen2": QWEN2_CONFIG, "qwen35": QWEN35_CONFIG}


def _write_config(directory: Path, config) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "preprocessor_config.json").write_text(json.dumps(config))
    return directory


def _processors(directory: Path, config: dict):
    """Ours and transformers', both loaded from the same preprocessor_config.json."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    _write_config(directory, config)
    return Qwen35ImageProcessor.from_huggingface(directory), Qwen2VLImageProcessorPil.from_pretrained(directory)


def _assert_same(ours: PreprocessedImages, theirs) -> None:
    expected = theirs["pixel_values"]
    assert ours.pixel_values.dtype == np.float32
    assert ours.shape == expected.shape
    np.testing.assert_allclose(ours.pixel_values, expected, rtol=0, atol=1e-6)
    assert ours.grids == tuple(tuple(g) for g in theirs["image_grid_thw"].tolist())
    assert sum(ours.patch_counts) == ours.shape[0]


def _random_image(height: int, width: int, mode: str, seed: int = 0) -> Image.Image:
    """A random image of a mode; P images get a palette (and a transparent index), alpha bands vary."""
    rng = np.random.default_rng(seed)
    rgba = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
    if mode == "P":
        image = Image.fromarray(rgba[..., :3]).quantize(16)
        image.info["transparency"] = 3
        return image
    return Image.fromarray(rgba).convert(mode)


def _save(image: Image.Image, path: Path, **options) -> Path:
    image.save(path, **options)
    return path


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    return _processors(tmp_path_factory.mktemp("qwen2"), QWEN2_CONFIG)


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return _processors(tmp_path_factory.mktemp("qwen35"), QWEN35_CONFIG)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rgb_buffers_match_transformers(name, tmp_path):
    ours, theirs = _processors(tmp_path, CONFIGS[name])
    arrays = [np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8) for i, (h, w) in enumerate(SIZES)]
    images = [RgbImage(a.tobytes(), h, w) for a, (h, w) in zip(arrays, SIZES)]
    result = ours.preprocess_rgb(images)
    _assert_same(result, theirs(images=arrays, return_tensors="np"))
    # one image at a time gives the same rows: the batch is their concatenation in order
    singles = [ours.preprocess_rgb([image]) for image in images]
    np.testing.assert_array_equal(result.pixel_values, np.concatenate([s.pixel_values for s in singles]))
    assert result.patch_counts == tuple(s.shape[0] for s in singles)
    # both down- and up-scaling happened
    p = ours.patch_size
    areas = [h * w * p * p for _, h, w in result.grids]
    assert areas[SIZES.index((300, 200))] < 300 * 200 and areas[SIZES.index((5, 7))] > 5 * 7


def test_rgb_buffer_kinds(qwen35):
    ours, _ = qwen35
    array = np.random.default_rng(1).integers(0, 256, (50, 87, 3), dtype=np.uint8)
    expected = ours.preprocess_rgb([RgbImage(array.tobytes(), 50, 87)]).pixel_values
    for pixels in (bytearray(array.tobytes()), memoryview(array.tobytes()), array, array.reshape(-1)):
        np.testing.assert_array_equal(ours.preprocess_rgb([RgbImage(pixels, 50, 87)]).pixel_values, expected)


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P", "LA"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_png_files_match_transformers(name, mode, tmp_path):
    ours, theirs = _processors(tmp_path / "model", CONFIGS[name])
    paths = [_save(_random_image(h, w, mode, seed=i), tmp_path / f"{i}.png") for i, (h, w) in enumerate(SIZES)]
    result = ours.preprocess_files(paths)
    _assert_same(result, theirs(images=[Image.open(p) for p in paths], return_tensors="np"))
    if mode in ("RGB", "L"):  # opaque: transformers' own file loading (load_image) agrees too
        _assert_same(result, theirs(images=[str(p) for p in paths], return_tensors="np"))


@pytest.mark.parametrize("mode", ["RGB", "L", "CMYK"])
def test_jpeg_files_match_transformers(mode, qwen2, tmp_path):
    ours, theirs = qwen2
    paths = [_save(_random_image(h, w, mode, seed=i), tmp_path / f"{i}.jpg", quality=90)
             for i, (h, w) in enumerate(SIZES)]
    result = ours.preprocess_files(paths)
    _assert_same(result, theirs(images=[Image.open(p) for p in paths], return_tensors="np"))
    _assert_same(result, theirs(images=[str(p) for p in paths], return_tensors="np"))


def test_other_transparency_and_depths(qwen35, tmp_path):
    ours, theirs = qwen35
    keyed = _random_image(40, 70, "RGB", seed=3)  # an RGB PNG with a transparent colour (tRNS)
    keyed.info["transparency"] = tuple(np.asarray(keyed)[0, 0].tolist())
    deep = Image.fromarray(np.random.default_rng(4).integers(0, 300, (33, 61), dtype=np.uint16))
    frames = [_random_image(30, 50, "P", seed=s) for s in (5, 6)]
    paths = [_save(keyed, tmp_path / "keyed.png"), _save(deep, tmp_path / "deep.png"),
             _save(frames[0], tmp_path / "anim.gif", save_all=True, append_images=frames[1:]),
             _save(_random_image(20, 90, "RGBA", seed=7), tmp_path / "alpha.webp", lossless=True)]
    assert Image.open(paths[1]).mode == "I;16" and Image.open(paths[2]).n_frames == 2
    _assert_same(ours.preprocess_files(paths), theirs(images=[Image.open(p) for p in paths], return_tensors="np"))


def test_exif_orientation_is_applied_like_load_image(qwen2, tmp_path):
    ours, theirs = qwen2
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to view
    path = _save(_random_image(30, 90, "RGB"), tmp_path / "rotated.jpg", exif=exif)
    result = ours.preprocess_files([path])
    _assert_same(result, theirs(images=[str(path)], return_tensors="np"))
    _assert_same(result, theirs(images=[ImageOps.exif_transpose(Image.open(path))], return_tensors="np"))
    _, grid_h, grid_w = result.grids[0]
    assert grid_h > grid_w  # the upright image is taller than wide


@pytest.mark.parametrize("changes", [
    {"do_rescale": False},
    {"do_normalize": False},
    {"do_rescale": False, "do_normalize": False},
    {"rescale_factor": 0.5, "image_mean": 0.25, "image_std": 2},
    {"resample": 2},
    {"do_convert_rgb": False},
    {"temporal_patch_size": 3, "merge_size": 1, "patch_size": 8},
    {"size": {"shortest_edge": 10, "longest_edge": 99999}, "min_pixels": None, "max_pixels": 2000},
    {"size": None},
])
def test_config_variants_match_transformers(changes, tmp_path):
    ours, theirs = _processors(tmp_path, {**QWEN2_CONFIG, **changes})
    arrays = [np.random.default_rng(i).integers(0, 256, (h, w, 3), dtype=np.uint8) for i, (h, w) in enumerate(SIZES)]
    _assert_same(ours.preprocess_rgb([RgbImage(a, *a.shape[:2]) for a in arrays]),
                 theirs(images=arrays, return_tensors="np"))


def test_defaults_and_size_keys(tmp_path):
    defaults = Qwen35ImageProcessor.from_huggingface(_write_config(tmp_path / "a", {}))
    assert defaults == Qwen35ImageProcessor()
    assert (defaults.min_pixels, defaults.max_pixels, defaults.patch_size) == (3136, 1003520, 14)
    real = {**QWEN35_CONFIG, "size": {"longest_edge": 16777216, "shortest_edge": 65536}}
    loaded = Qwen35ImageProcessor.from_huggingface(_write_config(tmp_path / "b", real))
    assert (loaded.min_pixels, loaded.max_pixels, loaded.image_mean) == (65536, 16777216, (0.5, 0.5, 0.5))
    legacy = {"size": {"min_pixels": 1, "max_pixels": 2}, "min_pixels": 100, "max_pixels": 1000}
    loaded = Qwen35ImageProcessor.from_huggingface(_write_config(tmp_path / "c", legacy))
    assert (loaded.min_pixels, loaded.max_pixels) == (100, 1000)


def test_do_resize_false_needs_multiples(tmp_path):
    ours, theirs = _processors(tmp_path, {**QWEN2_CONFIG, "do_resize": False})
    arrays = [np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)]
    _assert_same(ours.preprocess_rgb([RgbImage(arrays[0], 56, 84)]), theirs(images=arrays, return_tensors="np"))
    with pytest.raises(ImageError, match=r"image 0 .*50x32.*do_resize.*multiples of 28"):
        ours.preprocess_rgb([RgbImage(bytes(32 * 50 * 3), 32, 50)])


def test_extreme_aspect_ratio(qwen2, tmp_path):
    ours, theirs = qwen2
    path = _save(_random_image(1, 201, "RGB"), tmp_path / "strip.png")
    with pytest.raises(ValueError, match="aspect ratio"):
        theirs(images=[Image.open(path)], return_tensors="np")
    with pytest.raises(ImageError, match=r"strip\.png: is 201x1 pixels, an aspect ratio of 201.*at most 200"):
        ours.preprocess_files([path])
    ours.preprocess_files([_save(_random_image(1, 200, "RGB"), tmp_path / "ok.png")])


def test_mode_kept_when_do_convert_rgb_is_false(tmp_path):
    ours = Qwen35ImageProcessor.from_huggingface(_write_config(tmp_path, {"do_convert_rgb": False}))
    path = _save(_random_image(20, 20, "L"), tmp_path / "gray.png")
    with pytest.raises(ImageError, match=r"gray\.png: is in mode L.*do_convert_rgb"):
        ours.preprocess_files([path])


@pytest.mark.parametrize("config, field", [
    ({"patch_size": -16}, "'patch_size'"),
    ({"patch_size": "16"}, "'patch_size'"),
    ({"merge_size": 0}, "'merge_size'"),
    ({"temporal_patch_size": 1.5}, "'temporal_patch_size'"),
    ({"image_mean": [0.5, 0.5]}, "'image_mean'"),
    ({"image_mean": "grey"}, "'image_mean'"),
    ({"image_std": [0.5, 0, 0.5]}, "'image_std'"),
    ({"rescale_factor": -1}, "'rescale_factor'"),
    ({"do_resize": "yes"}, "'do_resize'"),
    ({"do_convert_rgb": 1}, "'do_convert_rgb'"),
    ({"resample": 9}, "'resample'"),
    ({"image_mean": None}, "'image_mean' is null"),
    ({"do_normalize": None}, "'do_normalize' is null"),
    ({"size": 512}, "'size'"),
    ({"size": {"height": 224, "width": 224}}, "'size'"),
    ({"size": {"shortest_edge": 3136}}, "'size'"),
    ({"size": {"shortest_edge": -5, "longest_edge": 100}}, "'size.shortest_edge'"),
    ({"size": {"shortest_edge": 10, "longest_edge": 100.5}}, "'size.longest_edge'"),
    ({"min_pixels": 0}, "'min_pixels'"),
    ({"max_pixels": "many"}, "'max_pixels'"),
    ({"min_pixels": 5000, "max_pixels": 4000}, "'min_pixels' (the smallest image area, 5000) is above 'max_pixels'"),
    ({"size": {"shortest_edge": 5000, "longest_edge": 4000}}, "'size.shortest_edge' (the smallest image area"),
    ({"size": {"shortest_edge": 10, "longest_edge": 99}, "min_pixels": 100}, "'min_pixels' (the smallest image"),
])
def test_bad_config_fields(config, field, tmp_path):
    _write_config(tmp_path, config)
    with pytest.raises(ImageError, match="preprocessor_config.json") as caught:
        Qwen35ImageProcessor.from_huggingface(tmp_path)
    assert field in str(caught.value)
    assert caught.value.exit_code == 4


def test_missing_and_malformed_config(tmp_path):
    with pytest.raises(ImageError, match=r"preprocessor_config\.json: missing; image input needs"):
        Qwen35ImageProcessor.from_huggingface(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("{\"patch_size\": 16,")
    with pytest.raises(ImageError, match=r"preprocessor_config\.json: not valid JSON"):
        Qwen35ImageProcessor.from_huggingface(tmp_path)
    _write_config(tmp_path, [16])
    with pytest.raises(ImageError, match=r"preprocessor_config\.json: must hold a JSON object"):
        Qwen35ImageProcessor.from_huggingface(tmp_path)


def _zero_width_png() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", 0, 5, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def _encoded(fmt: str) -> bytes:
    buffer = io.BytesIO()
    _random_image(60, 80, "RGB").save(buffer, fmt)
    return buffer.getvalue()


@pytest.mark.parametrize("name, content, message", [
    ("absent.png", None, "no such image file"),
    ("notes.png", b"just some text, not pixels\n", "not an image file"),
    ("empty.jpg", b"", "not an image file"),
    ("zero.png", _zero_width_png(), "not an image file"),
    ("cut.png", _encoded("PNG")[:3000], "truncated or corrupt"),
    ("cut.jpg", _encoded("JPEG")[:1500], "truncated or corrupt"),
    ("folder.png", "dir", "cannot be read"),
])
def test_bad_image_files(name, content, message, qwen2, tmp_path):
    ours, _ = qwen2
    path = tmp_path / name
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    good = _save(_random_image(20, 20, "RGB"), tmp_path / "good.png")
    with pytest.raises(ImageError, match=message) as caught:
        ours.preprocess_files([good, path])
    assert str(caught.value).startswith(f"{path}: ")
    assert not ImageFile.LOAD_TRUNCATED_IMAGES


def test_bad_rgb_images_and_empty_batches(qwen2):
    ours, _ = qwen2
    with pytest.raises(ImageError, match="needs 300 bytes of pixels .*got 299"):
        RgbImage(bytes(299), 10, 10)
    with pytest.raises(ImageError, match="positive integer height and width"):
        RgbImage(b"", 0, 10)
    with pytest.raises(ImageError, match="positive integer height and width"):
        RgbImage(bytes(30), 10, -1)
    with pytest.raises(ImageError, match="must be uint8"):
        RgbImage(np.zeros((10, 10, 3), np.float32), 10, 10)
    for call in (ours.preprocess_rgb, ours.preprocess_files):
        with pytest.raises(ImageError, match="no images"):
            call([])


def test_module_needs_neither_torch_nor_transformers():
    code = "import sys, runtime.images; assert not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(NO_TORCH), str(ROOT)])}
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True)
