"""JSON round-trip of a program and the stable hash that keys build artifacts."""

from __future__ import annotations

import hashlib
import json

from .graph import Graph, Op, Param, Program, Role, TensorType
from .packing import Packing

FORMAT_VERSION = 5


def _type(t: TensorType) -> dict:
    packing = {"packing": [t.packing.kind, t.packing.group, t.packing.planes, t.packing.block]} if t.packing else {}
    return {"shape": list(t.shape), "dtype": t.dtype, **packing}


def _untype(d: dict) -> TensorType:
    return TensorType(tuple(d["shape"]), d["dtype"], Packing(*d["packing"]) if "packing" in d else None)


def to_json_dict(program: Program) -> dict:
    """A JSON-compatible dict holding the whole program."""
    return {
        "format": FORMAT_VERSION,
        "model_type": program.model_type,
        "meta": program.meta,
        "params": [{"name": p.name, **_type(p.type), "sources": list(p.sources), "transform": p.transform}
                   for p in program.params.values()],
        "entries": [
            {
                "name": g.name,
                "inputs": g.inputs,
                "roles": {name: [role.kind, role.layer] for name, role in g.roles.items()},
                "outputs": g.outputs,
                "bucket_dims": list(g.bucket_dims),
                "optional": g.optional,
                "derived_dims": {dim: list(rule) for dim, rule in g.derived_dims.items()},
                "types": {k: _type(t) for k, t in g.types.items()},
                "ops": [{"kind": o.kind, "inputs": list(o.inputs), "outputs": list(o.outputs), "attrs": o.attrs}
                        for o in g.ops],
            }
            for g in program.entries.values()
        ],
    }


def from_json_dict(d: dict) -> Program:
    """The program a `to_json_dict` dict describes."""
    if d.get("format") != FORMAT_VERSION:
        raise ValueError(f"IR format {d.get('format')!r} is not {FORMAT_VERSION}")
    params = {p["name"]: Param(p["name"], _untype(p), tuple(p["sources"]), p["transform"]) for p in d["params"]}
    entries = {}
    for e in d["entries"]:
        ops = [Op(o["kind"], tuple(o["inputs"]), tuple(o["outputs"]), o["attrs"]) for o in e["ops"]]
        types = {k: _untype(t) for k, t in e["types"].items()}
        roles = {name: Role(kind, layer) for name, (kind, layer) in e["roles"].items()}
        entries[e["name"]] = Graph(e["name"], list(e["inputs"]), ops, list(e["outputs"]), types, roles,
                                   tuple(e["bucket_dims"]), e["optional"],
                                   {dim: (axis, divisor) for dim, (axis, divisor) in e["derived_dims"].items()})
    return Program(d["model_type"], params, entries, d["meta"])


def to_json(program: Program) -> str:
    """Canonical JSON text of the program (sorted keys, no whitespace)."""
    return json.dumps(to_json_dict(program), sort_keys=True, separators=(",", ":"))


def from_json(text: str) -> Program:
    """Parse `to_json` text."""
    return from_json_dict(json.loads(text))


def stable_hash(program: Program) -> str:
    """SHA-256 of the canonical JSON: equal programs hash equal across runs and machines."""
    return hashlib.sha256(to_json(program).encode()).hexdigest()
