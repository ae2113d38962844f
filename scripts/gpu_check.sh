#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and the CUDA toolkit: install the project, build the tiny models for
# cuda through every path, run the GPU correctness tests (logits vs transformers) and a short decode
# benchmark. Everything lands in $OUT (default ./gpu_check_out); summary.txt says what passed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_check_out}"
mkdir -p "$OUT"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
if ! (source scripts/venv.sh "[test]") > "$OUT/install.log" 2>&1; then
    echo "install: FAILED (see install.log)" > "$OUT/summary.txt"
    exit 1
fi
PY=.venv/bin/python
$PY -m pytest tests/test_gpu.py tests/test_cuda_build.py -q -rs > "$OUT/gpu_tests.log" 2>&1
tests=$?
$PY -m benchmarks.gpu_decode --work "$OUT/bench" > "$OUT/bench.json" 2> "$OUT/bench.log"
bench=$?
{
    echo "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
    echo "tests: $([ $tests -eq 0 ] && echo passed || echo FAILED) ($(tail -n 1 "$OUT/gpu_tests.log"))"
    echo "benchmark: $([ $bench -eq 0 ] && cat "$OUT/bench.json" || echo "FAILED (see bench.log)")"
} > "$OUT/summary.txt"
rm -rf "$OUT/bench"
cat "$OUT/summary.txt"
[ $tests -eq 0 ] && [ $bench -eq 0 ]
