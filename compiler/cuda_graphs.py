"""The Relax pipeline of a CUDA build: TVM's `default_build`, with every CUDA graph replay returning a value.

Each step function's kernels read and write only buffers that are the same at every call (compiler.lower), so TVM's
RewriteCUDAGraph lifts all of them into one capture function, which then has no outputs: it returns an empty tuple,
and the call of `vm.builtin.cuda_graph.run_or_capture` that runs it is void. The pinned TVM's VM cannot return from a
VM function into a void call (its `Ret` writes the value into the caller's void register and fails the check
`reg < frame->register_file.size()`), so on a GPU every step failed at its first call. `NonVoidReplays` makes each
such capture function return its first parameter (an object that lives as long as the graph) and binds the replay's
result, which TVM then keeps in an ordinary register.
"""

from __future__ import annotations

import tvm
from tvm import relax
from tvm.relax import backend, transform

REPLAY = "vm.builtin.cuda_graph.run_or_capture"


def _void_replay(value) -> str | None:
    """The name of the capture function that `value` replays, where `value` is a void call of `REPLAY`."""
    if not (isinstance(value, relax.Call) and value.op.same_as(tvm.ir.Op.get("relax.call_builtin_with_ctx"))):
        return None
    callee, args = value.args
    if not (isinstance(callee, relax.ExternFunc) and callee.global_symbol == REPLAY):
        return None
    returns = value.ty_args[0]
    void = isinstance(returns, relax.TupleType) and not returns.fields
    return args.fields[0].name_hint if void else None


def _returning_first_param(func: relax.Function) -> relax.Function:
    """`func` (whose body returns an empty tuple) returning a one-tuple of its first parameter instead."""
    first = func.params[0]
    body = relax.SeqExpr(func.body.blocks, relax.Tuple([first]))
    returns = relax.TupleType([first.ty])
    return relax.Function(func.params, body, returns, func.is_pure, func.attrs, func.span)


@relax.expr_functor.mutator
class _BindReplays(relax.PyExprMutator):
    """Rewrites each void replay call into one of the same capture function, returning `returns[its name]`."""

    def __init__(self, mod: tvm.IRModule, returns: dict[str, relax.Type]):
        super().__init__(mod)
        self.returns = returns

    def visit_var_binding_(self, binding) -> None:
        captured = _void_replay(binding.value)
        if captured is None:
            super().visit_var_binding_(binding)
            return
        call = binding.value
        self.builder_.emit(relax.Call(call.op, call.args, call.attrs, [self.returns[captured]]), "replayed")


@tvm.transform.module_pass(opt_level=0, name="NonVoidReplays")
def non_void_replays(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """Every void CUDA graph replay made to return a value (see the module docstring)."""
    captured = set()
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func.body, lambda e: captured.add(_void_replay(e)))
    captured.discard(None)
    if not captured:
        return mod
    rewritten = {gvar.name_hint: _returning_first_param(func) for gvar, func in mod.functions.items()
                 if gvar.name_hint in captured}
    mutator = _BindReplays(mod, {name: func.ret_ty for name, func in rewritten.items()})
    for gvar, func in mod.functions.items():
        if gvar.name_hint in rewritten:
            mutator.builder_.update_func(gvar, rewritten[gvar.name_hint])
        elif isinstance(func, relax.Function):
            mutator.builder_.update_func(gvar, mutator.visit_expr(func))
    return mutator.builder_.get()


def relax_pipeline() -> tvm.transform.Pass:
    """TVM 0.27's `default_build` pipeline (tvm.relax.pipeline) with `non_void_replays` after RewriteCUDAGraph."""
    return tvm.transform.Sequential([
        backend.DispatchSampling(), backend.DispatchSortScan(), transform.LegalizeOps(),
        transform.RewriteDataflowReshape(), transform.ToNonDataflow(), transform.RemovePurityChecking(),
        transform.CallTIRRewrite(), transform.StaticPlanBlockMemory(), transform.RewriteCUDAGraph(),
        non_void_replays,
        transform.LowerAllocTensor(), transform.KillAfterLastUse(), transform.LowerRuntimeBuiltin(),
        transform.ComputePrimValue(), transform.VMShapeLower(), transform.AttachGlobalSymbol(),
    ])
