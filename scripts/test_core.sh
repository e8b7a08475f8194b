#!/usr/bin/env bash
# The framework-free core's tests under another transformers release, in a venv of their own:
#   bash scripts/test_core.sh                          # transformers 5.10.4 (what veRL 0.9.1 resolves)
#   TRANSFORMERS="transformers==5.19.0" bash scripts/test_core.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
TRANSFORMERS="${TRANSFORMERS:-transformers==5.10.4}"
VENV=".venv-core-$(echo "$TRANSFORMERS" | tr -c 'A-Za-z0-9.\n' '-')"
if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0   # first and pinned: an unpinned torch pulls a CUDA build
    "$VENV/bin/pip" install -q "$TRANSFORMERS" peft "pytest>=8" "matplotlib>=3.8" "setuptools>=68"  # tests build a wheel; peft: test_lora
    "$VENV/bin/pip" install -q --no-deps -e .
fi
# the veRL engine is not installed here: its tests and the two benchmarks that run it stay out
exec "$VENV/bin/python" -m pytest -q tests --ignore=tests/integration --ignore=tests/test_main_job.py \
    --ignore=tests/test_bench_engine.py --ignore=tests/test_bench_tree.py "$@"
