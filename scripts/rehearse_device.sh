#!/usr/bin/env bash
# CPU rehearsal of the lent GPU machine's image: Python 3.12, torch 2.11.0 (PyPI's +cu130 build), triton 3.6.0,
# transformers 5.17.0; no veRL, no flash-linear-attention, no flash-attn; verl-longstraw NOT installed (run from
# the repo root with PYTHONPATH=.). Catches torch 2.11 / transformers 5.17 incompatibilities before device time.
#
#   bash scripts/rehearse_device.sh                # builds ./.venv-device once, then runs the checks
#   bash scripts/rehearse_device.sh --out DIR      # gpu_check's report into DIR (default: a fresh temp dir)
#   VENV=/path/to/venv PYTHON=/path/to/python3.12 bash scripts/rehearse_device.sh
#
# Checks, in that venv from the repo root with PYTHONPATH=.; exits non-zero when any fails (all run regardless):
# 1. imports of the torch-only package parts (IMPORTS below);
# 2. `benchmarks/gpu_check.py --tiny`: its exit status, and its JSON report read here: a row with an "error",
#    a row with "passed": false, a stage without one compared row, a stage error or a stage not run fails
#    (time-limit skips alone do not); one summary line per row is printed;
# 3. `pytest -q tests/ops tests/test_core_equivalence.py`. pytest is a rehearsal tool only: the image lacks it.
#
# PyPI's torch 2.11.0 is its CUDA 13.0 build: libtorch_cuda.so links cudart, cuBLAS, cuDNN, cuFFT, cuFile, cuRAND,
# cuSPARSE(+nvJitLink), cuSPARSELt, NCCL and NVSHMEM, so `import torch` fails without them even on CPU (checked:
# "ImportError: libcudnn.so.9"). torch goes in --no-deps, then its own requirements minus what a CPU process never
# loads: cuda-toolkit's cupti, cusolver (dlopen'ed by libtorch_cuda_linalg.so on first CUDA linalg call), nvrtc and
# nvtx, and cuda-bindings. That is about 1.6 GB of CUDA wheels instead of 1.9 GB; pip's conflict warnings about
# the left-out ones are silenced (--no-warn-conflicts). triton stays: the image has it.
# Re-running is cheap: the stamp and every step check what is already there.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv-device}"
PYTHON="${PYTHON:-$HOME/.pyenv/versions/3.12.1/bin/python}"
PYTHON_SERIES="3.12"
TORCH_VERSION="2.11.0"
TRANSFORMERS_VERSION="5.17.0"
PYTEST_VERSION="9.1.1"
STAMP="$VENV/.longstraw-device-ok"
PY="$VENV/bin/python"
# what the image lacks; a venv holding one of them rehearses a different machine
ABSENT=(verl verl-longstraw flash-linear-attention fla-core flash-attn)
# the torch-only package parts ("P.*": every module of package P)
IMPORTS=(verl_longstraw "verl_longstraw.ops.*" "verl_longstraw.parallel.*" verl_longstraw.estimate verl_longstraw.tiny
         verl_longstraw.testing)
# cuda-toolkit extras that a CPU `import torch` needs (libraries libtorch_cuda.so / libtorch_global_deps.so link)
CUDA_TOOLKIT_PARTS="cudart cublas cufft cufile curand cusparse nvjitlink"

log() { printf '[rehearse] %s\n' "$*" >&2; }

OUT=""
while (($#)); do
    case "$1" in
        --out) OUT="${2:?--out needs a directory}"; shift 2 ;;
        *) log "unknown argument $1 (usage: $0 [--out DIR])"; exit 2 ;;
    esac
done
OUT="${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/rehearse-device.XXXXXX")}"
mkdir -p "$OUT"

have() {  # have DIST VERSION: DIST is installed in $VENV at exactly VERSION (a local "+cu130" part allowed)
    "$PY" - "$1" "$2" <<'PYEOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
sys.exit(0 if version(sys.argv[1]).split("+")[0] == sys.argv[2] else 1)
PYEOF
}

python_series() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'; }

if [[ -x "$PY" && "$(python_series "$PY")" != "$PYTHON_SERIES" ]]; then
    log "$VENV runs Python $(python_series "$PY"), the image runs $PYTHON_SERIES: remove it or pick another VENV"
    exit 2
fi

if [[ -f "$STAMP" ]] && have torch "$TORCH_VERSION" && have transformers "$TRANSFORMERS_VERSION" \
        && have pytest "$PYTEST_VERSION" && "$PY" -c "import torch, transformers" >/dev/null 2>&1; then
    log "environment ready: $VENV"
else
    build_started=$SECONDS
    if [[ ! -x "$PY" ]]; then
        if [[ ! -x "$PYTHON" || "$(python_series "$PYTHON")" != "$PYTHON_SERIES" ]]; then
            log "PYTHON=$PYTHON is not a Python $PYTHON_SERIES interpreter: set PYTHON to one"
            exit 2
        fi
        log "creating venv $VENV ($("$PYTHON" --version))"
        "$PYTHON" -m venv "$VENV"
    fi
    PIP=("$PY" -m pip --disable-pip-version-check)
    INSTALL=("${PIP[@]}" install --no-warn-conflicts)

    # 1. torch without its requirements (they come in step 3, filtered); pinned, so nothing later replaces it.
    if ! have torch "$TORCH_VERSION"; then
        log "installing torch==$TORCH_VERSION --no-deps (PyPI's CUDA build, ~530 MB)"
        "${INSTALL[@]}" --no-deps "torch==$TORCH_VERSION"
    fi
    CONSTRAINTS="$VENV/longstraw-constraints.txt"
    echo "torch==$("$PY" -c 'from importlib.metadata import version; print(version("torch"))')" > "$CONSTRAINTS"

    # 2. transformers and what it needs (packaging, which step 3 reads torch's requirements with, among them).
    if ! have transformers "$TRANSFORMERS_VERSION"; then
        log "installing transformers==$TRANSFORMERS_VERSION"
        "${INSTALL[@]}" -c "$CONSTRAINTS" "transformers==$TRANSFORMERS_VERSION"
    fi

    # 3. torch's own Linux requirements, cuda-toolkit cut to CUDA_TOOLKIT_PARTS, cuda-bindings left out.
    TORCH_REQUIREMENTS="$VENV/longstraw-torch-requirements.txt"
    "$PY" - "$CUDA_TOOLKIT_PARTS" <<'PYEOF' > "$TORCH_REQUIREMENTS"
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

parts = set(sys.argv[1].split())
for line in requires("torch"):
    requirement = Requirement(line)
    if requirement.name == "cuda-bindings" or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
        continue  # cuda-bindings: Python CUDA bindings no CPU code loads; the rest: optional extras
    if requirement.name == "cuda-toolkit":
        if not parts <= requirement.extras:
            sys.exit(f"torch's cuda-toolkit requirement lacks {sorted(parts - requirement.extras)}: "
                     "update CUDA_TOOLKIT_PARTS in scripts/rehearse_device.sh")
        requirement.extras = parts
    requirement.marker = None
    print(requirement)
PYEOF
    log "installing torch's requirements for a CPU import: $(tr '\n' ' ' < "$TORCH_REQUIREMENTS")"
    "${INSTALL[@]}" -q -c "$CONSTRAINTS" -r "$TORCH_REQUIREMENTS"

    # 4. pytest: a rehearsal tool for step 3 of the checks, not part of the image.
    if ! have pytest "$PYTEST_VERSION"; then
        "${INSTALL[@]}" -q -c "$CONSTRAINTS" "pytest==$PYTEST_VERSION"
    fi

    for dist in "${ABSENT[@]}"; do
        if "${PIP[@]}" show "$dist" >/dev/null 2>&1; then
            log "removing $dist (the image lacks it)"
            "${PIP[@]}" uninstall -y "$dist"
        fi
    done
    "$PY" -c "import torch, transformers" || { log "import torch, transformers failed in $VENV"; exit 1; }
    touch "$STAMP"
    log "environment ready: $VENV (built in $((SECONDS - build_started)) s, $(du -sh "$VENV" | cut -f1))"
fi

cd "$REPO"
export PYTHONPATH="$REPO"
"$PY" - <<'PYEOF'
import sys

import torch
import transformers
import triton

print(f"python {sys.version.split()[0]}  torch {torch.__version__}  transformers {transformers.__version__}  "
      f"triton {triton.__version__}")
PYEOF

failed=()

log "1/3 imports of the torch-only package parts"
"$PY" - "${IMPORTS[@]}" <<'PYEOF' || failed+=(imports)
import importlib
import pkgutil
import sys
import traceback

names = []
for name in sys.argv[1:]:
    if name.endswith(".*"):
        package = importlib.import_module(name[:-2])
        names += [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]
    else:
        names.append(name)
broken = []
for name in names:
    try:
        importlib.import_module(name)
    except Exception:
        broken.append(name)
        traceback.print_exc()
print(f"imports: {len(names) - len(broken)}/{len(names)} ok" + (f"; FAILED: {broken}" if broken else ""))
sys.exit(1 if broken else 0)
PYEOF

log "2/3 benchmarks/gpu_check.py --tiny --out $OUT"
gpu_check_status=0
"$PY" benchmarks/gpu_check.py --tiny --out "$OUT" > "$OUT/gpu_check_tiny.stdout" || gpu_check_status=$?
"$PY" - "$OUT/gpu_check_tiny.json" "$gpu_check_status" <<'PYEOF' || failed+=(gpu_check)
import json
import sys
from pathlib import Path

STAGES = ("equivalence", "fsdp2", "ops", "scale")
KEYS = ("family", "dtype", "policy", "shape", "op", "model", "G", "path", "P")
report_path, status = Path(sys.argv[1]), int(sys.argv[2])
problems = [f"gpu_check exited with status {status}"] if status else []
report = json.loads(report_path.read_text()) if report_path.exists() else {}
if not report:
    problems.append(f"no report at {report_path}")
for stage in STAGES:
    rows = report.get(stage)
    if rows is None:
        if report:
            problems.append(f"{stage}: missing from the report")
        continue
    compared = 0
    for row in rows:
        what = " ".join(f"{k}={row[k]}" for k in KEYS if k in row)
        skipped = row.get("skipped")
        if skipped is not None:
            verdict = f"skipped: {skipped}"
            if "error" in str(skipped):
                problems.append(f"{stage} {what}: {skipped}")
        elif row.get("passed") is False:
            verdict = "FAILED"
            problems.append(f"{stage} {what}: passed false")
        else:
            compared += 1
            verdict = "passed" if "passed" in row else f"fits={row.get('fits')}"
        print(f"{stage:12s} {what:60s} {verdict}")
    if not compared:
        problems.append(f"{stage}: no row compared anything")
for key in ("stage_errors", "not_run"):  # gpu_check's own records (when it writes them): stages stopped, not run
    problems += [f"{stage}: {key.replace('_', ' ')}: {(text.strip().splitlines() or ['(no text)'])[-1]}"
                 for stage, text in report.get(key, {}).items()]
problems += [f"{stage}: gpu_check says it compared nothing" for stage in report.get("stages_that_compared_nothing", [])]
for problem in problems:
    print(f"gpu_check problem: {problem}")
sys.exit(1 if problems else 0)
PYEOF

log "3/3 pytest -q tests/ops tests/test_core_equivalence.py"
"$PY" -m pytest -q -p no:cacheprovider tests/ops tests/test_core_equivalence.py || failed+=(pytest)

if ((${#failed[@]})); then
    log "FAILED: ${failed[*]} (gpu_check's report and stdout: $OUT)"
    exit 1
fi
log "all checks passed (gpu_check's report: $OUT)"
