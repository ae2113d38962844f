"""The decoder-only transformer that Llama and Qwen2 share: config record and IR builder.

    ids -> embed -> N x [RMSNorm -> attention (RoPE, GQA, paged KV) -> +residual
                         RMSNorm -> SwiGLU MLP -> +residual] -> RMSNorm -> lm_head -> logits

Its graphs are steps: the new tokens of one or more sequences in one flat list of token rows, their
KV in pages of a shared arena. One request is a batch of one.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Mapping

from ir import (
    BLOCK,
    PAGES,
    PAGES_PER_ROW,
    ROWS,
    TOKENS,
    GraphBuilder,
    Param,
    Program,
    eliminate_dead_values,
    fuse_add_rms_norm,
    verify,
)
from ir.contract import ATTENTION_ENTRIES, hidden_entry
from ir.ops import SEQUENCE_INPUTS

from .config import MAX_LAYERS, ConfigReader
from .layers import linear, lm_head, swiglu_mlp
from .quantization import AwqQuantization, check_groups, make_params, read_quantization
from .rope import inv_freq, read_rope

PARAM_DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class DecoderConfig:
    """The hyper-parameters the decoder IR needs, validated."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_inv_freq: tuple[float, ...]
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    dtype: str
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    quantization: AwqQuantization | None
    """How the checkpoint stores its projections: None for float weights."""


def read_decoder_config(cfg: ConfigReader, model_type: str, *, qkv_bias: bool, tie_default: bool) -> DecoderConfig:
    """Validate the fields a Llama-style decoder uses and derive the rest (head_dim, rope)."""
    fields = decoder_fields(cfg, tie_default)
    if cfg.float("partial_rotary_factor", 1.0) != 1.0:
        raise cfg.error("partial_rotary_factor", "must be 1.0; Llama-style decoders rotate the whole head")
    theta, scaling = read_rope(cfg)
    config = DecoderConfig(model_type=model_type, qkv_bias=qkv_bias,
                           rope_inv_freq=tuple(inv_freq(cfg, fields["head_dim"], theta, scaling)), **fields)
    check_groups(config.quantization, checkpoint_shapes(config), cfg)
    return config


def decoder_fields(cfg: ConfigReader, tie_default: bool) -> dict:
    """The DecoderConfig fields every decoder shares (all but model_type, rope and biases), validated."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise cfg.error("hidden_act", f"is {act!r}; only 'silu' (SwiGLU) is supported")
    hidden = cfg.int("hidden_size")
    heads = cfg.int("num_attention_heads")
    kv_heads = cfg.int("num_key_value_heads", heads)
    if heads % kv_heads:
        raise cfg.error("num_key_value_heads", f"({kv_heads}) must divide num_attention_heads ({heads})")
    if "head_dim" in cfg.raw and cfg.raw["head_dim"] is not None:
        head_dim = cfg.int("head_dim")
    elif hidden % heads:
        raise cfg.error("hidden_size", f"({hidden}) is not a multiple of num_attention_heads ({heads}) and no head_dim is given")
    else:
        head_dim = hidden // heads
    if head_dim % 2:
        raise cfg.error("head_dim", f"must be even for rotary embeddings, got {head_dim}")
    dtype_field = "torch_dtype" if cfg.raw.get("torch_dtype") is not None else "dtype"  # transformers v5 writes "dtype"
    dtype = cfg.get(dtype_field, "float32")
    if dtype not in PARAM_DTYPES:
        raise cfg.error(dtype_field, f"is {dtype!r}; supported: {', '.join(PARAM_DTYPES)}")
    eos = cfg.token_ids("eos_token_id", [])
    bos = cfg.get("bos_token_id", None)
    if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int)):
        raise cfg.error("bos_token_id", f"must be an integer, got {bos!r}")
    return dict(
        vocab_size=cfg.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=cfg.int("intermediate_size"),
        num_hidden_layers=cfg.int("num_hidden_layers", maximum=MAX_LAYERS),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.float("rms_norm_eps", 1e-6),
        tie_word_embeddings=cfg.bool("tie_word_embeddings", tie_default),
        max_position_embeddings=cfg.int("max_position_embeddings", 2048),
        dtype=dtype,
        bos_token_id=bos,
        eos_token_ids=tuple(eos),
        quantization=read_quantization(cfg),
    )


def checkpoint_shapes(c: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Weight name -> shape, exactly as the Hugging Face model stores them unquantised (a quantised checkpoint
    stores some as their packed parts: models.quantization.stored_shapes)."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[p + f"self_attn.{name}_proj.weight"] = (rows, c.hidden_size)
            if c.qkv_bias:
                shapes[p + f"self_attn.{name}_proj.bias"] = (rows,)
        shapes[p + "self_attn.o_proj.weight"] = (c.hidden_size, q)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "mlp.gate_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.up_proj.weight"] = (c.intermediate_size, c.hidden_size)
        shapes[p + "mlp.down_proj.weight"] = (c.hidden_size, c.intermediate_size)
    shapes["model.norm.weight"] = (c.hidden_size,)
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    return shapes


def build_decoder_program(c: DecoderConfig, param_dtypes: Mapping[str, str] | None = None) -> Program:
    """The step graphs of the decoder (fused paged attention, and the legacy gather path); params in `param_dtypes`
    (default: the config's dtype)."""
    return assemble_program(c, make_params(checkpoint_shapes(c), param_dtypes or {}, c.dtype, c.quantization),
                            _step_entry)


def assemble_program(c: DecoderConfig, params: dict[str, Param], step_entry, others: dict | None = None) -> Program:
    """The verified program: `params` (the weight map), `step_entry` graphs (fused paged attention, and the legacy
    gather path; each with logits out and with the last hidden rows out), and any `others` entries (name -> graph)."""
    steps = [step_entry(c, params, gather, logits) for gather in (False, True) for logits in (True, False)]
    return verify(Program(c.model_type, params, {g.name: g for g in steps} | (others or {}), {"config": asdict(c)}))


def _step_entry(c: DecoderConfig, params: dict[str, Param], gather: bool, logits: bool):
    """One step over a paged KV arena: the new tokens of one or more sequences in one flat row list.

    Each token row says its sequence (`row_of`), position (`pos_of`) and KV slot (`slots`, page *
    block + offset, negative for padding); `block_table` maps each sequence's positions to pages;
    `last` picks each sequence's row whose logits are wanted. `gather` builds the legacy path, `logits=False` the
    variant without the vocabulary head (ir.contract.hidden_entry).
    """
    g = step_builder(params, gather, logits)
    step = step_inputs(g)
    kv = c.num_key_value_heads * c.head_dim
    arenas = [tuple(g.input(f"{kind}_pages.{i}", (PAGES, BLOCK, kv), "float32", f"{kind}_pages", i) for kind in ("k", "v"))
              for i in range(c.num_hidden_layers)]
    h = g.op("embedding", ["model.embed_tokens.weight", step["ids"]], "embed")
    for i, pages in enumerate(arenas):
        h = _layer(g, c, f"model.layers.{i}.", h, step["pos_of"], paged_attend(g, c, step, *pages, gather))
    h = g.op("rms_norm", [h, "model.norm.weight"], "final_norm", eps=c.rms_norm_eps)
    out = step_output(g, c, h, step, "model.embed_tokens", logits)
    return eliminate_dead_values(fuse_add_rms_norm(g.finish([out])))


def step_builder(params: dict[str, Param], gather: bool, logits: bool) -> GraphBuilder:
    """The builder of a step entry, compiled per token and row bucket: `step`, or the optional legacy attention
    path `step_gather` (built on request); with `logits=False`, their variant without the head (`step_hidden`)."""
    name = ATTENTION_ENTRIES["legacy" if gather else "fused"]
    return GraphBuilder(name if logits else hidden_entry(name), params, bucket_dims=(TOKENS, ROWS), optional=gather)


def step_inputs(g: GraphBuilder, sequences: bool = False) -> dict[str, str]:
    """The per-token and per-sequence inputs of a step (`sequences`: those recurrent ops need too)."""
    names = {name: g.input(name, (TOKENS,), "int32", role) for name, role in (
        ("ids", "token_ids"), ("pos_of", "token_positions"), ("row_of", "token_rows"), ("slots", "kv_slots"))}
    names["block_table"] = g.input("block_table", (ROWS, PAGES_PER_ROW), "int32", "block_table")
    names["last"] = g.input("last", (ROWS,), "int32", "last_tokens")
    if sequences:
        names["n"] = g.input("n", (1,), "int32", "token_count")
        names |= {name: g.input(name, (ROWS,), "int32", name) for name in SEQUENCE_INPUTS}
    return names


def paged_attend(g: GraphBuilder, c: DecoderConfig, step: dict[str, str], k_pages: str, v_pages: str, gather: bool):
    """attend(q, k, v, prefix) of a step: append k/v to the layer's pages, attend over each row's pages
    (fused), or over its history gathered from them into a padded tensor first (`gather`, the legacy path)."""
    def attend(q, k, v, p):
        k_all = g.op("paged_kv_append", [k_pages, k, step["slots"]], p + "k_pages")
        v_all = g.op("paged_kv_append", [v_pages, v, step["slots"]], p + "v_pages")
        if not gather:
            return g.op("paged_attention", [q, k_all, v_all, step["block_table"], step["row_of"], step["pos_of"]],
                        p + "attn", **attention_attrs(c))
        k_hist = g.op("gather_pages", [k_all, step["block_table"]], p + "k_history")
        v_hist = g.op("gather_pages", [v_all, step["block_table"]], p + "v_history")
        return g.op("padded_attention", [q, k_hist, v_hist, step["row_of"], step["pos_of"]], p + "attn",
                    **attention_attrs(c))
    return attend


def step_output(g: GraphBuilder, c: DecoderConfig, h: str, step: dict[str, str], embed: str, logits: bool) -> str:
    """A step's output: each sequence's last row of the normalised hidden states `h`, or (`logits`) the logits of
    that row (lm_head, or the tied embedding module)."""
    rows = g.op("take_rows", [h, step["last"]], "last_rows")
    return lm_head(g, rows, embed, c.tie_word_embeddings) if logits else rows


def attention_attrs(c: DecoderConfig) -> dict:
    """The attention op's attributes for this config."""
    return {"num_heads": c.num_attention_heads, "num_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "scale": c.head_dim ** -0.5}


def _layer(g: GraphBuilder, c: DecoderConfig, p: str, h: str, pos: str, attend) -> str:
    """One decoder layer; `attend(q, k, v, prefix)` stores k/v in the cache and attends over it."""
    x = g.op("rms_norm", [h, p + "input_layernorm.weight"], p + "attn_norm", eps=c.rms_norm_eps)
    qkv = [linear(g, x, f"{p}self_attn.{name}_proj", p + name, bias=c.qkv_bias) for name in ("q", "k", "v")]
    rope = {"head_dim": c.head_dim, "inv_freq": list(c.rope_inv_freq)}
    q = g.op("rope", [qkv[0], pos], p + "q_rot", **rope)
    k = g.op("rope", [qkv[1], pos], p + "k_rot", **rope)
    attn = attend(q, k, qkv[2], p)
    h = g.op("add", [h, linear(g, attn, p + "self_attn.o_proj", p + "attn_out")], p + "attn_res")
    x = g.op("rms_norm", [h, p + "post_attention_layernorm.weight"], p + "mlp_norm", eps=c.rms_norm_eps)
    return g.op("add", [h, swiglu_mlp(g, x, p + "mlp", p)], p + "mlp_res")
