"""Time every kernel of one step (decode, or a prefill chunk) of a model on this CPU, heaviest first.

    python -m benchmarks.profile_kernels --shape qwen2.5-0.5b --dtype bfloat16 --tokens 1 --work DIR
    python -m benchmarks.profile_kernels --model-dir MODEL_DIR --tokens 64
    python -m benchmarks.profile_kernels --shape tinyllama-1.1b --dtype awq --tokens 128 --work DIR
    python -m benchmarks.profile_kernels --tokens 128 --matmul-precision bfloat16 --mcpu cooperlake --work DIR

Kernels run alone, repeatedly, on random inputs: small weight matrices stay in cache, so these
times are a lower bound; `benchmarks.cpu_generate` gives the end-to-end figure.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import ml_dtypes
import numpy as np
import tvm

import models
from benchmarks.checkpoints import SHAPES, awq_checkpoint_of, real_shape_checkpoint
from benchmarks.cpu_generate import AWQ_GROUP
from compiler.kernels import make_kernel
from compiler.lower import op_signature
from compiler.options import MATMUL_PRECISIONS
from compiler.target import cpu_target
from ir import OPS, ROWS, TOKENS, infer_types, packed_as
from ir.contract import Buckets
from ir.packing import CPU_PACKINGS
from runtime.cpu import enable_amx, use_all_cores
from schedules import cpu

CONTEXT_TOKENS = 512


def _random_input(name, t, rng, tokens):
    """A value for input `name` of an op: random floats; int inputs of one sequence holding every token row,
    continuing from its state (so attention sees few positions: its time is a lower bound)."""
    if t.dtype == "int32":
        return np.full(t.shape, {"n": tokens, "seq_len": tokens, "seq_pos": 1}.get(name, 0), np.int32)
    data = rng.standard_normal(t.shape).astype(np.float32)
    return data.astype(ml_dtypes.bfloat16 if t.dtype == "bfloat16" else t.dtype)


def main() -> None:
    """Build each distinct kernel of the step, time it, print a table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "awq"], default="bfloat16",
                        help="the random --shape checkpoint's (awq: its float16 one quantised by our AWQ packer)")
    parser.add_argument("--tokens", type=int, default=1, help="1: a decode step; more: a prefill chunk")
    parser.add_argument("--work", help="where the random checkpoint is kept")
    parser.add_argument("--model-dir", help="profile this model directory instead of a random --shape checkpoint")
    parser.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS, default="float32",
                        help="as `python -m compiler build` takes it (bfloat16: prefill products on AMX tiles or "
                             "AVX512-BF16 dot products)")
    parser.add_argument("--mcpu", help="build for this LLVM CPU (default: this machine's), e.g. cooperlake on an AMX "
                                       "Xeon to time the AVX512-BF16 path")
    args = parser.parse_args()
    if (args.work is None) == (args.model_dir is None):
        parser.error("give --work (with --shape) or --model-dir")
    use_all_cores()
    awq = args.dtype == "awq"
    weights = "float16" if awq else args.dtype  # the float checkpoint's dtype
    target = cpu_target(args.mcpu, args.matmul_precision).for_weights(weights)
    if target.bf16_products == "amx":
        enable_amx()
    model_dir = args.model_dir
    if model_dir is None:
        model_dir = real_shape_checkpoint(args.work, args.shape, weights)
        model_dir = awq_checkpoint_of(model_dir, AWQ_GROUP) if awq else model_dir
    program = packed_as(models.load_checkpoint_program(model_dir)[3], CPU_PACKINGS)  # as a CPU build stores it
    dev, rng = tvm.cpu(), np.random.default_rng(0)
    entry, arena = "step", Buckets((args.tokens,), (1,), CONTEXT_TOKENS, CONTEXT_TOKENS // 16)
    graph = program.entries[entry]
    uses = Counter(op_signature(graph, program, op, {TOKENS: args.tokens, ROWS: 1, **arena.arena_dims()})
                   for op in graph.ops)
    rows, total = [], 0.0
    for sig, count in uses.items():
        attrs = json.loads(sig.attrs_json)
        kernel = make_kernel(sig.kind, list(sig.types), attrs, target.scan_lanes)
        lib = tvm.compile(cpu.schedule(kernel.func, sig.kind, attrs, target), target.tvm_target())
        inputs = [_random_input(name, part, rng, args.tokens) for name, t in zip(
            OPS[sig.kind].inputs + OPS[sig.kind].optional_inputs, sig.types) for part in t.parts()]
        call = [x if isinstance(x, int) else tvm.runtime.tensor(x, dev) for x in inputs]
        call += [tvm.runtime.tensor(c, dev) for c in kernel.constants]
        outs = infer_types(sig.kind, list(sig.types), attrs)
        call += [tvm.runtime.empty(o.shape, o.dtype, dev)
                 for o, src in zip(outs, OPS[sig.kind].sources(len(outs))) if src < 0]
        ms = lib.mod.time_evaluator("main", dev, number=5, repeat=3)(*call).median * 1e3
        total += ms * count
        rows.append((ms * count, sig.kind, count, ms, ", ".join(str(t) for t in sig.types[:2])))
    for step_ms, kind, count, ms, types in sorted(rows, reverse=True):
        print(f"{step_ms:9.2f} ms  {kind:12s} x{count:<3d} {ms:8.3f} ms each  {types}")
    what = args.model_dir or f"{args.shape} {args.dtype}"
    print(f"{total:9.2f} ms  total ({entry}, {args.tokens} token(s), {what})")


if __name__ == "__main__":
    main()
