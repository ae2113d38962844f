"""The verifier: every value defined once before use, types as the op signatures infer."""

from __future__ import annotations

from .graph import BUCKET_AXES, INPUT_ROLES, WEIGHT_TRANSFORMS, Graph, Program
from .ops import OPS, IRError, infer_types


def verify_graph(graph: Graph, program: Program) -> None:
    """Raise IRError if `graph` is ill-formed within `program`."""
    where = f"{program.model_type}.{graph.name}"
    defined = set(program.params)
    overwritten: set[str] = set()
    for name in graph.inputs:
        if name in defined:
            raise IRError(f"{where}: input {name!r} shadows a param or another input")
        if name not in graph.types:
            raise IRError(f"{where}: input {name!r} has no declared type")
        role = graph.roles.get(name)
        if role is None or role.kind not in INPUT_ROLES or (role.layer is not None) != role.is_state:
            raise IRError(f"{where}: input {name!r} has no valid role ({role}); state roles name their layer")
        defined.add(name)
    for op in graph.ops:
        for v in op.inputs:
            if v not in defined:
                raise IRError(f"{where}: {op.kind} reads undefined value {v!r}")
            if v in overwritten:
                raise IRError(f"{where}: {op.kind} reads {v!r} after an in-place op overwrote it")
        in_types = [graph.types[v] if v in graph.types else program.params[v].type for v in op.inputs]
        out_types = infer_types(op.kind, in_types, op.attrs)
        if len(out_types) != len(op.outputs):
            raise IRError(f"{where}: {op.kind} gives {len(out_types)} outputs, graph names {len(op.outputs)}")
        for out, t in zip(op.outputs, out_types):
            if out in defined:
                raise IRError(f"{where}: value {out!r} defined twice")
            if graph.types.get(out) != t:
                raise IRError(f"{where}: {out!r} is typed {graph.types.get(out)}, {op.kind} gives {t}")
            defined.add(out)
        for src in OPS[op.kind].overwritten:
            if op.inputs[src] in program.params:
                raise IRError(f"{where}: {op.kind} would overwrite param {op.inputs[src]!r}")
            overwritten.add(op.inputs[src])
    for out in graph.outputs:
        if out not in defined or out in overwritten:
            raise IRError(f"{where}: output {out!r} is undefined or overwritten")
    writer = next((op for op in graph.ops if graph.outputs and graph.outputs[0] in op.outputs), None)
    if writer is None or len(writer.outputs) > 1 or OPS[writer.kind].inplace:
        raise IRError(f"{where}: its first output (what a compiled function writes into its caller's buffer) must "
                      "come from an op with one output that writes no input")
    if set(graph.roles) != set(graph.inputs):
        raise IRError(f"{where}: roles given for values that are not inputs: {sorted(set(graph.roles) - set(graph.inputs))}")
    stray = set(graph.types) - (defined - set(program.params))
    if stray:
        raise IRError(f"{where}: types given for values never defined: {sorted(stray)}")
    input_dims = {d for name in graph.inputs for d in graph.types[name].shape if isinstance(d, str)}
    bad = [d for d in graph.bucket_dims if d not in BUCKET_AXES or d not in input_dims]
    if bad or len(set(graph.bucket_dims)) != len(graph.bucket_dims):
        raise IRError(f"{where}: bucket dims {list(graph.bucket_dims)} must be distinct bucket axes "
                      f"({', '.join(BUCKET_AXES)}) that its inputs use ({sorted(input_dims)})")
    for dim, (axis, divisor) in graph.derived_dims.items():
        if axis not in graph.bucket_dims or not isinstance(divisor, int) or divisor <= 0 or dim in input_dims:
            raise IRError(f"{where}: derived dim {dim!r} must divide one of its bucket dims {list(graph.bucket_dims)} "
                          f"by a positive int (got {axis!r} / {divisor!r}) and be no input's dim")


UNPACKED_TRANSFORMS = ("copy", "flatten")  # the transforms of a param stored as it is used (not packed)


def verify(program: Program) -> Program:
    """Raise IRError if any param's weight-map entry or any entry of `program` is ill-formed; returns the program."""
    for param in program.params.values():
        parts = len(param.type.parts())
        packing = param.type.packing
        if packing is not None and packing.problem(param.type.shape):
            raise IRError(f"{program.model_type}: param {param.name!r} of type {param.type}: "
                          f"{packing.problem(param.type.shape)}")
        want = (packing.transform,) if packing else UNPACKED_TRANSFORMS
        if param.transform not in WEIGHT_TRANSFORMS or param.transform not in want or len(param.source_tensors) != parts:
            raise IRError(f"{program.model_type}: param {param.name!r} of type {param.type} has transform "
                          f"{param.transform!r} of {list(param.source_tensors)}; its type needs {' or '.join(map(repr, want))} "
                          f"of {parts} source tensors")
    for graph in program.entries.values():
        verify_graph(graph, program)
    return program
