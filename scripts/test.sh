#!/usr/bin/env bash
# Set up (venv with the test extra: torch CPU, transformers) and run the whole test suite.
source "$(dirname "$0")/venv.sh" "[test]"
exec .venv/bin/python -m pytest "$@"
