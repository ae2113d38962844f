#!/usr/bin/env bash
# On the GPU machine (an NVIDIA driver and Python 3.12; no TVM, no compiler, no network needed): run the check that
# scripts/gpu_bundle.sh prepared in .gpu_check/payload.tar.gz (or $PAYLOAD). Each case runs in its own process with a
# timeout and appends one JSON line to $OUT/results.jsonl (default gpu_check_out/) as it ends; the last line sums up.
# The interpreter: $RUDA_PYTHON, else python3. GPU_CHECK_ONLY=PREFIX,.. runs only the cases so named (and env).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
OUT="${OUT:-$root/gpu_check_out}"
PYTHON="${RUDA_PYTHON:-python3}"
PAYLOAD=$(realpath "${PAYLOAD:-$root/.gpu_check/payload.tar.gz}")
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar xzf "$PAYLOAD" -C "$work" || { echo "error: cannot unpack $PAYLOAD: run scripts/gpu_bundle.sh first" >&2; exit 1; }
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
# The benchmark's 0.5B checkpoint (1 GB) is regenerated in $work, not in $OUT. The interpreter sees the bundle's
# packages alone (-E -S, as a bundle's launcher runs it): a host's torch would be imported by tvm_ffi in every case.
GPU_CHECK_WORK="$work" TVM_USE_RUNTIME_LIB=1 \
    "$PYTHON" -E -S "$work/payload/bundle/python/gpu_check.py" run "$work/payload" "$OUT"
