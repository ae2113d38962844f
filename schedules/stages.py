"""The stages (blocks) of the compute definitions that schedules address: their names, shared with
`compiler/kernels.py` (which names its stages with these constants), and lookups by structure.

A schedule finds a stage by name only where a kernel has several of the same shape (the softmax
stages of attention, the in-chunk products of the delta rule); a product's reduction and a norm's
producers are found by what they are.
"""

from __future__ import annotations

from tvm import s_tir, tirx

MATMUL = "matmul"  # linear: the product's reduction
DEQUANT = "dequantise"  # linear of a packed weight: the weight unpacked (a tile at a time, or inlined into the product)
PAIR_COLUMNS = "pair_columns"  # linear of a weight in the pairs layout: its product's columns put in their places
NORM = "rms_norm"  # rms_norm / add_rms_norm: the normalised output (its producers: sum of squares, residual sum)
SCORES, MASKED, ROW_MAX, EXP, ROW_SUM, WEIGHTED, ATTENTION = (
    "scores", "masked", "row_max", "exp", "row_sum", "weighted", "attention")  # attention's softmax pipeline
DELTA_DOTS = "delta_dots"  # the chunked delta rule's in-chunk dot products (absent from the recurrent form)


def blocks(sch: s_tir.Schedule) -> list:
    """Every stage of the kernel, in order."""
    return list(sch.get_child_blocks(sch.get_sblock("root")))


def find(sch: s_tir.Schedule, name: str):
    """The stage of this name, or None when the kernel's form has none."""
    return next((b for b in blocks(sch) if sch.get(b).name_hint == name), None)


def is_reduction(sch: s_tir.Schedule, block) -> bool:
    """Whether the stage reduces over one of its loops."""
    return any(iv.iter_type == tirx.IterVar.CommReduce for iv in sch.get(block).iter_vars)


def only_reduction(sch: s_tir.Schedule):
    """The kernel's one reduction stage (a product's)."""
    (block,) = [b for b in blocks(sch) if is_reduction(sch, b)]
    return block
