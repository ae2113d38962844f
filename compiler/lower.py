"""IR program -> one Relax module: a VM function per entry and shape bucket, calling scheduled kernels.

Each function runs a whole step (every kernel of a prefill chunk or a decode step) in one call
from Python; the VM plans intermediate memory once. Weights come in as one tuple argument.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Callable, Iterable

import tvm
from tvm import relax
from tvm.ir import PrimType

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


def call_order(graph: Graph) -> list[str]:
    """An entry's inputs in the order its compiled functions take them: int32 scalars first, then the tensors as
    declared. With CUDA graphs, a function's leading `num_input` parameters are read anew at every call, and every
    later one (tensors: the same buffers at every call) is captured once."""
    scalars = [v for v in graph.inputs if graph.types[v].shape == ()]
    return scalars + [v for v in graph.inputs if v not in scalars]


def lower_program(program: Program, buckets: Buckets, signatures: list[KernelSignature],
                  schedule: Callable[[Kernel, str, dict], Kernel], progress: Callable[[Iterable], Iterable] = iter,
                  scan_lanes: int = 1, cuda_graphs: bool = False) -> tvm.IRModule:
    """The Relax module for all buckets, given their `kernel_signatures`; `schedule` turns each kernel (with its op's
    kind and attributes) into its target's form (`scan_lanes`: see compiler.kernels.make_kernel). `cuda_graphs`: mark
    every tensor input static, so that TVM's RewriteCUDAGraph captures each function's kernels (all but those that
    read a scalar input or write the output) into one CUDA graph, replayed at later calls."""
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


def _relax_type(t: TensorType):
    return PrimType(t.dtype) if t.shape == () else relax.TensorType(list(t.shape), t.dtype)


def _lower_entry(bb, fn_name, program, graph, dims, kernels, param_types, cuda_graphs) -> None:
    order = call_order(graph)
    inputs = [relax.Var(name, _relax_type(graph.types[name].bind(dims))) for name in order]
    weights = relax.Var("params", relax.TupleType([_relax_type(t) for t in param_types]))
    scalars = sum(graph.types[name].shape == () for name in order)
    # Parameters from `num_input` on are checked only where their shapes are symbolic: the weights never are, so a
    # call does not check each of its hundreds of weight tensors in the VM (a kernel checks the tensors it takes).
    attrs = {"num_input": scalars if cuda_graphs else len(inputs)}
    with bb.function(fn_name, inputs + [weights], attrs):
        with bb.dataflow():
            env = {name: [var] for name, var in zip(order, inputs)}  # value -> the tensors it is passed as
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
                if inplace:
                    call = relax.call_tir_inplace(gvar, args, list(inplace), out_types)
                else:
                    call = relax.call_tir(gvar, args, out_types)
                result = bb.emit(call)
                if len(op.outputs) == 1:
                    env[op.outputs[0]] = [result]
                else:
                    for k, out in enumerate(op.outputs):
                        env[out] = [bb.emit(relax.TupleGetItem(result, k))]
            output = bb.emit_output(env[graph.outputs[0]][0])
        bb.emit_func_output(output)
