#!/usr/bin/env bash
# CPU rehearsal of the lent GPU machine's image: Python 3.12, torch 2.11.0 (PyPI's +cu130 build), triton 3.6.0,
# transformers 5.17.0; no veRL, no flash-linear-attention, no flash-attn; verl-longstraw NOT installed (run from
# the repo root with PYTHONPATH=.). Catches torch 2.11 / transformers 5.17 incompatibilities before device time.
#
#   bash scripts/rehearse_device.sh                # builds ./.venv-device once, then runs the checks
#   bash scripts/rehearse_device.sh --out DIR      # gpu_check's reports into DIR (default: a fresh temp dir)
#   VENV=/path/to/venv PYTHON=/path/to/python3.12 bash scripts/rehearse_device.sh
#
# Checks, in that venv from the repo root; exits non-zero when any fails (all run regardless):
# 1. imports of the torch-only package parts (IMPORTS below);
# 2. the device run as the lent machine runs it, at tiny sizes on the CPU: `benchmarks/device_run.sh` with
#    GPU_CHECK_ARGS=--tiny and the lent machine's budget (360 s) scaled to this CPU's speed: times
#    max(1, this CPU's seconds of gpu_check's calibration row / the lent GPU's, `gpu_check.py --calibrate`).
#    It must compare every row of every stage (every case, in the run's order: ops, scale, then equivalence and
#    fsdp2 newest case first, bfloat16 -> autocast -> float32) and pass every float32 and ops verdict; a failed
#    half-precision equivalence or FSDP2 verdict is printed as a note (they compare the largest log-prob error over
#    a few tokens, which this CPU's bf16 kernels decide: with AVX2-only kernels 3 of 42 such rows went over); one
#    summary line per row;
# 3. the rerun: the report of 2 with the rows of its two newest cases taken out, rerun with
#    `device_run.sh --rerun-failed REPORT` and GPU_CHECK_ARGS="--tiny --stages equivalence fsdp2 --families <them>":
#    only those rows run, and the merged report is complete;
# 4. `pytest -q tests/ops tests/test_core_equivalence.py::test_exact_gradient_float64`: the ops against their
#    references on the image's torch, and every family's float64 exact gradient on its transformers (step 2 already
#    compares every case's log-probs and gradients with the standard path at three dtypes, so the rest of the
#    equivalence file, which the suite runs, is not run twice); and the dry run on fake CUDA tensors with its torch
#    pieces (tests/test_fake_cuda.py, tests/test_dryrun.py: private torch names the image's release must still have).
#    pytest is a rehearsal tool only: the image lacks it.
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
         verl_longstraw.model_terms verl_longstraw.gpu_table verl_longstraw.fake_cuda verl_longstraw.dryrun verl_longstraw.models
         verl_longstraw.testing verl_longstraw.testing.compare verl_longstraw.testing.scripts
         verl_longstraw.testing.fsdp_probe)
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

log "1/4 imports of the torch-only package parts"
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

DEVICE_BUDGET=360  # benchmarks/device_run.sh's first run on the lent machine
log "2/4 the device run at tiny sizes, the lent machine's budget scaled to this CPU"
calibration="$("$PY" benchmarks/gpu_check.py --tiny --calibrate | tail -n 1)" || calibration=""
if [[ -z "$calibration" ]]; then
    log "gpu_check --calibrate failed"
    failed+=(calibration)
    budget=$((4 * DEVICE_BUDGET))
else
    budget="$("$PY" -c 'import json, math, sys; c = json.loads(sys.argv[1]); print(math.ceil(c["budget_scale"] * int(sys.argv[2])))' "$calibration" "$DEVICE_BUDGET")"
    log "calibration: $calibration -> budget $budget s"
fi
mkdir -p "$OUT/run" "$OUT/rerun"
run_status=0
export PATH="$VENV/bin:$PATH"  # device_run.sh runs `python3`, the image's
OUT="$OUT/run" GPU_CHECK_BUDGET="$budget" GPU_CHECK_ARGS="--tiny" bash benchmarks/device_run.sh \
    > "$OUT/run.stdout" 2>&1 || run_status=$?
# every planned row compared and passed, in the run's order; one line per row
"$PY" - "$OUT/run/gpu_check_tiny.json" "$run_status" <<'PYEOF' || failed+=(device_run)
import json
import sys
from pathlib import Path

sys.path[:0] = [".", "benchmarks"]
from gpu_check import EQUIVALENCE_DTYPES, STAGES  # noqa: E402
from gpu_check_stages import CASES_NEWEST_FIRST  # noqa: E402

report_path, status = Path(sys.argv[1]), int(sys.argv[2])
problems = [f"device_run.sh exited with status {status}"] if status else []
report = json.loads(report_path.read_text()) if report_path.exists() else {}
if not report:
    problems.append(f"no report at {report_path}")
else:
    if report["stage_order"] != list(STAGES):
        problems.append(f"stages ran in the order {report['stage_order']}, not {list(STAGES)}")
    for stage in STAGES:
        for row in report.get(stage, []):
            verdict = row.get("skipped") or ("passed" if row.get("passed", row.get("fits") is not None) else "FAILED")
            print(f"{stage:12s} {row['key']:60s} {verdict}")
        for key in report["never_compared"].get(stage, []):
            problems.append(f"{stage} {key}: never compared")
        for key in report["failed"].get(stage, []):
            if stage == "fsdp2" or (stage == "equivalence" and not key.endswith(" float32")):
                # a half-precision verdict over the largest log-prob error of a few tokens: this CPU's kernels decide
                print(f"note: {stage} {key}: failed its half-precision verdict (reported, not a rehearsal failure)")
            else:
                problems.append(f"{stage} {key}: failed")
        if not report["planned"].get(stage):
            problems.append(f"{stage}: no row planned")
    for stage, text in report["stage_errors"].items():
        problems.append(f"{stage}: {(text.strip().splitlines() or ['(no text)'])[-1]}")
    expected = [f"{case} {dtype}" for case in CASES_NEWEST_FIRST for dtype in EQUIVALENCE_DTYPES]
    if report["planned"].get("equivalence") != expected:
        problems.append("the equivalence rows are not every case newest first, bfloat16 -> autocast -> float32")
    if report["planned"].get("fsdp2") != list(CASES_NEWEST_FIRST):
        problems.append("the fsdp2 rows are not every case newest first")
    print(f"seconds per stage: { {k: round(v) for k, v in report['stage_seconds'].items()} } of budget "
          f"{report['budget_seconds']:.0f}")
for problem in problems:
    print(f"device run problem: {problem}")
sys.exit(1 if problems else 0)
PYEOF

log "3/4 the rerun of the rows a report lacks"
REMOVED=(gpt_oss granitemoehybrid)  # the two newest cases
"$PY" - "$OUT/run/gpu_check_tiny.json" "$OUT/partial.json" "${REMOVED[@]}" <<'PYEOF' || failed+=(rerun)
import json
import sys
from pathlib import Path

report = json.loads(Path(sys.argv[1]).read_text())
removed = set(sys.argv[3:])
report["equivalence"] = [r for r in report["equivalence"] if r["family"] not in removed]  # lacked
report["fsdp2"] = [{**r, "passed": False} if r["family"] in removed else r for r in report["fsdp2"]]  # failed
Path(sys.argv[2]).write_text(json.dumps(report))
PYEOF
# the rerun runs the removed cases and those with a row this CPU's half-precision numerics failed in the first run
# (step 2 noted them): a failed row is one a rerun runs again
mapfile -t RERUN < <("$PY" - "$OUT/run/gpu_check_tiny.json" "${REMOVED[@]}" <<'PYEOF'
import json
import sys
from pathlib import Path

report = json.loads(Path(sys.argv[1]).read_text())
failed = {r["family"] for stage in ("equivalence", "fsdp2") for r in report[stage] if r["key"] in report["failed"][stage]}
print("\n".join(dict.fromkeys([*sys.argv[2:], *sorted(failed)])))
PYEOF
)
rerun_status=0
OUT="$OUT/rerun" GPU_CHECK_BUDGET="$budget" \
    GPU_CHECK_ARGS="--tiny --stages equivalence fsdp2 --families ${RERUN[*]}" \
    bash benchmarks/device_run.sh --rerun-failed "$OUT/partial.json" > "$OUT/rerun.stdout" 2>&1 || rerun_status=$?
"$PY" - "$OUT/run/gpu_check_tiny.json" "$OUT/rerun/gpu_check_tiny.json" "$rerun_status" "${RERUN[@]}" \
    <<'PYEOF' || failed+=(rerun)
import json
import sys
from pathlib import Path

first, rerun = (json.loads(Path(p).read_text()) for p in sys.argv[1:3])
status, removed = int(sys.argv[3]), set(sys.argv[4:])  # removed: the cases the rerun ran
problems = [f"the rerun exited with status {status}"] if status else []
for stage in ("equivalence", "fsdp2"):
    if [r["key"] for r in rerun[stage]] != first["planned"][stage]:
        problems.append(f"{stage}: the merged rows are not the first run's planned rows in order")
    ran = {r["key"] for r in rerun[stage] if r["family"] in removed}
    kept = [r for r in rerun[stage] if r["family"] not in removed]
    if kept != [r for r in first[stage] if r["family"] not in removed]:
        problems.append(f"{stage}: the rows that had passed were not carried over as they were")
    half = [k for k in rerun["failed"][stage] if stage == "fsdp2" or not k.endswith(" float32")]
    for key in half:  # as in step 2: this CPU's kernels decide a half-precision verdict
        print(f"note: rerun {stage} {key}: failed its half-precision verdict (reported, not a rehearsal failure)")
    if any(rerun["never_compared"][stage]) or set(rerun["failed"][stage]) - set(half):
        problems.append(f"{stage}: not complete after the rerun: {rerun['never_compared'][stage]}, "
                        f"{sorted(set(rerun['failed'][stage]) - set(half))}")
    print(f"rerun {stage}: {len(ran)} rows run ({', '.join(sorted(ran))}), {len(kept)} carried over")
for stage in ("ops", "scale"):  # not selected: carried over as they were
    if rerun[stage] != first[stage] or stage in rerun["stage_seconds"]:
        problems.append(f"{stage}: not carried over as it was")
for problem in problems:
    print(f"rerun problem: {problem}")
sys.exit(1 if problems else 0)
PYEOF

log "4/4 pytest -q tests/ops tests/test_core_equivalence.py::test_exact_gradient_float64 tests/test_fake_cuda.py tests/test_dryrun.py"
"$PY" -m pytest -q -p no:cacheprovider tests/ops tests/test_core_equivalence.py::test_exact_gradient_float64 \
    tests/test_fake_cuda.py tests/test_dryrun.py || failed+=(pytest)

if ((${#failed[@]})); then
    log "FAILED: ${failed[*]} (gpu_check's reports and output: $OUT)"
    exit 1
fi
log "all checks passed (gpu_check's reports and output: $OUT)"
