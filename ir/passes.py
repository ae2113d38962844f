"""Graph passes: each takes a graph (or the program) and returns an equivalent, simpler or faster one."""

from __future__ import annotations

from dataclasses import replace

from .graph import Graph, Op, Program
from .ops import OPS
from .packing import Packing


def _users(graph: Graph) -> dict[str, int]:
    count: dict[str, int] = {}
    for op in graph.ops:
        for v in op.inputs:
            count[v] = count.get(v, 0) + 1
    for v in graph.outputs:
        count[v] = count.get(v, 0) + 1
    return count


def eliminate_dead_values(graph: Graph) -> Graph:
    """Drop ops whose outputs nobody reads (ops writing in place are kept)."""
    ops = list(graph.ops)
    while True:
        users = _users(replace(graph, ops=ops))
        live = [op for op in ops if OPS[op.kind].overwritten or any(users.get(o, 0) for o in op.outputs)]
        if len(live) == len(ops):
            break
        ops = live
    kept = set(graph.inputs) | {o for op in ops for o in op.outputs}
    return replace(graph, ops=ops, types={k: t for k, t in graph.types.items() if k in kept})


def fuse_add_rms_norm(graph: Graph) -> Graph:
    """Fuse `s = add(a, b); y = rms_norm(s, w)` into one pass over memory giving both s and y."""
    producer = {op.outputs[0]: i for i, op in enumerate(graph.ops) if op.kind == "add"}
    fused_adds: set[int] = set()
    ops: list[Op | None] = list(graph.ops)
    for i, op in enumerate(graph.ops):
        if op.kind != "rms_norm" or op.inputs[0] not in producer:
            continue
        j = producer[op.inputs[0]]
        if j in fused_adds:
            continue  # the sum already comes out of an earlier fused op
        add = graph.ops[j]
        if any(add.outputs[0] in between.inputs for between in graph.ops[j + 1:i]):
            continue  # s is read before y: fusing would move its definition past a use
        ops[i] = Op("add_rms_norm", (add.inputs[0], add.inputs[1], op.inputs[1]),
                    (add.outputs[0], op.outputs[0]), dict(op.attrs))
        fused_adds.add(j)
    return replace(graph, ops=[op for k, op in enumerate(ops) if k not in fused_adds])


def packed_as(program: Program, kinds: dict[str, str]) -> Program:
    """The program with every packed param of a kind in `kinds` stored as the kind it maps to (the same values in
    the layout a target's kernels read best, ir.packing), made by that kind's weight-map transform."""
    params = {}
    for name, p in program.params.items():
        packing = p.type.packing
        if packing is not None and packing.kind in kinds:
            packing = replace(packing, kind=kinds[packing.kind])
            p = replace(p, type=replace(p.type, packing=packing), transform=packing.transform)
        params[name] = p
    return replace(program, params=params)
