"""The small typed graph IR: values, params, ops, entry graphs, and what works on them."""

from .builder import GraphBuilder
from .errors import RudaError
from .packing import Packing
from .graph import (
    BLOCK,
    HISTORY,
    INPUT_ROLES,
    PAGES,
    PAGES_PER_ROW,
    ROWS,
    SLOTS,
    TOKENS,
    Graph,
    Op,
    Param,
    Program,
    Role,
    TensorType,
)
from .ops import OPS, IRError, infer_types
from .passes import eliminate_dead_values, fuse_add_rms_norm, packed_as
from .printer import format_program
from .serialize import from_json, stable_hash, to_json
from .verify import verify

__all__ = [
    "BLOCK", "HISTORY", "INPUT_ROLES", "PAGES", "PAGES_PER_ROW", "ROWS", "SLOTS", "TOKENS", "Graph", "GraphBuilder", "IRError", "OPS",
    "Op", "Packing", "Param", "Program", "Role", "RudaError", "TensorType", "eliminate_dead_values", "format_program", "from_json", "fuse_add_rms_norm", "infer_types", "packed_as",
    "stable_hash", "to_json", "verify",
]
