"""Qwen3.5 text: a hybrid decoder of Gated DeltaNet (linear attention) and gated full-attention layers.

    ids -> embed -> N x [RMSNorm -> token mixer -> +residual, RMSNorm -> SwiGLU MLP -> +residual]
         -> RMSNorm -> lm_head -> logits

`layer_types[i]` picks layer i's token mixer:
- `linear_attention`: in_proj_qkv -> causal depthwise conv1d (rolling state) + SiLU -> gated delta rule
  (recurrent state) -> RMSNorm per value head, times SiLU(in_proj_z) -> out_proj;
- `full_attention`: q_proj gives the query and a gate per head; q/k RMSNorm per head, rotary on the
  first `partial_rotary_factor` of each head, causal attention over the paged KV, times sigmoid(gate)
  -> o_proj.
Every RMSNorm except the gated one scales by (1 + weight). Two config forms: `qwen3_5_text` (weights
under `model.`) and `qwen3_5` with a `text_config` (the image-text checkpoint, weights under
`model.language_model.`). With a `vision_config` the program also holds the vision encoder
(models/qwen3_5_vision.py, entry `encode_image`), and its steps take input embeddings (an image's
tokens) and multimodal rotary positions: each rotary frequency turns by the token's temporal, height or
width position, interleaved as `mrope_section` says (all three equal for text).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Mapping

from ir import (
    BLOCK,
    PAGES,
    SLOTS,
    TOKENS,
    GraphBuilder,
    Param,
    Program,
    eliminate_dead_values,
    fuse_add_rms_norm,
)
from ir.ops import SEQUENCE_INPUTS

from . import qwen3_5_vision as vision
from .config import ConfigReader
from .layers import linear, swiglu_mlp
from .decoder import (
    DecoderConfig,
    assemble_program,
    decoder_fields,
    paged_attend,
    step_builder,
    step_inputs,
    step_output,
)
from .quantization import make_params

LAYER_TYPES = ("linear_attention", "full_attention")
TOP_LEVEL_FALLBACKS = ("torch_dtype", "dtype", "tie_word_embeddings", "eos_token_id", "bos_token_id")
PREFILL_CHUNK = 16  # tokens per chunk of the chunked delta rule in prefill (measured best on CPU: 16 >> 32, 64)
NORM_OFFSET = 1.0  # Qwen3.5's RMSNorm weights are stored as (scale - 1)
IGNORED_PREFIXES = ("mtp.",)  # the multi-token-prediction heads (and a vision tower the config does not declare)
MROPE_AXES = 3  # multimodal rotary positions: temporal, height, width


@dataclass(frozen=True)
class Qwen35Config(DecoderConfig):
    """DecoderConfig plus the hybrid layout and the linear-attention shapes."""

    layer_types: tuple[str, ...]
    rotary_dim: int
    conv_kernel: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    weight_prefix: str
    mrope_section: tuple[int, ...] = (11, 11, 10)
    vision: vision.VisionConfig | None = None
    """The vision encoder (an image-text config with a vision_config), else None."""

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v of the linear-attention layers."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        """Width of all value heads of a linear-attention layer."""
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def mrope_axes(self) -> list[int]:
        """The position axis (0 temporal, 1 height, 2 width) each rotary frequency turns by: height and width
        interleaved into every third frequency from the second and third, as far as their sections reach."""
        t, h, w = self.mrope_section
        return [1 if f % 3 == 1 and f < 3 * h else 2 if f % 3 == 2 and f < 3 * w else 0
                for f in range(self.rotary_dim // 2)]


def text_config(cfg: ConfigReader) -> tuple[ConfigReader, str]:
    """(reader over the text config, weight prefix) for either config form."""
    if cfg.raw.get("model_type") == "qwen3_5_text":
        return cfg, "model."
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise cfg.error("text_config", "must be an object holding the text model's config")
    if text.get("model_type", "qwen3_5_text") != "qwen3_5_text":
        raise cfg.error("text_config", f"has model_type {text.get('model_type')!r}; expected 'qwen3_5_text'")
    merged = {k: cfg.raw[k] for k in TOP_LEVEL_FALLBACKS if cfg.raw.get(k) is not None} | text
    return ConfigReader(merged, f"{cfg.source} (text_config)"), "model.language_model."


def read_config(cfg: ConfigReader) -> Qwen35Config:
    """Validate a Qwen3.5 text config (either form)."""
    model_type = cfg.raw.get("model_type")
    text, prefix = text_config(cfg)
    if cfg.raw.get("quantization_config") is not None or text.raw.get("quantization_config") is not None:
        raise text.error("quantization_config", "marks a quantised checkpoint; the Qwen3.5 text loader takes "
                         "unquantised weights only")
    if text.get("attention_bias", False):
        raise text.error("attention_bias", "is true; Qwen3.5 attention without biases is supported only")
    fields = decoder_fields(text, tie_default=False)
    layers = fields["num_hidden_layers"]
    types = _layer_types(text, layers)
    rope = text.get("rope_parameters", None) or text.raw
    rope_reader = ConfigReader(rope, text.source if rope is text.raw else f"{text.source} (rope_parameters)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise rope_reader.error("rope_type", f"is {kind!r}; Qwen3.5 text uses 'default' (or 'mrope', the same for text)")
    theta = rope_reader.float("rope_theta", text.raw.get("rope_theta", 10000.0))
    fraction = rope_reader.float("partial_rotary_factor", text.raw.get("partial_rotary_factor", 0.25))
    rotary = int(fields["head_dim"] * fraction)
    if rotary % 2 or not 0 < rotary <= fields["head_dim"]:
        raise rope_reader.error("partial_rotary_factor", f"({fraction}) rotates {rotary} of {fields['head_dim']} "
                                "head dims; it must rotate an even number > 0")
    k_heads, v_heads = text.int("linear_num_key_heads", 16), text.int("linear_num_value_heads", 32)
    if v_heads % k_heads:
        raise text.error("linear_num_value_heads", f"({v_heads}) must be a multiple of linear_num_key_heads ({k_heads})")
    section = rope.get("mrope_section", [11, 11, 10])
    if not isinstance(section, list) or len(section) != MROPE_AXES or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in section):
        raise rope_reader.error("mrope_section", f"must list three non-negative frequency counts (temporal, height, "
                                f"width), got {section!r}")
    encoder = vision.read_vision_config(cfg) if model_type == "qwen3_5" else None
    if encoder is not None and encoder.out_hidden_size != fields["hidden_size"]:
        raise cfg.error("vision_config", f"has out_hidden_size {encoder.out_hidden_size}, but the text model's "
                        f"hidden_size is {fields['hidden_size']}: image embeddings must fit the text model")
    return Qwen35Config(
        model_type=model_type, qkv_bias=False,
        rope_inv_freq=tuple(1.0 / theta ** (2 * i / rotary) for i in range(rotary // 2)),
        layer_types=types, rotary_dim=rotary, conv_kernel=text.int("linear_conv_kernel_dim", 4, minimum=2),
        linear_num_key_heads=k_heads, linear_num_value_heads=v_heads,
        linear_key_head_dim=text.int("linear_key_head_dim", 128), linear_value_head_dim=text.int("linear_value_head_dim", 128),
        weight_prefix=prefix, mrope_section=tuple(section), vision=encoder, **fields)


def _layer_types(text: ConfigReader, layers: int) -> tuple[str, ...]:
    """layer_types as given (one valid type per layer), or every full_attention_interval-th layer full."""
    types = text.get("layer_types", None)
    if types is None:
        interval = text.int("full_attention_interval", 4)
        return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers))
    if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
        raise text.error("layer_types", f"must list one of {', '.join(LAYER_TYPES)} for each of the {layers} layers, "
                         f"got {types!r}")
    return tuple(types)


def checkpoint_shapes(c: Qwen35Config) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, as the Hugging Face checkpoint stores them."""
    p, hidden = c.weight_prefix, c.hidden_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {p + "embed_tokens.weight": (c.vocab_size, hidden)}
    for i, kind in enumerate(c.layer_types):
        layer = f"{p}layers.{i}."
        shapes[layer + "input_layernorm.weight"] = (hidden,)
        if kind == "full_attention":
            a = layer + "self_attn."
            shapes |= {a + "q_proj.weight": (2 * q, hidden), a + "k_proj.weight": (kv, hidden),
                       a + "v_proj.weight": (kv, hidden), a + "o_proj.weight": (hidden, q),
                       a + "q_norm.weight": (c.head_dim,), a + "k_norm.weight": (c.head_dim,)}
        else:
            a, heads = layer + "linear_attn.", c.linear_num_value_heads
            shapes |= {a + "in_proj_qkv.weight": (c.conv_dim, hidden), a + "in_proj_z.weight": (c.value_dim, hidden),
                       a + "in_proj_b.weight": (heads, hidden), a + "in_proj_a.weight": (heads, hidden),
                       a + "conv1d.weight": (c.conv_dim, 1, c.conv_kernel), a + "dt_bias": (heads,),
                       a + "A_log": (heads,), a + "norm.weight": (c.linear_value_head_dim,),
                       a + "out_proj.weight": (hidden, c.value_dim)}
        shapes[layer + "post_attention_layernorm.weight"] = (hidden,)
        shapes[layer + "mlp.gate_proj.weight"] = (c.intermediate_size, hidden)
        shapes[layer + "mlp.up_proj.weight"] = (c.intermediate_size, hidden)
        shapes[layer + "mlp.down_proj.weight"] = (hidden, c.intermediate_size)
    shapes[p + "norm.weight"] = (hidden,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, hidden)
    return shapes | (vision.checkpoint_shapes(c.vision) if c.vision else {})


def build_program(c: Qwen35Config, param_dtypes: Mapping[str, str] | None = None) -> Program:
    """The step graphs (fused and legacy paged attention), and the vision encoder's; params in `param_dtypes`."""
    params = make_params(checkpoint_shapes(c), param_dtypes or {}, c.dtype, c.quantization)
    if c.vision is None:
        return assemble_program(c, params, _step_entry)
    params |= vision.flattened_params(params)
    return assemble_program(c, params, _step_entry, {"encode_image": vision.encoder_entry(c.vision, params)})


def _step_entry(c: Qwen35Config, params: dict[str, Param], gather: bool, logits: bool):
    """A step over one or more sequences (see models.decoder's step): KV in a paged arena per attention layer, the
    conv and recurrent states of linear-attention layers in a pool of per-sequence slots. With a vision encoder, the
    image tokens' embeddings come in as inputs and the rotary positions are multimodal."""
    g = step_builder(params, gather, logits)
    step = step_inputs(g, sequences=True)
    kv = c.num_key_value_heads * c.head_dim
    seqs = [step[name] for name in SEQUENCE_INPUTS]
    h = g.op("embedding", [c.weight_prefix + "embed_tokens.weight", step["ids"]], "embed")
    rope_pos, rope_axes = step["pos_of"], {}
    if c.vision is not None:
        given = g.input("input_embeddings", (TOKENS, c.hidden_size), "float32", "input_embeddings")
        h = g.op("merge_embeddings", [h, given, g.input("embedding_mask", (TOKENS,), "int32", "embedding_mask")],
                 "embed_merged")
        rope_pos, rope_axes = g.input("rope_positions", (TOKENS, MROPE_AXES), "int32", "rope_positions"), {
            "pos_axes": c.mrope_axes}
    mixers = []
    for i, kind in enumerate(c.layer_types):
        if kind == "full_attention":
            pages = [g.input(f"{part}_pages.{i}", (PAGES, BLOCK, kv), "float32", f"{part}_pages", i)
                     for part in ("k", "v")]
            mixers.append(partial(_gated_attention, g, c, pos=rope_pos, rope_axes=rope_axes,
                                  attend=paged_attend(g, c, step, *pages, gather)))
        else:
            conv = g.input(f"conv_pool.{i}", (SLOTS, c.conv_kernel - 1, c.conv_dim), "float32", "conv_pool", i)
            delta = g.input(f"delta_pool.{i}", (SLOTS, c.linear_num_value_heads, c.linear_key_head_dim,
                                                c.linear_value_head_dim), "float32", "recurrent_pool", i)
            mixers.append(partial(_gated_delta_net, g, c, n=step["n"], seqs=seqs, conv_pool=conv, delta_pool=delta))
    h = _decoder(g, c, h, mixers)
    out = step_output(g, c, h, step, c.weight_prefix + "embed_tokens", logits)
    return eliminate_dead_values(fuse_add_rms_norm(g.finish([out])))


def _decoder(g: GraphBuilder, c: Qwen35Config, h: str, mixers: list) -> str:
    """The layers over the input embeddings `h` (each `mixers[i](layer, x)` is layer i's token mixer), the final
    norm."""
    p = c.weight_prefix
    for i, mixer in enumerate(mixers):
        layer = f"{p}layers.{i}."
        x = g.op("rms_norm", [h, layer + "input_layernorm.weight"], layer + "mixer_norm", eps=c.rms_norm_eps,
                 weight_offset=NORM_OFFSET)
        h = g.op("add", [h, mixer(layer, x)], layer + "mixer_res")
        x = g.op("rms_norm", [h, layer + "post_attention_layernorm.weight"], layer + "mlp_norm", eps=c.rms_norm_eps,
                 weight_offset=NORM_OFFSET)
        h = g.op("add", [h, swiglu_mlp(g, x, layer + "mlp", layer)], layer + "mlp_res")
    return g.op("rms_norm", [h, p + "norm.weight"], "final_norm", eps=c.rms_norm_eps, weight_offset=NORM_OFFSET)


def _gated_attention(g: GraphBuilder, c: Qwen35Config, layer: str, x: str, *, pos: str, rope_axes: dict,
                     attend) -> str:
    """Gated attention; `attend(q, k, v, layer)` stores k/v and attends over the sequence's cache; `pos` the rotary
    positions (with `rope_axes`: the rope op's pos_axes for multimodal positions)."""
    a, d = layer + "self_attn.", c.head_dim
    q_gate = linear(g, x, a + "q_proj", layer + "q_gate")
    q = g.op("slice_cols", [q_gate], layer + "q", period=2 * d, offset=0, width=d)
    gate = g.op("slice_cols", [q_gate], layer + "attn_gate", period=2 * d, offset=d, width=d)
    k = linear(g, x, a + "k_proj", layer + "k")
    v = linear(g, x, a + "v_proj", layer + "v")
    norm = {"eps": c.rms_norm_eps, "group": d, "weight_offset": NORM_OFFSET}
    q = g.op("rms_norm", [q, a + "q_norm.weight"], layer + "q_normed", **norm)
    k = g.op("rms_norm", [k, a + "k_norm.weight"], layer + "k_normed", **norm)
    rope = {"head_dim": d, "inv_freq": list(c.rope_inv_freq), **rope_axes}
    q = g.op("rope", [q, pos], layer + "q_rot", **rope)
    k = g.op("rope", [k, pos], layer + "k_rot", **rope)
    gated = g.op("sigmoid_mul", [gate, attend(q, k, v, layer)], layer + "attn_gated")
    return linear(g, gated, a + "o_proj", layer + "attn_out")


def _gated_delta_net(g: GraphBuilder, c: Qwen35Config, layer: str, x: str, *, n: str, seqs: list[str],
                     conv_pool: str, delta_pool: str) -> str:
    """Gated DeltaNet of a step: the causal conv and the delta rule of each sequence over its own state slot (the
    chunked delta rule for a step of one sequence: see compiler.kernels.batch_gated_delta_rule)."""
    a = layer + "linear_attn."
    qkv, z, b, a_in = (linear(g, x, a + f"in_proj_{part}", layer + name)
                       for part, name in (("qkv", "qkv"), ("z", "z"), ("b", "b"), ("a", "a")))
    mixed, _ = g.op("batch_causal_conv1d", [qkv, conv_pool, a + "conv1d.weight", *seqs], layer + "conv")
    qk, gates = g.op("delta_inputs", [mixed, a_in, b, a + "A_log", a + "dt_bias", n], layer + "delta_in",
                     num_k_heads=c.linear_num_key_heads, k_dim=c.linear_key_head_dim)
    core, _ = g.op("batch_gated_delta_rule", [qk, mixed, gates, delta_pool, *seqs], layer + "delta",
                   chunk=PREFILL_CHUNK, num_k_heads=c.linear_num_key_heads, num_v_heads=c.linear_num_value_heads,
                   k_dim=c.linear_key_head_dim, v_dim=c.linear_value_head_dim)
    normed = g.op("rms_norm", [core, a + "norm.weight"], layer + "delta_normed", eps=c.rms_norm_eps,
                  group=c.linear_value_head_dim)
    gated = g.op("silu_mul", [z, normed], layer + "delta_gated")
    return linear(g, gated, a + "out_proj", layer + "delta_out")
