"""A small helper that builds an entry graph op by op, inferring each value's type."""

from __future__ import annotations

from .graph import Dim, Graph, Op, Param, Role, TensorType
from .ops import OPS, IRError, infer_types


class GraphBuilder:
    """Appends ops to one entry graph; params are referenced by their checkpoint names."""

    def __init__(self, name: str, params: dict[str, Param], bucket_dims: tuple[str, ...] = (), optional: bool = False,
                 derived_dims: dict[str, tuple[str, int]] | None = None):
        """An empty entry graph compiled over `bucket_dims` (ir.graph.BUCKET_AXES) and the dims derived from them
        (see ir.graph.Graph); `optional`: built on request."""
        self.name = name
        self.params = params
        self.bucket_dims, self.optional = tuple(bucket_dims), optional
        self.derived_dims = dict(derived_dims or {})
        self.inputs: list[str] = []
        self.ops: list[Op] = []
        self.types: dict[str, TensorType] = {}
        self.roles: dict[str, Role] = {}

    def input(self, name: str, shape: tuple[Dim, ...], dtype: str, role: str, layer: int | None = None) -> str:
        """Declare a runtime input and its role (ir.graph.INPUT_ROLES; state roles name their layer)."""
        self._define(name, TensorType(tuple(shape), dtype))
        self.inputs.append(name)
        self.roles[name] = Role(role, layer)
        return name

    def op(self, kind: str, inputs: list[str], name: str, **attrs) -> str | tuple[str, ...]:
        """Append an op; returns its output name (or names, when it has several)."""
        types = [self.type_of(v) for v in inputs]
        out_types = infer_types(kind, types, attrs)
        outs = (name,) if len(out_types) == 1 else tuple(f"{name}.{i}" for i in range(len(out_types)))
        for out, t in zip(outs, out_types):
            self._define(out, t)
        self.ops.append(Op(kind, tuple(inputs), outs, dict(attrs)))
        return outs[0] if len(outs) == 1 else outs

    def type_of(self, value: str) -> TensorType:
        """Type of a value or param."""
        if value in self.types:
            return self.types[value]
        if value in self.params:
            return self.params[value].type
        raise IRError(f"{self.name}: value {value!r} is not defined")

    def finish(self, outputs: list[str]) -> Graph:
        """The built graph."""
        for out in outputs:
            self.type_of(out)
        return Graph(self.name, list(self.inputs), list(self.ops), list(outputs), dict(self.types), dict(self.roles),
                     self.bucket_dims, self.optional, dict(self.derived_dims))

    def _define(self, name: str, t: TensorType) -> None:
        if name in self.types or name in self.params:
            raise IRError(f"{self.name}: value {name!r} defined twice")
        self.types[name] = t


__all__ = ["GraphBuilder", "OPS"]
