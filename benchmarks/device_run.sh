#!/usr/bin/env bash
# benchmarks/gpu_check.py on a lent GPU machine: the command the device tool's `run` executes from the repo root
# (how to call it, carry the wheels and keep the results: benchmarks/README.md, "GPU check on a lent machine").
#
#   OUT               the folder whose files come back (set by the device tool); required
#   GPU_CHECK_BUDGET  gpu_check's --budget-seconds, its imports included (default 360: a rerun still fits the
#                     15 device-minutes)
#   GPU_CHECK_ARGS    more gpu_check arguments, e.g. "--scale-seconds 120"
#
# Installs the wheels carried in .whl/ (flash-linear-attention 0.6.0 = flash-linear-attention + fla-core; the image
# has everything they need) into /tmp, prints the versions, restores a carried Triton cache (.whl/triton_cache.tgz.*),
# runs gpu_check into $OUT (report written after every row), then leaves the Triton cache in $OUT as
# triton_cache.tgz.* (15 MiB parts: a file over 16 MiB would not come back). Exits with gpu_check's status.
set -uo pipefail
: "${OUT:?set OUT to the folder whose files come back}"
budget="${GPU_CHECK_BUDGET:-360}"
site=/tmp/longstraw-site
log="$OUT/device_run.log"
export TRITON_CACHE_DIR=/tmp/triton-cache TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$TRITON_CACHE_DIR" "$site"

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        2>&1 | tee -a "$log" || echo "device_run: installing the carried wheels failed; running without them" | tee -a "$log"
fi
export PYTHONPATH=".:$site${PYTHONPATH:+:$PYTHONPATH}"

if compgen -G ".whl/triton_cache.tgz.*" >/dev/null; then
    cat .whl/triton_cache.tgz.* | tar -xz -C "$TRITON_CACHE_DIR" \
        || echo "device_run: the carried Triton cache did not unpack; compiling afresh" | tee -a "$log"
fi

python3 - <<'EOF' 2>&1 | tee -a "$log"
import importlib.metadata
import platform

import torch

gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none visible"
print(f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, GPU {gpu}")
for package in ("transformers", "triton", "flash-linear-attention", "fla-core", "einops"):
    try:
        print(f"{package} {importlib.metadata.version(package)}")
    except importlib.metadata.PackageNotFoundError:
        print(f"{package}: not installed")
try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    print("fla's chunk_gated_delta_rule imports")
except Exception as error:  # any failure: gpu_check then runs the plain torch rule
    print(f"fla's chunk_gated_delta_rule does not import: {type(error).__name__}: {error}")
EOF

# SIGINT a little past the budget (a CUDA backward cannot be interrupted earlier): the report on disk is complete
# up to the last row, and the Triton cache below is still saved.
timeout --signal=INT --kill-after=20 "$((budget + 75))" \
    python3 benchmarks/gpu_check.py --out "$OUT" --budget-seconds "$budget" ${GPU_CHECK_ARGS:-} 2>&1 | tee -a "$log"
status=${PIPESTATUS[0]}

if [ -n "$(ls -A "$TRITON_CACHE_DIR")" ]; then
    tar -C "$TRITON_CACHE_DIR" -cz . | split -b 15m - "$OUT/triton_cache.tgz."
fi
rm -f "$OUT"/*.partial
ls -l "$OUT" | tee -a "$log"
echo "device_run: gpu_check exited with status $status" | tee -a "$log"
exit "$status"
