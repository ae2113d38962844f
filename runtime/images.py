"""Qwen3.5 image preprocessing: image files or RGB8 buffers to the vision encoder's patch rows.

The numbers equal transformers' `Qwen2VLImageProcessorPil` (the Pillow backend of the processor Qwen3.5 checkpoints
name, and what transformers loads for them without torchvision): conversion to RGB
(transparency composited onto white), `smart_resize` to multiples of patch_size*merge_size within
min_pixels..max_pixels, a Pillow resize of the uint8 image, rescale, normalise, and each still image repeated
temporal_patch_size times and cut into rows of C*T*P*P values, its patch grid (t, h, w) alongside.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ir.errors import RudaError
from models.config import ConfigReader, ModelConfigError, read_json_object

CONFIG_NAME = "preprocessor_config.json"
# transformers' defaults for keys a preprocessor_config.json leaves out
DEFAULT_SIZE = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200  # smart_resize refuses longer / shorter side above this
MAX_PIXELS = 1 << 30  # a larger pixel bound in a config is damage, not a real setting
RESAMPLE_FILTERS = 5  # Pillow's filters are 0..5 (NEAREST, LANCZOS, BILINEAR, BICUBIC, BOX, HAMMING)


class ImageError(RudaError):
    """An image that cannot be read or preprocessed, or an unusable preprocessor_config.json."""

    exit_code = 4


@dataclass(frozen=True)
class RgbImage:
    """An image as interleaved RGB8 bytes, row after row with no padding (len == height * width * 3)."""

    pixels: bytes | bytearray | memoryview | np.ndarray
    height: int
    width: int

    def __post_init__(self):
        sides = (self.height, self.width)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sides):
            raise ImageError(f"an RgbImage needs a positive integer height and width, got {self.height}x{self.width}")
        if isinstance(self.pixels, np.ndarray) and self.pixels.dtype != np.uint8:
            raise ImageError(f"RgbImage pixels must be uint8, got an array of {self.pixels.dtype}")
        size = self.pixels.size if isinstance(self.pixels, np.ndarray) else memoryview(self.pixels).nbytes
        if size != self.height * self.width * 3:
            raise ImageError(f"an RgbImage of height {self.height} and width {self.width} needs "
                             f"{self.height * self.width * 3} bytes of pixels (height*width*3), got {size}")

    def array(self) -> np.ndarray:
        """The pixels as a (height, width, 3) uint8 array."""
        pixels = self.pixels if isinstance(self.pixels, np.ndarray) else np.frombuffer(self.pixels, np.uint8)
        return pixels.reshape(self.height, self.width, 3)


@dataclass(frozen=True)
class PreprocessedImages:
    """The vision encoder's input: all images' patch rows concatenated in input order, and each image's grid."""

    pixel_values: np.ndarray  # float32 (N, C*T*P*P)
    grids: tuple[tuple[int, int, int], ...]  # (t, h, w) in patches, per image

    @property
    def shape(self) -> tuple[int, ...]:
        """The 2-D shape of pixel_values: (total patches, C*T*P*P)."""
        return self.pixel_values.shape

    @property
    def patch_counts(self) -> tuple[int, ...]:
        """The number of pixel_values rows (t*h*w) of each image."""
        return tuple(t * h * w for t, h, w in self.grids)

    @classmethod
    def concatenate(cls, parts: Sequence[PreprocessedImages]) -> PreprocessedImages:
        """Several preprocessed images as one, in order."""
        return cls(np.concatenate([p.pixel_values for p in parts]), tuple(g for p in parts for g in p.grids))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' smart_resize (aspect ratio already checked): sides that are multiples of factor, area in bounds."""
    resized_height = round(height / factor) * factor
    resized_width = round(width / factor) * factor
    if resized_height * resized_width > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        resized_height = max(factor, math.floor(height / beta / factor) * factor)
        resized_width = max(factor, math.floor(width / beta / factor) * factor)
    elif resized_height * resized_width < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        resized_height = math.ceil(height * beta / factor) * factor
        resized_width = math.ceil(width * beta / factor) * factor
    return resized_height, resized_width


def convert_to_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: an image with an alpha band or a transparency key is composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def open_image(path: str | os.PathLike) -> Image.Image:
    """A decoded image file (its first frame), upright by its EXIF orientation as transformers' load_image makes it."""
    try:
        with Image.open(path) as image:
            image.load()
            return ImageOps.exif_transpose(image)
    except FileNotFoundError:
        raise ImageError(f"{path}: no such image file; check the path") from None
    except UnidentifiedImageError:
        raise ImageError(f"{path}: not an image file Pillow can read (e.g. PNG, JPEG, WebP, GIF), or its header is "
                         "damaged; pass a valid image") from None
    except Image.DecompressionBombError as e:
        raise ImageError(f"{path}: too many pixels to decode safely ({e}); downscale the image") from None
    except OSError as e:
        if e.errno is not None:
            raise ImageError(f"{path}: cannot be read ({e.strerror}); check the path and its permissions") from None
        raise ImageError(f"{path}: cannot be decoded, the file is truncated or corrupt ({e}); re-create it") from None
    except (SyntaxError, ValueError, EOFError) as e:  # what Pillow's decoders raise for malformed data
        raise ImageError(f"{path}: cannot be decoded, the file is corrupt ({e}); re-create it") from None


@dataclass(frozen=True)
class Qwen35ImageProcessor:
    """The checkpoint's image preprocessing (preprocessor_config.json); defaults are transformers' own."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = DEFAULT_SIZE["shortest_edge"]
    max_pixels: int = DEFAULT_SIZE["longest_edge"]
    image_mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    image_std: tuple[float, float, float] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True

    @classmethod
    def from_huggingface(cls, model_dir: str | os.PathLike) -> Qwen35ImageProcessor:
        """The processor described by MODEL_DIR/preprocessor_config.json."""
        path = Path(model_dir) / CONFIG_NAME
        if not path.is_file():
            raise ImageError(f"{path}: missing; image input needs the checkpoint's {CONFIG_NAME}, copy it into the "
                             "model directory")
        try:
            config = read_json_object(path)
        except ModelConfigError as e:
            raise ImageError(str(e)) from None
        try:
            return cls._from_config(ConfigReader(config, str(path)))
        except ModelConfigError as e:
            raise ImageError(f"{e}; fix the field or restore the file from the checkpoint") from None

    @classmethod
    def _from_config(cls, reader: ConfigReader) -> Qwen35ImageProcessor:
        """The validated fields; min_pixels/max_pixels override size's shortest_edge/longest_edge as in transformers."""
        for name in (field.name for field in fields(cls)):  # transformers reads null as absent for size and pixels
            if name not in ("min_pixels", "max_pixels") and name in reader.raw and reader.raw[name] is None:
                raise reader.error(name, "is null, which transformers does not replace by its default; remove the key "
                                         "or give a value")
        size = reader.get("size", DEFAULT_SIZE)
        if not isinstance(size, dict):
            raise reader.error("size", f"must be an object with 'shortest_edge' and 'longest_edge', got {size!r}")
        size = dict(size)
        sources = {"shortest_edge": "size.shortest_edge", "longest_edge": "size.longest_edge"}
        for key, size_key in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if reader.raw.get(key) is not None:
                size[size_key] = reader.int(key, maximum=MAX_PIXELS)
                size.pop(key, None)
                sources[size_key] = key
        if set(size) != {"shortest_edge", "longest_edge"}:
            raise reader.error("size", f"must have exactly the keys 'shortest_edge' and 'longest_edge' (or give "
                                       f"'min_pixels' and 'max_pixels'), got {sorted(size)}")
        bounds = ConfigReader({f"size.{key}": value for key, value in size.items()}, reader.source)
        min_pixels = bounds.int("size.shortest_edge", maximum=MAX_PIXELS)
        max_pixels = bounds.int("size.longest_edge", maximum=MAX_PIXELS)
        if min_pixels > max_pixels:
            raise reader.error(sources["shortest_edge"], f"(the smallest image area, {min_pixels}) is above "
                                                         f"'{sources['longest_edge']}' (the largest, {max_pixels})")
        return cls(
            patch_size=reader.int("patch_size", cls.patch_size),
            temporal_patch_size=reader.int("temporal_patch_size", cls.temporal_patch_size),
            merge_size=reader.int("merge_size", cls.merge_size),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            image_mean=_channel_values(reader, "image_mean", cls.image_mean, nonzero=False),
            image_std=_channel_values(reader, "image_std", cls.image_std, nonzero=True),
            rescale_factor=reader.float("rescale_factor", cls.rescale_factor),
            resample=reader.int("resample", cls.resample, minimum=0, maximum=RESAMPLE_FILTERS),
            do_resize=reader.bool("do_resize", cls.do_resize),
            do_rescale=reader.bool("do_rescale", cls.do_rescale),
            do_normalize=reader.bool("do_normalize", cls.do_normalize),
            do_convert_rgb=reader.bool("do_convert_rgb", cls.do_convert_rgb),
        )

    def preprocess_files(self, paths: Sequence[str | os.PathLike]) -> PreprocessedImages:
        """Preprocess image files (any format Pillow reads; an animation's first frame) in order; a lone path is one."""
        paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        return self._preprocess((str(path), open_image(path)) for path in paths)

    def preprocess_rgb(self, images: Sequence[RgbImage]) -> PreprocessedImages:
        """Preprocess RGB8 images in order."""
        return self._preprocess((f"image {i} ({image.width}x{image.height} RgbImage)", Image.fromarray(image.array()))
                                for i, image in enumerate(images))

    def _preprocess(self, named_images: Iterable[tuple[str, Image.Image]]) -> PreprocessedImages:
        """Patch rows and grids of (name, image) pairs, one image at a time."""
        parts = []
        for name, image in named_images:
            rows, grid = self._patchify(self._normalized(name, self._rgb(name, image)))
            parts.append(PreprocessedImages(rows, (grid,)))
        if not parts:
            raise ImageError("no images to preprocess; pass at least one image")
        return PreprocessedImages.concatenate(parts)

    def _rgb(self, name: str, image: Image.Image) -> Image.Image:
        """The image in RGB mode as transformers makes it (left as it is when do_convert_rgb is false)."""
        if not self.do_convert_rgb:
            if image.mode != "RGB":
                raise ImageError(f"{name}: is in mode {image.mode}, and {CONFIG_NAME} sets do_convert_rgb to false; "
                                 "give an RGB image")
            return image
        try:
            return convert_to_rgb(image)
        except ValueError as e:  # a mode Pillow cannot convert
            raise ImageError(f"{name}: its mode {image.mode} cannot be converted to RGB ({e}); convert the image to "
                             "RGB first") from None

    def _normalized(self, name: str, image: Image.Image) -> np.ndarray:
        """The (C, H, W) image resized, rescaled and normalised as the config says (float32 when either is on)."""
        factor = self.patch_size * self.merge_size
        if self.do_resize:
            ratio = max(image.height, image.width) / min(image.height, image.width)
            if ratio > MAX_ASPECT_RATIO:
                raise ImageError(f"{name}: is {image.width}x{image.height} pixels, an aspect ratio of {ratio:.4g}; "
                                 f"Qwen image preprocessing allows at most {MAX_ASPECT_RATIO}, crop or pad the image")
            height, width = smart_resize(image.height, image.width, factor, self.min_pixels, self.max_pixels)
            image = image.resize((width, height), resample=self.resample)
        elif image.height % factor or image.width % factor:
            raise ImageError(f"{name}: is {image.width}x{image.height} pixels, and {CONFIG_NAME} sets do_resize to "
                             f"false, so both sides must be multiples of {factor}; resize the image")
        pixels = np.asarray(image).transpose(2, 0, 1)
        if self.do_rescale:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            mean = np.array(self.image_mean, np.float32)[:, None, None]
            std = np.array(self.image_std, np.float32)[:, None, None]
            pixels = (pixels.astype(np.float32) - mean) / std
        return pixels

    def _patchify(self, image: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """Rows of C*T*P*P values, merge_size x merge_size neighbouring patches adjacent, and the grid (1, h, w)."""
        channels, height, width = image.shape
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        grid_h, grid_w = height // p, width // p
        patches = image.astype(np.float32).reshape(channels, grid_h // m, m, p, grid_w // m, m, p)
        patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (h/m, w/m, m, m, C, P, P)
        frames = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], t, p, p))  # a still: T equal frames
        return frames.reshape(grid_h * grid_w, channels * t * p * p), (1, grid_h, grid_w)


def _channel_values(reader: ConfigReader, field: str, default: tuple[float, ...], nonzero: bool) -> tuple[float, ...]:
    """A per-channel (R, G, B) field: 3 finite numbers, or one number for all channels, as transformers accepts."""
    value = reader.get(field, default)
    values = [value] * 3 if _is_number(value) else value
    if not (isinstance(values, (list, tuple)) and len(values) == 3 and all(map(_is_number, values))
            and not (nonzero and 0 in values)):
        raise reader.error(field, f"must be 3 finite{' non-zero' if nonzero else ''} numbers (one per RGB channel), "
                                  f"got {value!r}")
    return tuple(float(v) for v in values)


def _is_number(value) -> bool:
    """A finite JSON number (not a boolean)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
