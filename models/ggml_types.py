"""llama.cpp's tensor types (ggml) as GGUF files store them, and their decoding into float32 (numpy only).

A block type stores a row in blocks of 32 values (256 for the K-quants), each block its own scales. Decoding
follows llama.cpp's `dequantize_row_*` arithmetic (float32, in its order), so every value is the float llama.cpp
itself computes before its products.

Projections of every block type (INT_TYPES) are not decoded at all (`int4_part`): each type's values are integers u
with a scale and a zero point Z, W = (u - Z) * s (Q3_K, Q4_0, Q5_0, Q6_K, Q8_0; IQ4_NL and IQ4_XS, whose 4-bit
indices stand for 8-bit integers, IQ4_VALUES), or an offset, W = u * s + m (Q2_K, Q4_1, Q5_1, Q4_K, Q5_K), per group
of 32 (Q2_K, Q3_K, Q6_K: 16). Those are ir.packing's awq_int4 and affine_int4, exactly: a value of 2, 3 or 4 bits in
one 4-bit plane, of 5, 6 or 8 bits as two, u = 16 h + l. Their bits are repacked into the words the INT4 kernels
read and their scales (and offsets) laid out per group: float16s as they are, the K-quants' (and IQ4_XS's) as their
two levels (a block's float16 times a group's 4-, 6- or 8-bit integer, whose float32 product is llama.cpp's). Bits a
weight a decode step reads, ours (llama.cpp's): Q2_K 5.25 (2.6), Q3_K 4.9 (3.4), Q4_0 4.6 (4.5), Q4_1 5 (5), Q4_K
4.75 (4.5), Q5_0 8.8 (5.5), Q5_1 9 (6), Q5_K 8.75 (5.5), Q6_K 9.1 (6.6), Q8_0 8.8 (8.5), IQ4_NL 8.8 (4.5), IQ4_XS
8.6 (4.25); 16 decoded (a matrix no packing takes).
"""

from __future__ import annotations

import numpy as np

from ir.packing import AWQ_PACK, KQ_BLOCK, SCALE_BYTES

from .quantization import awq_pack

# ggml type id -> (name, values per block, bytes per block); names as llama.cpp spells them
RAW_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2)}
BLOCK_TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24),
               8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
               13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 20: ("IQ4_NL", 32, 18), 23: ("IQ4_XS", 256, 136)}
OTHER_TYPES = {15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 21: "IQ3_S", 22: "IQ2_S",
               24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M"}
SUPPORTED = ", ".join(name for name, _, _ in (*RAW_TYPES.values(), *BLOCK_TYPES.values()))
_BLOCK_BYTES = {name: size for name, _, size in BLOCK_TYPES.values()}
_BLOCK_VALUES = {name: values for name, values, _ in BLOCK_TYPES.values()}
INT_TYPES = {  # the types whose values are integers with a scale and a zero point or offset per group: the INT4
    # packing each takes (ir.packing: kind, group, planes, block) and the dtype its scales and offsets are held as
    # (the K-quants': two-level scales, int32 words)
    "Q4_0": ("awq_int4", 32, 1, 0, "F16"), "Q4_1": ("affine_int4", 32, 1, 0, "F16"),
    "Q4_K": ("affine_int4", 32, 1, KQ_BLOCK, "I32"), "Q5_0": ("awq_int4", 32, 2, 0, "F16"),
    "Q5_1": ("affine_int4", 32, 2, 0, "F16"), "Q5_K": ("affine_int4", 32, 2, KQ_BLOCK, "I32"),
    "Q6_K": ("awq_int4", 16, 2, KQ_BLOCK, "I32"), "Q8_0": ("awq_int4", 32, 2, 0, "F16"),
    "Q2_K": ("affine_int4", 16, 1, KQ_BLOCK, "I32"), "Q3_K": ("awq_int4", 16, 1, KQ_BLOCK, "I32"),
    "IQ4_NL": ("awq_int4", 32, 2, 0, "F16"), "IQ4_XS": ("awq_int4", 32, 2, KQ_BLOCK, "I32")}
IQ4_VALUES = (np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113]) + 128).astype(
    np.uint8)  # the integers IQ4_NL's and IQ4_XS's 4-bit indices stand for (llama.cpp's kvalues_iq4nl), + 128
ZERO_POINTS = {"Q3_K": 4, "Q4_0": 8, "Q5_0": 16, "Q6_K": 32, "Q8_0": 128, "IQ4_NL": 128, "IQ4_XS": 128}  # Z of the
# types whose W = (u - Z) * s; the others have float offsets
_TWO_BIT_SHIFTS = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
_BIT_SHIFTS = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 at byte `at` of each block, as float32 [blocks, 1]."""
    return blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [blocks, k] -> [blocks, 2k]: the low nibbles, then the high ones."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=1)


def _fifth_bits(blocks: np.ndarray, at: int) -> np.ndarray:
    """Q5_0 / Q5_1's 32 high bits (a little-endian word at byte `at`), as 0 or 16 per value."""
    bits = np.unpackbits(blocks[:, at:at + 4], axis=1, bitorder="little")
    return bits * np.uint8(16)


def _bit_planes(bits: np.ndarray) -> np.ndarray:
    """Q3_K / Q5_K's high bits: [blocks, 32] bytes -> [blocks, 256] (bit j of byte i: value 32 j + i), 0 or 1."""
    return ((bits[:, None, :] >> _BIT_SHIFTS) & 1).reshape(-1, 256)


def _two_bits(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K's 2-bit values: [blocks, 64] bytes -> [blocks, 256] (each 32 bytes give 4 x 32 values)."""
    return ((qs.reshape(-1, 2, 1, 32) >> _TWO_BIT_SHIFTS) & 3).reshape(-1, 256)


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit minimums of its 32-value sub-blocks."""
    scales = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mins = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k4_layout(qs: np.ndarray) -> np.ndarray:
    """Q4_K / Q5_K's nibbles [blocks, 128] -> [blocks, 256]: each 32 bytes give their low, then their high nibbles."""
    chunks = qs.reshape(-1, 4, 1, 32)
    return np.concatenate([chunks & 0xF, chunks >> 4], axis=2).reshape(-1, 256)


def _sub_blocks(values: np.ndarray, scale: np.ndarray, size: int) -> np.ndarray:
    """Each `size`-value run of `values` [blocks, n] times its scale [blocks, n / size]."""
    return (values.reshape(len(values), -1, size) * scale[:, :, None]).reshape(len(values), -1)


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes -> 16 six-bit signed scales (low nibbles from bytes 0-7, high bit pairs from bytes 8-11)."""
    low, high = s[:, 0:8], s[:, 8:12]
    packed = np.concatenate([low[:, 0:4] & 0xF, low[:, 4:8] & 0xF, low[:, 0:4] >> 4, low[:, 4:8] >> 4], axis=1)
    pairs = np.concatenate([(high >> shift) & 3 for shift in (0, 2, 4, 6)], axis=1)
    return (packed | (pairs << 4)).astype(np.float32) - 32


def _two_level(encoding: str, b: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], tuple | None]:
    """A two-level type's blocks [n, bytes] (the K-quants, IQ4_XS) -> its scales' two levels (d [n, 1] float32, c
    [n, groups] integers: the scale is d * c) and, Q2_K, Q4_K and Q5_K, its offsets' (-dmin and the minimums: the
    offset is -dmin * m), else None."""
    if encoding == "Q6_K":
        return (_half(b, 208), b[:, 192:208].view(np.int8).astype(np.float32)), None
    if encoding == "Q3_K":
        return (_half(b, 108), _q3_k_scales(b[:, 96:108])), None
    if encoding == "IQ4_XS":  # 6-bit scales: 4 low bits from bytes 4-7 (two a byte), 2 high from the word at 2
        low = np.stack([b[:, 4:8] & 0xF, b[:, 4:8] >> 4], axis=2).reshape(-1, 8)
        high = (b[:, 2:4].copy().view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
        return (_half(b, 0), (low | (high << 4)).astype(np.float32) - 32), None
    if encoding == "Q2_K":
        scales = b[:, 0:16]
        return (_half(b, 80), (scales & 0xF).astype(np.float32)), (-_half(b, 82), (scales >> 4).astype(np.float32))
    scales, mins = _k4_scales(b[:, 4:16])
    return (_half(b, 0), scales), (-_half(b, 2), mins)


def _values(encoding: str, b: np.ndarray) -> np.ndarray:
    """Blocks [n, bytes] of a type of INT_TYPES -> its unsigned integers u [n, values] (uint8)."""
    if encoding == "Q8_0":
        return b[:, 2:] ^ np.uint8(0x80)  # the int8 values + 128
    if encoding in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        nibbles = _nibbles(b[:, {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[encoding]:])
        return nibbles if encoding.startswith("Q4") else nibbles | _fifth_bits(b, 2 if encoding == "Q5_0" else 4)
    if encoding == "Q4_K":
        return _k4_layout(b[:, 16:144])
    if encoding == "Q5_K":
        return _k4_layout(b[:, 48:176]) | (_bit_planes(b[:, 16:48]) << 4)
    if encoding == "Q6_K":
        ql, qh = b[:, 0:128].reshape(-1, 2, 2, 32), b[:, 128:192].reshape(-1, 2, 1, 32)  # [n, half, 2, 32]
        low = np.concatenate([ql & 0xF, ql >> 4], axis=2)  # [n, half, 4, 32]
        return (low | (((qh >> _TWO_BIT_SHIFTS) & 3) << 4)).reshape(-1, 256)
    if encoding == "Q3_K":  # 2 low bits and a high one: u = 4 h + l
        return _two_bits(b[:, 32:96]) | (_bit_planes(b[:, 0:32]) << 2)
    if encoding == "Q2_K":
        return _two_bits(b[:, 16:80])
    if encoding == "IQ4_NL":
        return IQ4_VALUES[_nibbles(b[:, 2:])]
    if encoding == "IQ4_XS":  # each 32 values' 16 bytes as IQ4_NL's
        return IQ4_VALUES[_nibbles(b[:, 8:].reshape(-1, 16))].reshape(-1, 256)
    raise ValueError(f"no integers for {encoding}")


def _scales(encoding: str, b: np.ndarray) -> tuple[np.ndarray, np.ndarray | int]:
    """Blocks [n, bytes] of a type of INT_TYPES -> (s [n, groups] float32 scales, and the zero point: the integer
    Z of ZERO_POINTS, W = (u - Z) * s, or float32 offsets m [n, groups], W = u * s + m), in llama.cpp's
    arithmetic."""
    if INT_TYPES[encoding][3]:  # two-level
        (d, c), offsets = _two_level(encoding, b)
        return d * c, ZERO_POINTS[encoding] if offsets is None else offsets[0] * offsets[1]
    return _half(b, 0), ZERO_POINTS[encoding] if encoding in ZERO_POINTS else _half(b, 2)


def _decode(encoding: str, b: np.ndarray) -> np.ndarray:
    """Blocks [n, bytes] of `encoding` -> float32 [n, values]."""
    u, (scale, zero) = _values(encoding, b), _scales(encoding, b)
    size = u.shape[1] // scale.shape[1]
    if isinstance(zero, int):
        return _sub_blocks(u.astype(np.float32) - zero, scale, size)
    return _sub_blocks(u.astype(np.float32), scale, size) + np.repeat(zero, size, axis=1)


def dequantise(encoding: str, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 values of a tensor of `shape` stored as blocks of `encoding` (`raw`: its bytes, uint8)."""
    return _decode(encoding, np.ascontiguousarray(raw).reshape(-1, _BLOCK_BYTES[encoding])).reshape(shape)


def int4_part(encoding: str, raw: np.ndarray, shape: tuple[int, int], part: str, rope_rows: int = 0) -> np.ndarray:
    """Part `part` (qweight, qzeros or offsets, scales; of `shape`) of the INT4 packing of INT_TYPES[encoding] that
    holds the same values as a matrix stored as `encoding` blocks (`raw`: its bytes, uint8), the words as int32, the
    scales and offsets as float32 (exact; held as INT_TYPES says), a K-quant's as its two levels (ir.packing's
    two-level scales: the block's float16 and its groups' 4-, 6- or 8-bit integers); with `rope_rows`, its rows first
    put back in Hugging Face's order (`rope_rows_in_order`). A value of more than 4 bits is two planes, u = 16 h +
    l: h with the zero point Z // 16, l with Z % 16; the scale (and offset) are the value's, one for both
    (ir.packing)."""
    _, group, planes, block, _ = INT_TYPES[encoding]
    out = shape[1] * (AWQ_PACK if part in ("qweight", "qzeros") else 1)
    blocks = np.ascontiguousarray(raw).reshape(out, -1, _BLOCK_BYTES[encoding])
    inp = blocks.shape[1] * _BLOCK_VALUES[encoding]
    groups = inp // group
    if rope_rows:
        blocks = rope_rows_in_order(blocks, rope_rows)
    blocks = blocks.reshape(-1, _BLOCK_BYTES[encoding])
    if block and part in ("scales", "offsets"):
        return _two_level_words(_two_level(encoding, blocks)[part != "scales"], out)
    if part == "qweight":
        u = _values(encoding, blocks).reshape(out, groups, 1, group)
        planed = np.concatenate([u >> 4, u & 15], axis=2) if planes == 2 else u  # [out, group, plane, row]
        return awq_pack(planed.reshape(out, planes * inp).T)
    if part == "qzeros":
        zero = ZERO_POINTS[encoding]
        zeros = np.array([zero // 16, zero % 16] if planes == 2 else [zero], np.uint8)
        return awq_pack(np.broadcast_to(np.tile(zeros, groups)[:, None], (planes * groups, out)))
    return np.ascontiguousarray(_scales(encoding, blocks)[part != "scales"].reshape(out, groups).T)


def _two_level_words(levels: tuple[np.ndarray, np.ndarray], out: int) -> np.ndarray:
    """A K-quant's two levels (d [out * blocks, 1], c [out * blocks, groups]) -> the scales part of ir.packing's
    two-level scales, int32 [blocks * words, out]: each block's d as float32 bits, then its c as bytes."""
    d, c = levels
    blocks, groups = len(d) // out, c.shape[1]
    words = np.concatenate([d.astype(np.float32).view(np.int32), c.astype(np.int8).view(np.uint8).reshape(
        -1, groups // SCALE_BYTES, SCALE_BYTES).copy().view("<i4").reshape(-1, groups // SCALE_BYTES)], axis=1)
    return np.ascontiguousarray(words.reshape(out, blocks * (1 + groups // SCALE_BYTES)).T)


def rope_rows_in_order(array: np.ndarray, head_dim: int) -> np.ndarray:
    """q or k rows as llama.cpp's converter writes them for Llama (each head's two rotary halves interleaved), in
    Hugging Face's order (each head's first half, then its second)."""
    heads = array.shape[0] // head_dim
    return array.reshape(heads, head_dim // 2, 2, *array.shape[1:]).swapaxes(1, 2).reshape(array.shape)
