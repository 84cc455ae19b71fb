#!/usr/bin/env bash
# The test command: set up .venv if needed, lint, then run the whole suite.
# Extra arguments go to pytest, e.g. `bash launch/test.sh -k topology -x`.
set -eo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
ruff check mt3d tests
ruff format --check mt3d tests
python -m pytest "$@"
