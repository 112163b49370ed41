#!/usr/bin/env bash
# The test suite: set up, lint, then pytest (fails if no test ran). The tests marked `slow` (real
# torchrun processes, benchmarks run as smoke tests, Hugging Face exports of every architecture) are
# left out; `bash scripts/test.sh -m slow` runs only them, `-m ""` everything (CI runs both).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check placement models tests benchmarks
# -n 2 --dist loadgroup: two workers; tests sharing a module-scoped fixture (xdist_group) stay on one
exec .venv/bin/python -m pytest -q -n 2 --dist loadgroup -m "not slow" "$@"
