#!/usr/bin/env bash
# The whole test suite on a fresh machine: sets up what it needs, then lint,
# types and every test (unit, integration against real servers and engines).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
want=""
if compgen -G "tests/integration/vllm/test_*.py" >/dev/null; then want=vllm; fi
scripts/setup.sh $want
V=.venv/bin
echo "== ruff";  $V/ruff check kvsdk backends plugins tests
echo "== mypy";  $V/mypy
echo "== pytest"
set +e
$V/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    echo "pytest collected no tests: that is a failure for this project" >&2
    exit 1
fi
exit $rc
