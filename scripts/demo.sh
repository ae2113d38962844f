#!/usr/bin/env bash
# Set up, generate a tiny random-weight Qwen2 checkpoint, compile it for this CPU, and generate from it.
source "$(dirname "$0")/venv.sh" ""
MODEL=models/demo-qwen2
[ -f "$MODEL/config.json" ] || .venv/bin/python -m models.tiny "$MODEL" --arch qwen2 --seed 0
.venv/bin/python -m compiler build "$MODEL" --target llvm
.venv/bin/python -m runtime.generate "$MODEL" "${1:-Hello}" "${2:-32}" "${3:-1}"
