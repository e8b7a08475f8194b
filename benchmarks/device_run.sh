#!/usr/bin/env bash
# benchmarks/gpu_check.py on a lent GPU machine: the command the device tool's `run` executes from the repo root
# (how to call it, carry the wheels, rerun and keep the results: benchmarks/README.md, "GPU check on a lent machine").
#
#   bash benchmarks/device_run.sh                          # the whole check
#   bash benchmarks/device_run.sh --rerun-failed REPORT    # only the rows REPORT (a checked-in path) lacks or failed
#
#   OUT               the folder whose files come back (set by the device tool); required
#   GPU_CHECK_BUDGET  gpu_check's --budget-seconds, every stage's imports included (default 360 for the whole
#                     check, 240 for a rerun: both fit the 15 device-minutes together, benchmarks/README.md)
#   GPU_CHECK_ARGS    more gpu_check arguments, e.g. "--stages ops scale"
#
# Installs the wheels carried in .whl/ (flash-linear-attention 0.6.0 = flash-linear-attention + fla-core; the image
# has everything they need) into /tmp, restores a carried Triton cache (.whl/triton_cache.tgz.*, checked against its
# manifest), runs gpu_check into $OUT (the report rewritten after every stage; the versions are in it), then leaves
# the Triton cache in $OUT within what comes back (TRITON_CACHE_BYTES): the whole cache, or only its autotune
# results (the chosen configs recompile in seconds), or nothing, said in the log. Exits with gpu_check's status.
set -uo pipefail
: "${OUT:?set OUT to the folder whose files come back}"
rerun=()
if [[ "${1:-}" == "--rerun-failed" ]]; then
    rerun=(--rerun-failed "${2:?--rerun-failed needs the report gpu_check wrote}")
fi
budget="${GPU_CHECK_BUDGET:-$([[ ${#rerun[@]} -gt 0 ]] && echo 240 || echo 360)}"
site=/tmp/longstraw-site
log="$OUT/device_run.log"
# 8 files and 64 MiB come back: gpu_check.json, gpu_check.md, device_run.log, the cache's manifest, 4 cache parts
TRITON_CACHE_BYTES=$((56 * 1024 * 1024))
PART_BYTES=$((14 * 1024 * 1024))
export TRITON_CACHE_DIR=/tmp/triton-cache TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
mkdir -p "$OUT" "$TRITON_CACHE_DIR" "$site"

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
        2>&1 | tee -a "$log" || echo "device_run: installing the carried wheels failed; running without them" | tee -a "$log"
fi
export PYTHONPATH=".:$site${PYTHONPATH:+:$PYTHONPATH}"

if [[ -f .whl/triton_cache.tgz.manifest ]]; then
    if (cd .whl && sha256sum --quiet -c triton_cache.tgz.manifest) && cat .whl/triton_cache.tgz.?? \
            | tar -xz -C "$TRITON_CACHE_DIR"; then
        echo "device_run: restored the carried Triton cache ($(find "$TRITON_CACHE_DIR" -type f | wc -l) files)" \
            | tee -a "$log"
    else
        echo "device_run: the carried Triton cache is incomplete or does not unpack; compiling afresh" | tee -a "$log"
    fi
fi

# gpu_check ends within its budget (a hung stage is killed inside it); the timeout is a last resort
timeout --signal=TERM --kill-after=10 "$((budget + 30))" \
    python3 benchmarks/gpu_check.py --out "$OUT" --budget-seconds "$budget" "${rerun[@]}" ${GPU_CHECK_ARGS:-} 2>&1 \
    | tee -a "$log"
status=${PIPESTATUS[0]}

if [[ -n "$(ls -A "$TRITON_CACHE_DIR")" ]]; then
    tar -C "$TRITON_CACHE_DIR" -cz . > /tmp/triton_cache.tgz
    kept="the whole cache"
    if (($(stat -c %s /tmp/triton_cache.tgz) > TRITON_CACHE_BYTES)); then
        (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' -print0 | tar --null -T - -cz) > /tmp/triton_cache.tgz
        kept="its autotune results only (the whole cache is over $((TRITON_CACHE_BYTES >> 20)) MiB)"
    fi
    if (($(stat -c %s /tmp/triton_cache.tgz) > TRITON_CACHE_BYTES)); then
        echo "device_run: the Triton cache is not kept: even its autotune results are over" \
             "$((TRITON_CACHE_BYTES >> 20)) MiB" | tee -a "$log"
    else
        (cd "$OUT" && split -b "$PART_BYTES" /tmp/triton_cache.tgz triton_cache.tgz. \
            && sha256sum triton_cache.tgz.?? > triton_cache.tgz.manifest)
        echo "device_run: kept $kept of the Triton cache in $(ls "$OUT"/triton_cache.tgz.?? | wc -l) part(s)" \
            | tee -a "$log"
    fi
fi
rm -f "$OUT"/*.partial
ls -l "$OUT" | tee -a "$log"
echo "device_run: gpu_check exited with status $status" | tee -a "$log"
exit "$status"
