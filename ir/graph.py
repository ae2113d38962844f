"""The typed dataflow graph: tensor types, params, ops, entry graphs and the program."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

Dim = Union[int, str]
"""A dimension: a fixed size, or the name of a symbolic dim bound per shape bucket."""

DTYPES = ("float32", "float16", "bfloat16", "int32")

# Symbolic dims the compiler binds per shape bucket.
TOKENS = "tokens"  # new tokens in one call (a prefill chunk, or every row of a batch step)
CONTEXT = "context"  # KV cache capacity of one sequence
ROWS = "rows"  # sequences in one batch step
PAGES = "pages"  # pages in the shared KV arena of batched execution
BLOCK = "block"  # tokens per KV page
PAGES_PER_ROW = "pages_per_row"  # block-table width: pages one sequence may hold
HISTORY = "history"  # positions a block table covers: pages_per_row * block
SLOTS = "slots"  # recurrent-state slots of batched execution: one per sequence a batch may hold


@dataclass(frozen=True)
class TensorType:
    """Shape (ints or symbolic dim names) and element dtype of a value."""

    shape: tuple[Dim, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"

    def bind(self, dims: dict[str, int]) -> "TensorType":
        """This type with its symbolic dims replaced by the sizes in `dims`."""
        return TensorType(tuple(dims.get(d, d) if isinstance(d, str) else d for d in self.shape), self.dtype)


@dataclass(frozen=True)
class Param:
    """A weight: its checkpoint tensor name and type."""

    name: str
    type: TensorType


@dataclass(frozen=True)
class Op:
    """One operation: a kind from `ir.ops`, input and output value names, and attributes."""

    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Graph:
    """One entry point (prefill, decode): runtime inputs, ops in order, outputs, value types."""

    name: str
    inputs: list[str]
    ops: list[Op]
    outputs: list[str]
    types: dict[str, TensorType]


@dataclass
class Program:
    """A whole model: its params (shared by all entries) and its entry graphs."""

    model_type: str
    params: dict[str, Param]
    entries: dict[str, Graph]
    meta: dict[str, Any] = field(default_factory=dict)

    def param_types(self) -> dict[str, TensorType]:
        """Param name -> type."""
        return {name: p.type for name, p in self.params.items()}
