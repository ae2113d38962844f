"""IR program -> one Relax module: a VM function per entry and shape bucket, calling scheduled kernels.

Each function runs a whole step (every kernel of a prefill chunk or a decode step) in one call
from Python; the VM plans intermediate memory once. Weights come in as one tuple argument, and the
step's output goes into a buffer the caller passes (the same one at every call).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Callable, Iterable

import tvm
from tvm import relax

from ir import OPS, Graph, Program, TensorType
from ir.contract import Buckets

from .kernels import Kernel, make_kernel


@dataclass(frozen=True)
class KernelSignature:
    """An op kind with concrete input types and attributes: what one compiled kernel computes."""

    kind: str
    types: tuple[TensorType, ...]
    attrs_json: str

    @property
    def name(self) -> str:
        """A short unique kernel name."""
        key = json.dumps([self.kind, [str(t) for t in self.types], self.attrs_json])
        return f"{self.kind}_{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def op_signature(graph: Graph, program: Program, op, dims: dict[str, int]) -> KernelSignature:
    """The kernel signature of one op of `graph` with its symbolic dims bound."""
    types = tuple((graph.types[v] if v in graph.types else program.params[v].type).bind(dims) for v in op.inputs)
    return KernelSignature(op.kind, types, json.dumps(op.attrs, sort_keys=True))


def kernel_signatures(program: Program, buckets: Buckets) -> list[KernelSignature]:
    """Every distinct kernel the module needs, in first-use order."""
    seen: dict[KernelSignature, None] = {}
    for _, entry, dims in buckets.functions(program):
        graph = program.entries[entry]
        for op in graph.ops:
            seen.setdefault(op_signature(graph, program, op, dims))
    return list(seen)


def lower_program(program: Program, buckets: Buckets, signatures: list[KernelSignature],
                  schedule: Callable[[Kernel, str, dict], Kernel], progress: Callable[[Iterable], Iterable] = iter,
                  scan_lanes: int = 1, cuda_graphs: bool = False) -> tvm.IRModule:
    """The Relax module for all buckets, given their `kernel_signatures`; `schedule` turns each kernel (with its op's
    kind and attributes) into its target's form (`scan_lanes`: see compiler.kernels.make_kernel). `cuda_graphs`: mark
    every input static (the caller passes the same buffers at every call), so that TVM's RewriteCUDAGraph captures
    all of a function's kernels into one CUDA graph, replayed at later calls."""
    bb = relax.BlockBuilder()
    kernels = {}
    for sig in progress(signatures):
        attrs = json.loads(sig.attrs_json)
        kernel = schedule(make_kernel(sig.kind, list(sig.types), attrs, scan_lanes), sig.kind, attrs)
        kernels[sig] = (bb.add_func(kernel.func.with_attr("global_symbol", sig.name), sig.name), kernel.constants)
    param_types = [part for p in program.params.values() for part in p.type.parts()]  # a packed param: its parts
    for fn_name, entry, dims in buckets.functions(program):
        _lower_entry(bb, fn_name, program, program.entries[entry], dims, kernels, param_types, cuda_graphs)
    return bb.get()


def _relax_type(t: TensorType) -> relax.TensorType:
    return relax.TensorType(list(t.shape), t.dtype)


def _lower_entry(bb, fn_name, program, graph, dims, kernels, param_types, cuda_graphs) -> None:
    """Function `fn_name`: the entry's inputs, then `out` (the caller's buffer, which the op of the entry's output
    writes), then the weights as one tuple. It returns `out`: every kernel, the last one too, reads and writes only
    buffers that are the same at every call, which is what lets a CUDA graph capture them all."""
    inputs = [relax.Var(name, _relax_type(graph.types[name].bind(dims))) for name in graph.inputs]
    result = graph.outputs[0]
    out = relax.Var("out", _relax_type(graph.types[result].bind(dims)))
    weights = relax.Var("params", relax.TupleType([_relax_type(t) for t in param_types]))
    # Parameters from `num_input` on are checked only where their shapes are symbolic: the weights never are, so a
    # call does not check each of its hundreds of weight tensors in the VM (a kernel checks the tensors it takes).
    # With CUDA graphs, they are also the ones captured once: all of them.
    attrs = {"num_input": 0 if cuda_graphs else len(inputs) + 1}
    with bb.function(fn_name, inputs + [out, weights], attrs):
        env = {name: [var] for name, var in zip(graph.inputs, inputs)}  # value -> the tensors it is passed as
        index = 0
        for name, param in program.params.items():
            parts = len(param.type.parts())
            env[name] = [bb.emit(relax.TupleGetItem(weights, i)) for i in range(index, index + parts)]
            index += parts
        for op in graph.ops:
            gvar, constants = kernels[op_signature(graph, program, op, dims)]
            args = [part for v in op.inputs for part in env[v]] + [relax.const(c) for c in constants]
            out_types = [_relax_type(graph.types[o].bind(dims)) for o in op.outputs]
            inplace = OPS[op.kind].inplace
            if result in op.outputs:  # the kernel's output parameter is `out` (ir.verify: its only one, fresh)
                call = relax.call_tir_inplace(gvar, args + [out], [len(args)], out_types)
            elif inplace:
                call = relax.call_tir_inplace(gvar, args, list(inplace), out_types)
            else:
                call = relax.call_tir(gvar, args, out_types)
            value = bb.emit(call)
            if len(op.outputs) == 1:
                env[op.outputs[0]] = [value]
            else:
                for k, name in enumerate(op.outputs):
                    env[name] = [bb.emit(relax.TupleGetItem(value, k))]
        bb.emit_func_output(out)  # the parameter itself: a var bound inside a captured region is not returned
