#!/usr/bin/env bash
# On the build machine: prepare the one-shot GPU check in .gpu_check/payload.tar.gz (small enough to carry to the GPU
# machine, where scripts/gpu_run.sh runs it), then rehearse it here under Python 3.12 with a stand-in NVIDIA driver:
# everything but kernel execution. The rehearsal's results land in .gpu_check/rehearsal/results.jsonl.
#     scripts/gpu_bundle.sh [--no-rehearse]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/venv.sh "[test]"
DIR=.gpu_check
MAX_BYTES=$((60 * 1024 * 1024))  # the device takes at most 64 MiB of carried files
rm -rf "$DIR/payload" "$DIR/payload.tar.gz" "$DIR/rehearsal"
mkdir -p "$DIR"
.venv/bin/python -m benchmarks.gpu_check prepare "$DIR/payload"
tar czf "$DIR/payload.tar.gz" --exclude=__pycache__ -C "$DIR" payload
bytes=$(stat -c %s "$DIR/payload.tar.gz")
echo "payload: $DIR/payload.tar.gz, $((bytes / 1024 / 1024)) MiB"
if [ "$bytes" -gt "$MAX_BYTES" ]; then
    echo "error: the payload is over $((MAX_BYTES / 1024 / 1024)) MiB; it cannot be carried" >&2
    exit 1
fi
[ "${1:-}" = "--no-rehearse" ] && exit 0

python312=$(.venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); from test_bundle import other_python; print(other_python() or '')")
if [ -z "$python312" ]; then
    echo "error: no Python 3.12 here to rehearse with (pyenv, uv or python3.12 on PATH)" >&2
    exit 1
fi
.venv/bin/python tests/cuda_standin.py "$DIR/standin" > /dev/null
# The stand-in driver claims one GPU, so every case runs up to its first GPU call and fails there; the CPU cases
# (the same model checks on the CPU artifacts) must pass.
LD_LIBRARY_PATH="$PWD/$DIR/standin" RUDA_STANDIN_DEVICES=1 GPU_CHECK_CPU_CASES=1 RUDA_PYTHON="$python312" \
    OUT="$DIR/rehearsal" scripts/gpu_run.sh > "$DIR/rehearsal.log" 2>&1 || true
.venv/bin/python -m benchmarks.gpu_check check-rehearsal "$DIR/rehearsal/results.jsonl" "$DIR/payload"
