#!/usr/bin/env bash
# Sets up (idempotent) and runs the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
# Two pytest workers (pytest-xdist): multi-rank tests spend much of their time in start-up and
# gloo round trips, so a second worker fills the idle core. P3D_TEST_WORKERS=0 runs in one process;
# a later `-n K` in "$@" overrides this one. xdist's default `load` scheduling: `--dist loadfile` (a
# file's module-scoped runs made once) measured slower here (clean-clone CI, session 46: 1160 s vs 817 s).
.venv/bin/python -m pytest -q -n "${P3D_TEST_WORKERS:-2}" "$@"
rc=$?
set -e
# pytest exits 5 when no test was collected: that is a failure, not a pass.
if [ "$rc" -eq 5 ]; then echo "no tests were collected: failing" >&2; exit 1; fi
exit "$rc"
