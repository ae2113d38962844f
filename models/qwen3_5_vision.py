"""Qwen3.5's vision encoder: image patches -> embeddings in the text model's hidden size.

    patches -> patch embed (a conv whose stride is its size: a linear of the flattened patch)
            + learned position embeddings (a square grid, bilinearly resampled to each image's grid)
            -> N x [LayerNorm -> attention within each image (2-D rotary) -> +residual,
                    LayerNorm -> GELU MLP -> +residual]
            -> merger: LayerNorm -> each merge x merge block of patches as one row -> fc1 -> GELU -> fc2

Several images run in one call, their patches one after the other in the merge-block order the
preprocessor gives (ir.graph's `image_patches`); the runtime computes each patch's grid position,
image and position-embedding taps (`runtime.vision`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ir import GraphBuilder, Param, TensorType
from ir.graph import IMAGE_TOKENS, PATCHES

from .config import ConfigReader
from .layers import linear

PREFIX = "model.visual."
ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # hidden_act -> the gelu op's approximation
NORM_EPS = 1e-6  # every LayerNorm of the encoder (fixed in transformers, not in the config)
TAPS = 4  # bilinear interpolation: each patch's position embedding mixes four grid points


@dataclass(frozen=True)
class VisionConfig:
    """The vision encoder's hyper-parameters and the special tokens of image prompts."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    activation: str
    rope_theta: float
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @property
    def head_dim(self) -> int:
        """Features per attention head."""
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch: channels x frames x patch rows x patch columns."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one image token."""
        return self.spatial_merge_size ** 2

    @property
    def grid_side(self) -> int:
        """Side of the learned square grid of position embeddings."""
        return int(round(self.num_position_embeddings ** 0.5))

    @property
    def rope_inv_freq(self) -> tuple[float, ...]:
        """The 2-D rotary's frequencies: a quarter of the head turns by the patch row, a quarter by its column."""
        quarter = self.head_dim // 4
        return tuple(1.0 / self.rope_theta ** (2 * i / (self.head_dim // 2)) for i in range(quarter)) * 2

    @property
    def rope_axes(self) -> list[int]:
        """Which patch coordinate (0 row, 1 column) each rotary frequency turns by."""
        quarter = self.head_dim // 4
        return [0] * quarter + [1] * quarter


def read_vision_config(cfg: ConfigReader) -> VisionConfig | None:
    """The vision encoder of an image-text config (None when it has no `vision_config`)."""
    raw = cfg.get("vision_config", None)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise cfg.error("vision_config", "must be an object holding the vision encoder's config")
    v = ConfigReader(raw, f"{cfg.source} (vision_config)")
    act = v.choice("hidden_act", tuple(ACTIVATIONS), "gelu_pytorch_tanh")
    hidden, heads = v.int("hidden_size", 1152), v.int("num_heads", 16)
    if hidden % heads or (hidden // heads) % 4:
        raise v.error("num_heads", f"({heads}) must split hidden_size ({hidden}) into heads whose size is a multiple "
                      "of 4 (the 2-D rotary turns a quarter of each head per axis)")
    positions = v.int("num_position_embeddings", 2304)
    if round(positions ** 0.5) ** 2 != positions:
        raise v.error("num_position_embeddings", f"({positions}) must be a square: the learned grid is square")
    rope = v.get("rope_parameters", None) or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "axial") != "axial":
        raise v.error("rope_parameters", f"must be an axial rotary (rope_type 'axial'), got {rope!r}")
    image_token = cfg.int("image_token_id", 248056, minimum=0)
    return VisionConfig(
        depth=v.int("depth", 27), hidden_size=hidden, intermediate_size=v.int("intermediate_size", 4304),
        num_heads=heads, in_channels=v.int("in_channels", 3), patch_size=_single(v, "patch_size", 16),
        temporal_patch_size=_single(v, "temporal_patch_size", 2), spatial_merge_size=v.int("spatial_merge_size", 2),
        out_hidden_size=v.int("out_hidden_size", 3584), num_position_embeddings=positions,
        activation=ACTIVATIONS[act],
        rope_theta=ConfigReader(rope, f"{v.source} (rope_parameters)").float("rope_theta", 10000.0),
        image_token_id=image_token, video_token_id=cfg.int("video_token_id", 248057, minimum=0),
        vision_start_token_id=cfg.int("vision_start_token_id", 248053, minimum=0),
        vision_end_token_id=cfg.int("vision_end_token_id", 248054, minimum=0))


def _single(v: ConfigReader, field: str, default: int) -> int:
    """A size given as an int or as an equal pair."""
    value = v.get(field, default)
    if isinstance(value, list) and len(value) == 2 and value[0] == value[1]:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise v.error(field, f"must be a positive integer (or an equal pair), got {value!r}")
    return value


def checkpoint_shapes(v: VisionConfig) -> dict[str, tuple[int, ...]]:
    """The encoder's checkpoint tensors and their shapes."""
    p, h = PREFIX, v.hidden_size
    merged = h * v.merge_unit
    shapes = {p + "patch_embed.proj.weight": (h, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
              p + "patch_embed.proj.bias": (h,), p + "pos_embed.weight": (v.num_position_embeddings, h)}
    for i in range(v.depth):
        b = f"{p}blocks.{i}."
        shapes |= {b + "norm1.weight": (h,), b + "norm1.bias": (h,), b + "norm2.weight": (h,), b + "norm2.bias": (h,),
                   b + "attn.qkv.weight": (3 * h, h), b + "attn.qkv.bias": (3 * h,),
                   b + "attn.proj.weight": (h, h), b + "attn.proj.bias": (h,),
                   b + "mlp.linear_fc1.weight": (v.intermediate_size, h), b + "mlp.linear_fc1.bias": (v.intermediate_size,),
                   b + "mlp.linear_fc2.weight": (h, v.intermediate_size), b + "mlp.linear_fc2.bias": (h,)}
    m = p + "merger."
    return shapes | {m + "norm.weight": (h,), m + "norm.bias": (h,), m + "linear_fc1.weight": (merged, merged),
                     m + "linear_fc1.bias": (merged,), m + "linear_fc2.weight": (v.out_hidden_size, merged),
                     m + "linear_fc2.bias": (v.out_hidden_size,)}


def flattened_params(params: Mapping[str, Param]) -> dict[str, Param]:
    """The weight map's entries that differ from a plain copy: the patch conv kernel as a matrix [hidden, patch]."""
    name = PREFIX + "patch_embed.proj.weight"
    conv = params[name].type
    matrix = TensorType((conv.shape[0], conv.shape[1] * conv.shape[2] * conv.shape[3] * conv.shape[4]), conv.dtype)
    return {name: Param(name, matrix, (name,), "flatten")}


def encoder_entry(v: VisionConfig, params: dict[str, Param]):
    """The `encode_image` entry: patches of one or more images in, one embedding per merged block out."""
    g = GraphBuilder("encode_image", params, bucket_dims=(PATCHES,), derived_dims={IMAGE_TOKENS: (PATCHES, v.merge_unit)})
    pixels = g.input("pixels", (PATCHES, v.patch_dim), "float32", "image_patches")
    grid = g.input("grid_positions", (PATCHES, 2), "int32", "patch_positions")
    images = g.input("images", (PATCHES,), "int32", "patch_images")
    taps = g.input("taps", (PATCHES, TAPS), "int32", "patch_interpolation_index")
    tap_weights = g.input("tap_weights", (PATCHES, TAPS), "float32", "patch_interpolation_weight")
    p = PREFIX
    h = linear(g, pixels, p + "patch_embed.proj", "patches", bias=True)
    where = g.op("interpolated_embedding", [p + "pos_embed.weight", taps, tap_weights], "grid_embed")
    h = g.op("add", [h, where], "embedded")
    for i in range(v.depth):
        h = _block(g, v, f"{p}blocks.{i}.", h, grid, images)
    m = p + "merger."
    x = g.op("layer_norm", [h, m + "norm.weight", m + "norm.bias"], "merger_norm", eps=NORM_EPS)
    x = g.op("merge_rows", [x], "merged", group=v.merge_unit, rows=IMAGE_TOKENS)
    x = g.op("gelu", [linear(g, x, m + "linear_fc1", "merger_fc1", bias=True)], "merger_act", approximate="none")
    return g.finish([linear(g, x, m + "linear_fc2", "image_embeddings", bias=True)])


def _block(g: GraphBuilder, v: VisionConfig, b: str, h: str, grid: str, images: str) -> str:
    """One encoder block: attention within each image, then the MLP, each on a LayerNorm and added back."""
    d, width = v.head_dim, v.hidden_size
    x = g.op("layer_norm", [h, b + "norm1.weight", b + "norm1.bias"], b + "norm1", eps=NORM_EPS)
    qkv = linear(g, x, b + "attn.qkv", b + "qkv", bias=True)
    rope = {"head_dim": d, "inv_freq": list(v.rope_inv_freq), "pos_axes": v.rope_axes}
    q, k, val = (g.op("slice_cols", [qkv], b + name, period=3 * width, offset=i * width, width=width)
                 for i, name in enumerate(("q", "k", "v")))
    q = g.op("rope", [q, grid], b + "q_rot", **rope)
    k = g.op("rope", [k, grid], b + "k_rot", **rope)
    attn = g.op("image_attention", [q, k, val, images], b + "attn", num_heads=v.num_heads, head_dim=d, scale=d ** -0.5)
    h = g.op("add", [h, linear(g, attn, b + "attn.proj", b + "attn_out", bias=True)], b + "attn_res")
    x = g.op("layer_norm", [h, b + "norm2.weight", b + "norm2.bias"], b + "norm2", eps=NORM_EPS)
    x = g.op("gelu", [linear(g, x, b + "mlp.linear_fc1", b + "fc1", bias=True)], b + "act", approximate=v.activation)
    return g.op("add", [h, linear(g, x, b + "mlp.linear_fc2", b + "fc2", bias=True)], b + "mlp_res")
