#!/usr/bin/env bash
# Idempotent CPU set-up: creates .venv/ at the repo root and installs parallel3d
# with its test extras. torch is pinned to the 2.13.0 CPU build here; a looser
# spec can pull a multi-GB CUDA build. GPU users install their own CUDA torch
# first and then `pip install -e .[dev]`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "[setup] creating .venv"
    "$PY" -m venv .venv
fi
# Re-install only when the dependency spec changed (keeps the second run fast).
stamp_want="$(sha256sum pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ "$(cat .venv/.setup-stamp 2>/dev/null || true)" != "$stamp_want" ]; then
    echo "[setup] installing torch==2.13.0 (CPU) and parallel3d[dev,hf,megatron,report]"
    # (grep drops pip's per-package notes about this machine's local index mirrors)
    .venv/bin/pip install -q --disable-pip-version-check "torch==2.13.0" 2> >(grep -v "is ignored" >&2)
    .venv/bin/pip install -q --disable-pip-version-check -e ".[dev,hf,megatron,report]" "torch==2.13.0" \
        2> >(grep -v "is ignored" >&2)
    echo "$stamp_want" > .venv/.setup-stamp
fi
# Our packages' bytecode, compiled once. Where PYTHONDONTWRITEBYTECODE is set (it is on this project's
# machines) Python never writes it, so every process (each torchrun rank, each process a test starts)
# would compile the ~29k lines again: ~1 s CPU each. compileall redoes only the files that changed.
.venv/bin/python -m compileall -q parallel3d models kernels scripts tests > /dev/null
