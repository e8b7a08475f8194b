#!/usr/bin/env bash
# The newest-releases environment (.ci/run's newest-releases check, scripts/test_newest.sh): torch at the tested
# pin (CPU), and the newest transformers and peft the registry serves, resolved when this runs (no pin: that is the
# point), with pytest and this repo (editable). No veRL or vLLM: the check runs the tests of the transformers and
# peft entry points the core calls (tests/upstream_surface.py), none of which needs them.
#
#   bash scripts/setup_newest_env.sh            # creates ./.venv-newest
#   VENV=/path/to/venv bash scripts/setup_newest_env.sh
#
# Re-running upgrades transformers and peft to whatever is newest then; torch is never touched once at the pin.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv-newest}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"  # the suite's pin (scripts/setup_cpu_env.sh)
PY="$VENV/bin/python"

log() { printf '[setup-newest] %s\n' "$*" >&2; }

if [[ ! -x "$PY" ]]; then
    log "creating venv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$PY" -m pip --disable-pip-version-check)
if ! "$PY" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
    log "installing torch==$TORCH_VERSION (CPU)"
    "${PIP[@]}" install -q "torch==$TORCH_VERSION"
fi
CONSTRAINTS="$VENV/longstraw-constraints.txt"
echo "torch==$("$PY" -c 'import torch; print(torch.__version__)')" > "$CONSTRAINTS"
log "installing the newest transformers and peft"
"${PIP[@]}" install -q --upgrade -c "$CONSTRAINTS" transformers peft pytest
"${PIP[@]}" install -q --no-deps -e "$REPO"
# flash-linear-attention on a CPU box makes transformers pick fla kernels and crash (as in setup_cpu_env.sh)
for pkg in flash-linear-attention fla-core; do
    if "${PIP[@]}" show "$pkg" >/dev/null 2>&1; then
        "${PIP[@]}" uninstall -y "$pkg"
    fi
done
"$PY" -c "import torch, transformers, peft; print(f'torch {torch.__version__}  transformers {transformers.__version__}  peft {peft.__version__}')"
