#!/usr/bin/env bash
# Sets up (idempotent) and runs the whole test suite. Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
.venv/bin/python -m pytest -q "$@"
rc=$?
set -e
# pytest exits 5 when no test was collected: that is a failure, not a pass.
if [ "$rc" -eq 5 ]; then echo "no tests were collected: failing" >&2; exit 1; fi
exit "$rc"
