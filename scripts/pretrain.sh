#!/usr/bin/env bash
# README command 1: set up (idempotent) and run the default job: gpt_tiny on the built-in
# corpus (Python's documentation, byte-level BPE trained locally), one process on CPU or
# one GPU. Extra key=value arguments override the config, e.g. `bash scripts/pretrain.sh train.steps=50`.
# Output: runs/gpt_tiny/ (metrics.jsonl, checkpoints/, .hydra/). A second run resumes from
# the newest checkpoint there (train.resume=auto); pass train.resume=none to start over.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m parallel3d.train "$@"
