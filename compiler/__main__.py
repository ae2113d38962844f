"""`python -m compiler build MODEL_DIR --target {llvm,cuda}`: compile a Hugging Face model directory ahead of time;
`python -m compiler bundle ARTIFACT_DIR OUT`: ship an artifact with a runtime that needs no TVM install."""

from __future__ import annotations

import argparse
import json
import sys

from ir.errors import add_debug_flag, exit_cli

from .options import (
    ARCHS,
    COMPILER_ENV,
    COMPILERS,
    DEFAULT_BATCH_ROWS,
    DEFAULT_IMAGE_PATCH_BUCKETS,
    DEFAULT_MAX_CONTEXT,
    DEFAULT_PREFILL_BUCKETS,
    MATMUL_PRECISIONS,
    PTX_VERSION_ENV,
    TARGETS,
)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def main(argv: list[str]) -> int:
    """Run the compiler CLI on `argv`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m compiler", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile MODEL_DIR into an artifact directory")
    b.add_argument("model_dir", metavar="MODEL_DIR")
    b.add_argument("--target", default="llvm", choices=TARGETS,
                   help="llvm: this CPU (default); cuda: NVIDIA GPUs, built here without a GPU")
    b.add_argument("--out", help="artifact directory (default: build/<model>-<hash>.<target>)")
    b.add_argument("--prefill-buckets", type=_sizes, metavar="N,N,...",
                   help=f"prefill chunk sizes in tokens (default: {','.join(map(str, DEFAULT_PREFILL_BUCKETS))})")
    b.add_argument("--max-context", type=int, metavar="N",
                   help=f"the most tokens (prompt + generated) one sequence holds (default: {DEFAULT_MAX_CONTEXT}, "
                        "capped at max_position_embeddings)")
    b.add_argument("--batch-rows", type=_sizes, metavar="N,N,...",
                   help="sequence counts of the steps built; more than 1 serves several requests at once "
                        f"(continuous batching; default: {','.join(map(str, DEFAULT_BATCH_ROWS))})")
    b.add_argument("--kv-pages", type=int, help="pages in the KV arena (default: enough for the largest row count "
                                                  "at --max-context)")
    b.add_argument("--kv-block-size", type=int, help="tokens per KV page (default 16)")
    b.add_argument("--image-patch-buckets", type=_sizes, metavar="N,N,...",
                   help="a model with a vision encoder: image patches per encoder call; the largest bounds the "
                        f"patches of one image (default: {','.join(map(str, DEFAULT_IMAGE_PATCH_BUCKETS))})")
    b.add_argument("--legacy-paged-attention", action="store_true",
                   help="also build the legacy attention path that gathers each row's history from the pages first "
                        "(run it with RUDA_PAGED_ATTENTION=legacy)")
    b.add_argument("--mcpu", help="llvm: the CPU to compile for (default: this machine's CPU)")
    b.add_argument("--matmul-precision", choices=MATMUL_PRECISIONS,
                   help="llvm: float32 (default) keeps every product in float32; bfloat16 runs prefill products of "
                        "bfloat16 weights with the activations rounded to bfloat16, on AMX tiles or else AVX512-BF16 "
                        "dot products (several times faster prefill, bfloat16-level numerics; needs one of them); "
                        "auto: bfloat16 for a bfloat16 checkpoint on a CPU that has one, float32 otherwise; cuda: "
                        "bfloat16 runs them on tensor cores (nvcc or nvrtc path), auto picks that on those paths")
    b.add_argument("--arch", help=f"cuda: GPU architecture, one of {', '.join(ARCHS)} (default sm_90)")
    b.add_argument("--cuda-compiler", help=f"cuda: code path, one of {', '.join(COMPILERS)} (default: ${COMPILER_ENV}, "
                                           "else ptx = direct PTX through LLVM NVPTX)")
    b.add_argument("--ptx-version", help=f"cuda: PTX ISA version to emit, e.g. 7.8, 8.0, 8.3 (default: ${PTX_VERSION_ENV}, "
                                         "else the compiler's own)")
    b.add_argument("--force", action="store_true", help="rebuild even if the artifact is up to date")
    b.add_argument("--quiet", action="store_true", help="no progress output")
    add_debug_flag(b)
    u = sub.add_parser("bundle", help="ARTIFACT_DIR with its model and a runtime-only Python environment in one "
                                      "folder, OUT, that runs where there is no TVM and no network (OUT/run)")
    u.add_argument("artifact", metavar="ARTIFACT_DIR")
    u.add_argument("out", metavar="OUT")
    u.add_argument("--model", help="the checkpoint the artifact was built from (default: the manifest's built_from)")
    u.add_argument("--python", help="MAJOR.MINOR of the Python that will run the bundle (default: this one's)")
    u.add_argument("--no-weights", action="store_true",
                   help="leave the weights out (OUT/run ... --model DIR then names a checkpoint that has them)")
    u.add_argument("--wheel-cache", help="where the target Python's wheels are kept (default: $RUDA_WHEEL_CACHE, "
                                         "else ~/.cache/ruda/wheels); fetched with pip the first time")
    add_debug_flag(u)
    args = parser.parse_args(argv)
    if args.command == "bundle":
        from .bundle import bundle  # after the arguments are checked: loads TVM

        made = bundle(args.artifact, args.out, model_dir=args.model, python=args.python, weights=not args.no_weights,
                      wheel_cache=args.wheel_cache)
        print(json.dumps({"bundle": str(made.path), "bytes": made.bytes, "weights": made.weights}))
        return 0
    from .build import build  # after the arguments are checked: loads TVM

    result = build(args.model_dir, target=args.target, out=args.out, prefill_buckets=args.prefill_buckets,
                   max_context=args.max_context, mcpu=args.mcpu, arch=args.arch, cuda_compiler=args.cuda_compiler,
                   ptx_version=args.ptx_version, batch_rows=args.batch_rows, kv_pages=args.kv_pages,
                   kv_block=args.kv_block_size, image_patches=args.image_patch_buckets, legacy_attention=args.legacy_paged_attention,
                   matmul_precision=args.matmul_precision, force=args.force, quiet=args.quiet)
    print(json.dumps({"artifact": str(result.path), "reused": result.reused, "seconds": round(result.seconds, 2)}))
    return 0


if __name__ == "__main__":
    exit_cli(main)
