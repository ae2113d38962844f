"""Packed weight formats: a param whose type has a `Packing` holds its logical [out, in] matrix as several tensors
(its parts), made from the quantised checkpoint's tensors by the packing's weight-map transform; kernels read the
parts and unpack in registers. A packed weight is never held dequantised.

awq_int4 (AutoAWQ's GEMM layout, also read by transformers): 4-bit values, eight to an int32 word along the
output columns, with a zero point and a scale per group of `group` input rows and output column:
    qweight int32 [in, out / 8], qzeros int32 [in / group, out / 8], scales [in / group, out] (the logical dtype)
Nibble slot i (bits 4i..4i+3) of word c holds column 8c + AWQ_ORDER[i]; W[o, i] = (q - z) * s.
The words are the checkpoint's, bit for bit, but qweight is regrouped once at load into column tiles of
`awq_tile_words` words (a 64-byte cache line), each tile's rows contiguous: [words / tile, in, tile]. A kernel that
owns a tile then streams one contiguous block instead of a 64-byte strip every out / 2 bytes (which ran at a
third of the memory bandwidth on a 5632-column matrix). The cost is one pass over the packed words at load.
GPU kernels read this layout.

awq_int4_pairs (what CPU kernels read; a build for a CPU stores every awq_int4 weight so, `CPU_PACKINGS`): the
same 4-bit values and the same number of bytes, regrouped once at load so that a word holds two input rows of
four columns. The low 16 bits of an AWQ word hold its even columns (8c, 8c + 2, 8c + 4, 8c + 6 in nibbles 0..3),
the high 16 bits its odd ones; word j of row pair p of column tile t holds half j % 2 of AWQ word c = t * tile / 2
+ j // 2 of row 2p in its low 16 bits and the same half of row 2p + 1 in its high 16 bits, so its nibble n holds
column 8c + 2n + j % 2 of both rows (a 16-bit interleave of the checkpoint's words, a copy at load):
    qweight int32 [out / (4 tile), in / 2, tile], qzeros int32 [out / (4 tile), ceil(in / group / 2), tile]
(qzeros the same way, its groups as the rows); scales [out / (4 tile), in / group, 4 tile]: a tile's scales
together, group after group, each group's 4 * tile columns in the order (nibble, word) (`pair_index`), so the scales
of one nibble of a vector of words are neighbours and a kernel streaming a tile reads its scales in order too
(scales read group by group across all [in / group, out] columns, a jump of 2 * out bytes each, cost the
5632-column product 15% of its speed from memory).
Shifting a vector of words right by 4n and masking it with 0x000F000F gives a vector of 16-bit pairs (row 2p,
row 2p + 1): the operand of the integer pair dot products (pmaddwd, vpdpwssd) with a pair of activations
(schedules.cpu_awq). Groups are even, so a pair never straddles two.

affine_int4, affine_int4_pairs (a GGUF file's Q4_1 and Q4_K projections, models.ggml_types): the same words in the
same layouts, but W[o, i] = q * s + m, with a float offset m per group and output column in place of the zero point
(q4_1: d and m; Q4_K: each 32-row sub-block's d * scale and -dmin * min). The offsets are a part shaped and laid out
as the scales (`offsets`, in place of qzeros):
    qweight int32 [in, out / 8], offsets [in / group, out], scales [in / group, out]       (affine_int4)
    qweight int32 [out / (4 tile), in / 2, tile], offsets and scales [out / (4 tile), in / group, 4 tile]  (_pairs)
Over a group, sum x * (q * s + m) = s * sum x * q + m * sum x: the kernels' integer sums are the same.

Planes (`Packing.planes` = 2; a GGUF file's 5-, 6- and 8-bit blocks): a wider value is the sum of two 4-bit planes,
q = 16 h + l, so W[o, i] = (h - z_h) * 16 s + (l - z_l) * s, or (16 h + l) * s + m, exactly; each plane is one more
group of packed rows, group after group: packed group g * planes + p holds plane p of the logical group g (the high
plane first). The packed matrix has planes * in rows, and a kernel reads x[i] for each of its planes' rows
(`logical_row`); the words and zero points are those of a plain 4-bit weight, a zero point per plane (Z // 16 for
the high one, Z % 16 for the low one), but the scales and offsets are the logical groups', one of each for both
planes (the high plane's scale is 16 s, its offset none), half the bytes of a scale (and offset) per plane. A
kernel sums the planes' rows one at a time (schedules.written.group_product scales each) or unpacks 16 h + l as one
value (schedules.avx512_bf16.dpbf16_awq_gemm).

Two-level scales (`Packing.block` = KQ_BLOCK; a GGUF file's K-quants, Q4_K, Q5_K, Q6_K): a group's scale is a
block's float times the group's 8-bit integer, d * c, as the file keeps it (exact in float32: d is a float16, c
has 8 bits), and so is an affine kind's offset. The scales (and offsets) part is then int32 words, per block of
KQ_BLOCK input rows and column: the float32 d as its bits, then the block's groups' c as signed bytes, four a word,
group g of a block in byte g % 4 of word 1 + g // 4 (`block_scale_rows`):
    scales int32 [in / KQ_BLOCK * (1 + KQ_BLOCK / group / 4), out], laid out in the pairs layout like any scales.
A weight of 4-bit values and groups of 32 then reads 4.75 bits a weight, not 6; Q6_K's two planes 9.1, not 10.5.
"""

from __future__ import annotations

from dataclasses import dataclass

PACKINGS = {"awq_int4": "awq_tiles", "awq_int4_pairs": "awq_pairs", "affine_int4": "awq_tiles",
            "affine_int4_pairs": "affine_pairs"}  # packing kind -> the weight-map transform (ir.graph.WEIGHT_TRANSFORMS)
# that makes it
CPU_PACKINGS = {"awq_int4": "awq_int4_pairs", "affine_int4": "affine_int4_pairs"}  # how a build for a CPU stores a
# packed weight of each kind
AWQ_PACK = 8  # 4-bit values per int32 word
AWQ_TILE_WORDS = 16  # words of qweight per column tile: a 64-byte cache line
PAIR_SLOTS = 4  # columns per word of the pairs layout (each in two rows)
KQ_BLOCK = 256  # input rows of a block of two-level scales (llama.cpp's K-quant super-block)
SCALE_BYTES = 4  # a block's groups' integer scales per word


def awq_column(slot):
    """The column within its word (0..7) that nibble `slot` holds: AWQ_ORDER[slot], as arithmetic that also serves
    on TensorIR expressions."""
    return slot % 4 * 2 + slot // 4


def awq_slot(column):
    """The nibble slot of a word that holds its column `column` (0..7): the inverse of `awq_column`."""
    return column % 2 * 4 + column // 2


AWQ_ORDER = tuple(awq_column(slot) for slot in range(AWQ_PACK))  # (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class Packing:
    """How a weight matrix is packed: a kind from PACKINGS, its group (input rows per scale and zero point), its
    planes, and its block (KQ_BLOCK: two-level scales; 0: a float scale per group)."""

    kind: str
    group: int
    planes: int = 1
    block: int = 0

    def __str__(self) -> str:
        return (f"{self.kind}(g{self.group}{f',x{self.planes}' if self.planes > 1 else ''}"
                f"{f',b{self.block}' if self.block else ''})")

    def problem(self, shape: tuple) -> str | None:
        """Why a logical [out, in] matrix of `shape` cannot be packed this way, or None."""
        if self.kind not in PACKINGS:
            return f"unknown packing {self.kind!r} (known: {', '.join(PACKINGS)})"
        if len(shape) != 2 or not all(isinstance(d, int) for d in shape):
            return f"a packed weight must be a matrix of fixed size, got {list(shape)}"
        out, inp = shape
        if out % AWQ_PACK:
            return f"{out} output columns are not a multiple of the {AWQ_PACK} a packed word holds"
        if not isinstance(self.group, int) or self.group <= 0 or inp % self.group:
            return f"group {self.group!r} does not divide the {inp} input rows"
        if self.group % 2:
            return f"group {self.group} is odd; the kernels read input rows in pairs, so groups must be even"
        if self.planes not in (1, 2):
            return f"{self.planes!r} planes; a packed weight has one (4-bit values) or two (up to 8 bits)"
        if self.block not in (0, KQ_BLOCK):
            return f"block {self.block!r}; two-level scales come in blocks of {KQ_BLOCK} rows, else 0 (none)"
        if self.block and (self.block % (self.group * SCALE_BYTES) or inp % self.block):
            return (f"blocks of {self.block} rows must hold a multiple of {SCALE_BYTES} groups of {self.group} and "
                    f"divide the {inp} input rows")
        return None

    @property
    def transform(self) -> str:
        """The weight-map transform that makes the parts from the checkpoint's tensors."""
        return PACKINGS[self.kind]

    @property
    def affine(self) -> bool:
        """Whether values are q * s + m (float offsets) rather than AWQ's (q - z) * s (4-bit zero points)."""
        return self.kind.startswith("affine")

    @property
    def paired(self) -> bool:
        """Whether the words are in the pairs layout (what CPU kernels read)."""
        return self.kind.endswith("_pairs")

    @property
    def part_names(self) -> tuple[str, str, str]:
        """The names of the parts, in order (the checkpoint's tensors are `module.<name>`)."""
        return ("qweight", "offsets" if self.affine else "qzeros", "scales")

    def checkpoint_parts(self, shape: tuple[int, int], dtype: str) -> tuple[tuple[tuple[int, ...], str], ...]:
        """(shape, dtype) of each checkpoint tensor of a logical [out, in] matrix of `dtype` (`part_names`): qweight
        and qzeros of its planes * in packed rows, offsets and scales of its in rows."""
        (out, inp), rows = shape, shape[1] * self.planes
        scales = ((inp // self.block * block_words(self.group), out), "int32") if self.block else (
            (inp // self.group, out), dtype)
        zeros = scales if self.affine else ((rows // self.group, out // AWQ_PACK), "int32")
        return (((rows, out // AWQ_PACK), "int32"), zeros, scales)

    def parts(self, shape: tuple[int, int], dtype: str) -> tuple[tuple[tuple[int, ...], str], ...]:
        """(shape, dtype) of each part kernels take, in order: qweight, qzeros or offsets (both in the kind's layout),
        scales."""
        ((rows, words), _), zeros, scales = self.checkpoint_parts(shape, dtype)
        if self.paired:
            tile = pair_tile_words(shape[0])
            tiles = shape[0] // (PAIR_SLOTS * tile)
            laid = ((tiles, scales[0][0], PAIR_SLOTS * tile), scales[1])
            return (((tiles, rows // 2, tile), "int32"), laid if self.affine else ((tiles, -(-zeros[0][0] // 2), tile),
                                                                                     "int32"), laid)
        tile = awq_tile_words(words)
        return (((words // tile, rows, tile), "int32"), zeros, scales)


def block_words(group: int) -> int:
    """Words of two-level scales per block and column for groups of `group` rows: the float, then the integers."""
    return 1 + KQ_BLOCK // group // SCALE_BYTES


def block_scale_rows(g, group: int):
    """Where the two-level scale of group g (of `group` rows) lies in its scales part: (the row of its block's
    float, the row of the word of its integer, the bit shift of its byte); plain arithmetic, as `pair_position`."""
    first = g * group // KQ_BLOCK * block_words(group)
    return first, first + 1 + g % (KQ_BLOCK // group) // SCALE_BYTES, g % SCALE_BYTES * 8


def two_level(part, scales=None) -> bool:
    """Whether a packed weight's part (its scales, or, given its `scales`, its zero points or offsets; buffers or
    arrays: dtype and shape) holds two-level scales: int32 words shaped as its scales (zero points never are)."""
    return str(part.dtype) == "int32" and (scales is None or tuple(part.shape) == tuple(scales.shape))


def scale_groups(rows: int, depth: int, two_level: bool) -> int:
    """The groups of x of a packed weight of `depth` input rows whose scales part has `rows` rows (a layout's
    groups axis): one a row, or with two-level scales those of its blocks' words."""
    if not two_level:
        return rows
    blocks = depth // KQ_BLOCK
    return blocks * (rows // blocks - 1) * SCALE_BYTES


def logical_row(row, group: int, planes: int):
    """The input row (of x) that packed row `row` of a weight of `planes` planes multiplies (plain arithmetic)."""
    return row // (planes * group) * group + row % group


def awq_tile_words(words: int) -> int:
    """Words per column tile of a qweight with `words` words a row: AWQ_TILE_WORDS, or the largest power of two
    below it that divides `words`."""
    return next(t for t in (AWQ_TILE_WORDS, 8, 4, 2, 1) if words % t == 0)


def pair_tile_words(out: int) -> int:
    """Words per column tile of the pairs layout for `out` columns: AWQ_TILE_WORDS, or the largest power of two below
    it whose tile (PAIR_SLOTS columns a word, two words an AWQ word) divides `out` (2 always does: `out` is a
    multiple of AWQ_PACK)."""
    return next(t for t in (AWQ_TILE_WORDS, 8, 4, 2) if out % (PAIR_SLOTS * t) == 0)


def pair_position(column, row, tile: int):
    """Where the value of (`row`, `column`) lies in the pairs layout of `tile` words a tile: (column tile, row pair,
    word, bit shift); plain arithmetic, so numpy arrays and TensorIR expressions take it too."""
    word, within = column // AWQ_PACK, column % AWQ_PACK
    return (word // (tile // 2), row // 2, word % (tile // 2) * 2 + within % 2,
            row % 2 * 16 + within // 2 * 4)


def pair_value(word, row, n):
    """The 4-bit value of row `row` (of its pair: which half) in nibble n of a pairs-layout word (qweight's rows,
    qzeros' groups); plain arithmetic, as `pair_position`."""
    return (word >> (row % 2 * 16 + n * 4)) & 15


def pair_order(t, n, word, tile: int):
    """The position of nibble n of word `word` of column tile t in the layout's column order (tile by tile,
    (nibble, word)): the order of a tile's scales and of a product's columns before they are put in place."""
    return (t * PAIR_SLOTS + n) * tile + word


def pair_index(column, tile: int):
    """The position of column `column` in the pairs layout's column order (`pair_order`)."""
    t, _, word, shift = pair_position(column, 0, tile)
    return pair_order(t, shift // 4, word, tile)


def pair_scale(index, group, tile: int):
    """Where the scale of group `group` at position `index` of the layout's column order lies in the pairs
    layout's scales: (column tile, group, position within the tile)."""
    return index // (PAIR_SLOTS * tile), group, index % (PAIR_SLOTS * tile)


def pair_column(t, n, word, tile: int):
    """The column of nibble n of word `word` of column tile t (the inverse of `pair_position`)."""
    return (t * (tile // 2) + word // 2) * AWQ_PACK + 2 * n + word % 2
