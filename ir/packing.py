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
"""

from __future__ import annotations

from dataclasses import dataclass

PACKINGS = {"awq_int4": "awq_tiles"}  # packing kind -> the weight-map transform (ir.graph.WEIGHT_TRANSFORMS) that makes it
AWQ_PACK = 8  # 4-bit values per int32 word
AWQ_TILE_WORDS = 16  # words of qweight per column tile: a 64-byte cache line


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
    """How a weight matrix is packed: a kind from PACKINGS and its group (input rows per scale and zero point)."""

    kind: str
    group: int

    def __str__(self) -> str:
        return f"{self.kind}(g{self.group})"

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
        return None

    @property
    def transform(self) -> str:
        """The weight-map transform that makes the parts from the checkpoint's tensors."""
        return PACKINGS[self.kind]

    def checkpoint_parts(self, shape: tuple[int, int], dtype: str) -> tuple[tuple[tuple[int, ...], str], ...]:
        """(shape, dtype) of each checkpoint tensor of a logical [out, in] matrix of `dtype`: qweight, qzeros, scales."""
        out, inp = shape
        return (((inp, out // AWQ_PACK), "int32"), ((inp // self.group, out // AWQ_PACK), "int32"),
                ((inp // self.group, out), dtype))

    def parts(self, shape: tuple[int, int], dtype: str) -> tuple[tuple[tuple[int, ...], str], ...]:
        """(shape, dtype) of each part kernels take, in order: qweight in column tiles, qzeros, scales."""
        ((rows, words), _), *rest = self.checkpoint_parts(shape, dtype)
        tile = awq_tile_words(words)
        return (((words // tile, rows, tile), "int32"), *rest)


def awq_tile_words(words: int) -> int:
    """Words per column tile of a qweight with `words` words a row: AWQ_TILE_WORDS, or the largest power of two
    below it that divides `words`."""
    return next(t for t in (AWQ_TILE_WORDS, 8, 4, 2, 1) if words % t == 0)
