"""A readable text form of a program."""

from __future__ import annotations

from .graph import Program


def _attr(v) -> str:
    if isinstance(v, list) and len(v) > 4:
        return f"[{v[0]!r}, ... {len(v)} values]"
    return repr(v)


def format_program(program: Program) -> str:
    """The program as text: params, then each entry's ops, one per line."""
    lines = [f"program {program.model_type} ({len(program.params)} params)"]
    lines += [f"  param {p.name}: {p.type}" for p in program.params.values()]
    for g in program.entries.values():
        args = ", ".join(f"%{v}: {g.types[v]}" for v in g.inputs)
        over = f" over [{', '.join(g.bucket_dims)}]" if g.bucket_dims else ""
        over += "".join(f", {dim} = {axis} / {divisor}" for dim, (axis, divisor) in g.derived_dims.items())
        lines.append(f"{'optional ' if g.optional else ''}entry {g.name}({args}){over} {{")
        for op in g.ops:
            outs = ", ".join(f"%{o}: {g.types[o]}" for o in op.outputs)
            ins = ", ".join(f"%{v}" if v in g.types else f"@{v}" for v in op.inputs)
            attrs = "".join(f", {k}={_attr(v)}" for k, v in op.attrs.items())
            lines.append(f"  {outs} = {op.kind}({ins}{attrs})")
        lines.append(f"  return {', '.join('%' + o for o in g.outputs)}")
        lines.append("}")
    return "\n".join(lines)
