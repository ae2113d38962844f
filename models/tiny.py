"""Tiny random-weight Llama, Qwen2 and Qwen3.5 checkpoints in the exact Hugging Face layout, for tests.

`write_tiny_checkpoint` writes config.json, safetensors weights (single file or sharded with
an index; with `awq_group_size`, an AutoAWQ GEMM INT4 checkpoint packed by `awq_quantize`), a byte-level BPE tokenizer trained on a small embedded corpus (tokenizer.json,
tokenizer_config.json) and generation_config.json. Everything is deterministic in `seed`.
Weights are scaled so that logits have a clear top-1 margin, which keeps greedy decoding
comparable token by token across implementations.

Qwen3.5 comes in both of its config forms: `qwen3_5_text` (a text-only checkpoint) and `qwen3_5` (the
image-text checkpoint's config with a `text_config`; weights under `model.language_model.`); with
`vision=True` the `qwen3_5` form also holds a tiny vision tower (`vision_config`, `model.visual.*`) and a
preprocessor_config.json.

CLI: python -m models.tiny OUT_DIR [--arch qwen2|llama|qwen3_5_text|qwen3_5] [--seed N] [--dtype D] [--shards N]
     [--awq-group-size G] [--vision] [--overwrite]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from ir.errors import add_debug_flag, exit_cli
from models import checkpoint_tensor_shapes
from models.pretokenize import LLAMA3_SPLIT, QWEN2_SPLIT
from models.quantization import AwqQuantization, awq_config, awq_pack

ARCHS = ("qwen2", "llama", "qwen3_5_text", "qwen3_5")
QWEN35_ARCHS = ("qwen3_5_text", "qwen3_5")
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

_QWEN2_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_QWEN35_SPECIALS = _QWEN2_SPECIALS + ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_LLAMA_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

# The chat template of Qwen2.5-Instruct, verbatim.
_QWEN2_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# The chat template of Meta-Llama-3-8B-Instruct, verbatim.
_LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Training text for the BPE tokenizer: varied English prose, code, digits and punctuation.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs!
On a cold morning in early March, the harbour was quiet except for the gulls. Fishermen mended
their nets, and a small boat named "Aurora" drifted slowly past the lighthouse at 6:45 a.m.
Nobody knew where it had come from, or who had left the lantern burning at its bow.

Mathematics is the language of patterns: 1 + 1 = 2, 3 * 4 = 12, and 2^10 = 1024. The number pi
is approximately 3.14159, while e is about 2.71828. In 1969, humans first walked on the Moon;
by 2024, more than 500 people had travelled to space. Prices rose 7.5% last year (from $19.99
to $21.49), and the report listed items #17, #42 and #108 as "out of stock".

Dear Sam, thank you for your letter of 12/05. I'm glad the garden is doing well - the tomatoes,
beans and sunflowers sound wonderful. We'll visit in June, if the weather allows. Don't forget
to water the roses; they've never liked the heat. Best wishes, Alex.

def greet(name: str) -> str:
    return f"Hello, {name}!"

for i in range(10):
    print(i, i ** 2, [x for x in range(i) if x % 2 == 0])

Questions to consider: What is a model? How does a compiler turn a graph into fast code? Why do
caches, tiles and vectors matter? Answers vary, but the ideas are simple - reuse data, avoid
waste, and measure everything. "Premature optimization is the root of all evil," said Knuth.

Weather report: Monday, sunny, 21C; Tuesday, light rain, 17C; Wednesday, wind from the north-west
at 35 km/h. Train 4512 departs at 08:15 from platform 9 and arrives at 11:02. Call 555-0199 or
write to info@example.com for tickets. Remember: A, B, C... X, Y, Z; 0, 1, 2, 3, 4, 5, 6, 7, 8, 9.

She said, 'It's not about the destination; it's about the journey.' He laughed and replied that
he'd rather just arrive. They walked on through the forest, past old oak trees and mossy stones,
until the path opened onto a wide, green valley where sheep grazed beside a silver river.
"""

_MAX_SHARDS = 99999  # shard file names have five digits
EMBED_STD = 0.1  # std of embeddings and lm_head; see random_weights


def _qwen_family(arch: str) -> bool:
    """Qwen2 and Qwen3.5 share the ChatML specials, the tokenizer rules and the chat template."""
    return arch == "qwen2" or arch in QWEN35_ARCHS


def _specials(arch: str) -> tuple[str, ...]:
    if arch in QWEN35_ARCHS:
        return _QWEN35_SPECIALS
    return _QWEN2_SPECIALS if _qwen_family(arch) else _LLAMA_SPECIALS


def special_token_ids(arch: str, vocab_size: int) -> dict[str, int]:
    """Special token -> id; as in the real checkpoints, the special tokens follow the BPE vocab."""
    specials = _specials(arch)
    return {token: vocab_size - len(specials) + i for i, token in enumerate(specials)}


def build_tokenizer(arch: str, vocab_size: int) -> Tokenizer:
    """A deterministic byte-level BPE tokenizer for `arch` with exactly `vocab_size` tokens."""
    specials = _specials(arch)
    bpe_size = vocab_size - len(specials)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if bpe_size < len(alphabet):
        raise ValueError(f"vocab_size must be >= {len(alphabet) + len(specials)} for {arch} (256 bytes + specials)")
    qwen2 = _qwen_family(arch)
    tokenizer = Tokenizer(models.BPE(fuse_unk=False, byte_fallback=False, ignore_merges=not qwen2))
    if qwen2:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT if qwen2 else LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=not qwen2, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=bpe_size, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    if tokenizer.get_vocab_size() != bpe_size:
        raise ValueError(
            f"vocab_size {vocab_size} is too large for the embedded corpus; at most "
            f"{tokenizer.get_vocab_size() + len(specials)} is supported"
        )
    tokenizer.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    assert {s: tokenizer.token_to_id(s) for s in specials} == special_token_ids(arch, vocab_size)
    tokenizer.decoder = decoders.ByteLevel()
    if qwen2:
        tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    else:
        bos = specials[0]
        tokenizer.post_processor = processors.Sequence(
            [
                processors.ByteLevel(add_prefix_space=True, trim_offsets=False, use_regex=True),
                processors.TemplateProcessing(
                    single=f"{bos}:0 $A:0",
                    pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                    special_tokens=[(bos, tokenizer.token_to_id(bos))],
                ),
            ]
        )
    return tokenizer


def tiny_config(
    arch: str = "qwen2",
    *,
    dtype: str = "float32",
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 320,
    head_dim: int | None = None,
    tie_word_embeddings: bool | None = None,
    rope_theta: float = 10000.0,
    rope_scaling: dict | None = None,
    max_position_embeddings: int = 2048,
    rms_norm_eps: float = 1e-6,
    **qwen35_options,
) -> dict:
    """The config.json dict of a tiny `arch` model, laid out as the Hugging Face checkpoints have it.

    Qwen3.5 also takes the options of `qwen35_text_fields` (layer_types, linear-attention shapes...); the `qwen3_5`
    form takes `vision=True` (a tiny vision tower: TINY_VISION).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if qwen35_options and arch not in QWEN35_ARCHS:
        raise ValueError(f"options {sorted(qwen35_options)} only apply to Qwen3.5")
    vision = qwen35_options.pop("vision", False)
    if vision and arch != "qwen3_5":
        raise ValueError("vision=True needs arch qwen3_5 (the image-text checkpoint form)")
    ids = special_token_ids(arch, vocab_size)
    if arch in QWEN35_ARCHS:
        text = {"model_type": "qwen3_5_text", "dtype": dtype, "hidden_act": "silu", "hidden_size": hidden_size,
                "intermediate_size": intermediate_size, "num_hidden_layers": num_hidden_layers,
                "num_attention_heads": num_attention_heads, "num_key_value_heads": num_key_value_heads,
                "head_dim": head_dim or hidden_size // num_attention_heads, "vocab_size": vocab_size,
                "max_position_embeddings": max_position_embeddings, "rms_norm_eps": rms_norm_eps,
                "tie_word_embeddings": bool(tie_word_embeddings), "attention_bias": False, "attention_dropout": 0.0,
                "eos_token_id": ids["<|im_end|>"], "bos_token_id": None, "use_cache": True,
                **qwen35_text_fields(num_hidden_layers, rope_theta, **qwen35_options)}
        config = qwen35_config(arch, dict(sorted(text.items())))
        return config | ({"vision_config": TINY_VISION | {"out_hidden_size": hidden_size}} if vision else {})
    config = {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": arch,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "tie_word_embeddings": (arch == "qwen2") if tie_word_embeddings is None else tie_word_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if arch == "qwen2":
        config |= {
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "use_sliding_window": False,
            "sliding_window": max_position_embeddings,
            "max_window_layers": num_hidden_layers,
        }
    else:
        config |= {
            "bos_token_id": ids["<|begin_of_text|>"],
            "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]],
            "attention_bias": False,
            "mlp_bias": False,
            "pretraining_tp": 1,
        }
    return dict(sorted(config.items()))


def qwen35_text_fields(layers: int, rope_theta: float, *, layer_types: list[str] | None = None,
                       linear_num_key_heads: int = 2, linear_num_value_heads: int = 4, linear_key_head_dim: int = 16,
                       linear_value_head_dim: int = 16, linear_conv_kernel_dim: int = 4,
                       partial_rotary_factor: float = 0.25) -> dict:
    """The Qwen3.5-only text config fields; layers alternate linear and full attention by default."""
    return {
        "layer_types": layer_types or ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "linear_num_key_heads": linear_num_key_heads, "linear_num_value_heads": linear_num_value_heads,
        "linear_key_head_dim": linear_key_head_dim, "linear_value_head_dim": linear_value_head_dim,
        "linear_conv_kernel_dim": linear_conv_kernel_dim,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta, "partial_rotary_factor": partial_rotary_factor,
                            "mrope_interleaved": True, "mrope_section": [11, 11, 10]},
    }


TINY_VISION = {"model_type": "qwen3_5_vision", "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
               "in_channels": 3, "patch_size": 8, "temporal_patch_size": 2, "spatial_merge_size": 2,
               "num_position_embeddings": 16, "hidden_act": "gelu_pytorch_tanh", "initializer_range": 0.02}
"""A tiny vision tower (out_hidden_size: the text model's hidden size); patches of 8 pixels, 2x2 merged."""
TINY_PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "do_rescale": True,
                     "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
                     "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True, "patch_size": 8, "temporal_patch_size": 2,
                     "merge_size": 2, "size": {"shortest_edge": 16 * 16 * 4, "longest_edge": 16 * 16 * 64}}
"""Its preprocessing: images resized to 4..64 merged tokens (blocks of 16 x 16 pixels)."""


def qwen35_config(arch: str, text: dict) -> dict:
    """A text config as the text-only checkpoint has it, or wrapped as the image-text checkpoint's."""
    if arch == "qwen3_5_text":
        return {"architectures": ["Qwen3_5ForCausalLM"], **text}
    ids = special_token_ids(arch, text["vocab_size"])
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
            "tie_word_embeddings": text["tie_word_embeddings"], "image_token_id": ids["<|image_pad|>"],
            "video_token_id": ids["<|video_pad|>"], "vision_start_token_id": ids["<|vision_start|>"],
            "vision_end_token_id": ids["<|vision_end|>"]}


def random_weights(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors for every checkpoint tensor of `config`, in its dtype, deterministic in `seed`.

    Each tensor draws from its own generator seeded by (seed, name), so its values do not depend on
    which other tensors exist. Linear weights ~ N(0, 1/fan_in), biases ~ 0.1 N(0, 1), layer norm
    weights ~ 1 + 0.1 N(0, 1). Embeddings and lm_head ~ N(0, EMBED_STD^2) keep a token's own
    embedding from dominating the residual stream (with tied embeddings it would make greedy
    decoding repeat the input token); the final norm is scaled by 1 / EMBED_STD so that logits
    still have a standard deviation of about sqrt(hidden_size) and a clear top-1 margin.
    """
    text = config.get("text_config", config)
    dtype = DTYPES[text.get("torch_dtype") or text["dtype"]]
    offset = 1.0 if "layer_types" in text else 0.0  # Qwen3.5 stores its RMSNorm scales as (scale - 1)
    weights = {}
    for name, shape in checkpoint_tensor_shapes(config).items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        x = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            x = x * EMBED_STD
        elif name.endswith("model.norm.weight") or name.endswith("language_model.norm.weight"):
            x = (1.0 + 0.1 * x) / EMBED_STD - offset
        elif name.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight")):
            x = 1.0 + 0.1 * x - offset
        elif name.endswith("linear_attn.norm.weight"):
            x = 1.0 + 0.1 * x
        elif name.endswith(".bias"):
            x = 0.1 * x
        elif name.endswith(("norm1.weight", "norm2.weight", "merger.norm.weight")):
            x = 1.0 + 0.1 * x
        elif name.endswith(("qkv.weight", "attn.proj.weight", "linear_fc1.weight", "linear_fc2.weight",
                            "patch_embed.proj.weight")):
            x = x / np.sqrt(np.prod(shape[1:]), dtype=np.float32)
        elif name.endswith("pos_embed.weight"):
            x = 0.5 * x
        elif name.endswith(("_proj.weight", "_proj_qkv.weight", "_proj_z.weight", "_proj_a.weight", "_proj_b.weight")):
            x = x / np.sqrt(shape[1], dtype=np.float32)
        elif name.endswith("conv1d.weight"):
            x = x / np.sqrt(shape[-1], dtype=np.float32)
        elif name.endswith("dt_bias"):
            x = 1.0 + 0.1 * x
        elif name.endswith("A_log"):  # the decay rates A in [0.5, 4); kept float32 as in the real checkpoints
            weights[name] = np.log(rng.uniform(0.5, 4.0, shape)).astype(np.float32)
            continue
        else:
            raise ValueError(f"no initialisation rule for checkpoint tensor {name!r}")
        weights[name] = x.astype(dtype)
    return weights


def awq_quantize(weight: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(qweight, qzeros, scales) of a float [out, in] matrix quantised to 4 bits as AutoAWQ GEMM stores it: per
    group of `group` input rows (-1: all) and output column, scale = (max - min) / 15 and an integer zero point
    (round(-min / scale)); values round(w / scale) + zero in 0..15; eight to an int32 word in AWQ_ORDER."""
    out, inp = weight.shape
    group = inp if group == -1 else group
    w = weight.astype(np.float32).T.reshape(inp // group, group, out)  # [groups, rows of a group, out]
    low, high = np.minimum(w.min(axis=1), 0.0), np.maximum(w.max(axis=1), 0.0)
    scales = np.maximum(high - low, 1e-6) / 15.0
    scales = scales.astype(np.float16).astype(np.float32)  # the stored scale is what dequantises
    zeros = np.clip(np.round(-low / scales), 0, 15)
    q = np.clip(np.round(w / scales[:, None]) + zeros[:, None], 0, 15).reshape(inp, out)
    return awq_pack(q), awq_pack(zeros), scales.astype(np.float16)


def awq_checkpoint(config: dict, weights: dict[str, np.ndarray], group: int,
                   modules_to_not_convert: tuple[str, ...] = ()) -> tuple[dict, dict[str, np.ndarray]]:
    """The config and weights of a float checkpoint quantised as AutoAWQ GEMM INT4 with this group size (the
    projections packed, the rest kept), with the quantization_config transformers writes."""
    quant = AwqQuantization(group, tuple(modules_to_not_convert))
    config = dict(config, quantization_config=awq_config(group, tuple(modules_to_not_convert)))
    packed = {}
    for name, w in weights.items():
        packing = quant.packing(name, w.shape[1]) if w.ndim == 2 else None
        if packing is None:
            packed[name] = w
            continue
        module = name.removesuffix(".weight")
        packed |= {f"{module}.{part}": array for part, array in zip(packing.part_names, awq_quantize(w, group))}
    return config, packed


def _shard_of_each(sizes: list[int], shards: int) -> list[int]:
    """Shard index per tensor: contiguous, non-empty, roughly byte-balanced groups."""
    total, count, shard, before, out = sum(sizes), len(sizes), 0, 0, []
    for i, size in enumerate(sizes):
        by_bytes = before * shards // total
        shard = min(max(shard, by_bytes, shards - (count - i)), shard + 1)
        out.append(shard)
        before += size
    return out


def save_weights(weights: dict[str, np.ndarray], out_dir: Path, shards: int = 1) -> None:
    """Write `weights` as model.safetensors, or as `shards` files plus model.safetensors.index.json."""
    if not 1 <= shards <= min(len(weights), _MAX_SHARDS):
        raise ValueError(f"shards must be between 1 and {min(len(weights), _MAX_SHARDS)}, got {shards}")
    metadata = {"format": "pt"}
    if shards == 1:
        save_file(weights, str(out_dir / "model.safetensors"), metadata=metadata)
        return
    names = list(weights)
    assignment = _shard_of_each([weights[n].nbytes for n in names], shards)
    files = [f"model-{k + 1:05d}-of-{shards:05d}.safetensors" for k in range(shards)]
    for k, file in enumerate(files):
        save_file({n: weights[n] for n, s in zip(names, assignment) if s == k}, str(out_dir / file), metadata=metadata)
    index = {
        "metadata": {
            "total_parameters": sum(w.size for w in weights.values()),
            "total_size": sum(w.nbytes for w in weights.values()),
        },
        "weight_map": {n: files[s] for n, s in sorted(zip(names, assignment))},
    }
    _write_json(out_dir / "model.safetensors.index.json", index)


def tokenizer_config(arch: str, vocab_size: int, model_max_length: int) -> dict:
    """The tokenizer_config.json dict that goes with `build_tokenizer(arch, vocab_size)`."""
    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
    specials = special_token_ids(arch, vocab_size)
    common = {
        "added_tokens_decoder": {str(i): {"content": s, **flags} for s, i in specials.items()},
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": model_max_length,
    }
    if _qwen_family(arch):
        return common | {
            "add_bos_token": False,
            "add_prefix_space": False,
            "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
            "bos_token": None,
            "chat_template": _QWEN2_CHAT_TEMPLATE,
            "eos_token": "<|im_end|>",
            "errors": "replace",
            "pad_token": "<|endoftext|>",
            "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer",
            "unk_token": None,
        }
    return common | {
        "bos_token": "<|begin_of_text|>",
        "chat_template": _LLAMA3_CHAT_TEMPLATE,
        "eos_token": "<|eot_id|>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def generation_config(config: dict) -> dict:
    """The generation_config.json dict: the arch's bos/eos/pad ids, greedy by default."""
    text = config.get("text_config", config)
    ids = special_token_ids(config["model_type"], text["vocab_size"])
    if _qwen_family(config["model_type"]):
        endoftext = ids["<|endoftext|>"]
        return {"bos_token_id": endoftext, "eos_token_id": [ids["<|im_end|>"], endoftext], "pad_token_id": endoftext}
    return {"bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]]}


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def write_tiny_checkpoint(
    out_dir: str | Path,
    *,
    arch: str = "qwen2",
    seed: int = 0,
    shards: int = 1,
    overwrite: bool = False,
    awq_group_size: int | None = None,
    modules_to_not_convert: tuple[str, ...] = (),
    **config_options,
) -> Path:
    """Write a tiny random `arch` checkpoint (config as `tiny_config` takes it, weights, tokenizer) to `out_dir`
    atomically; with `awq_group_size`, its projections quantised to AutoAWQ GEMM INT4 (`awq_checkpoint`)."""
    out = Path(out_dir).resolve()
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out}: directory exists and is not empty; pass overwrite=True (--overwrite) to replace it")
    config = tiny_config(arch, **config_options)
    vocab_size = config.get("text_config", config)["vocab_size"]
    tokenizer = build_tokenizer(arch, vocab_size)
    weights = random_weights(config, seed)
    if awq_group_size is not None:
        config, weights = awq_checkpoint(config, weights, awq_group_size, modules_to_not_convert)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        staging.chmod(0o755)
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", generation_config(config))
        save_weights(weights, staging, shards)
        tokenizer.save(str(staging / "tokenizer.json"))
        max_positions = config.get("text_config", config)["max_position_embeddings"]
        _write_json(staging / "tokenizer_config.json", tokenizer_config(arch, vocab_size, max_positions))
        if "vision_config" in config:
            _write_json(staging / "preprocessor_config.json", TINY_PREPROCESSOR)
        _replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


def _replace_dir(new: Path, target: Path) -> None:
    """Rename `new` to `target`, removing whatever directory was at `target`."""
    if not target.exists():
        new.rename(target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    target.rename(old / target.name)
    new.rename(target)
    shutil.rmtree(old)


def main(argv: list[str] | None = None) -> None:
    """Command line: write a tiny checkpoint and print its path."""
    parser = argparse.ArgumentParser(prog="python -m models.tiny", description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory to create (must be absent or empty)")
    parser.add_argument("--arch", choices=ARCHS, default="qwen2")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    parser.add_argument("--shards", type=int, default=1, help="number of safetensors files (default 1)")
    parser.add_argument("--awq-group-size", type=int, default=None,
                        help="quantise the projections to AutoAWQ GEMM INT4 with this group size (-1: one group)")
    parser.add_argument("--vision", action="store_true", help="with --arch qwen3_5: a vision tower too (image input)")
    parser.add_argument("--overwrite", action="store_true", help="replace out_dir if it exists")
    add_debug_flag(parser)
    args = parser.parse_args(argv)
    try:
        path = write_tiny_checkpoint(
            args.out_dir, arch=args.arch, seed=args.seed, dtype=args.dtype, shards=args.shards,
            overwrite=args.overwrite, awq_group_size=args.awq_group_size,
            **({"vision": True} if args.vision else {}))
    except ValueError as e:
        parser.error(str(e))
    print(path)


if __name__ == "__main__":
    exit_cli(lambda argv: main(argv) or 0)
