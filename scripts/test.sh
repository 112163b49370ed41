#!/usr/bin/env bash
# The whole test suite: set up, lint, then pytest (fails if no test ran).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check placement models tests benchmarks
# -n 2 --dist loadgroup: two workers; tests sharing a module-scoped fixture (xdist_group) stay on one
exec .venv/bin/python -m pytest -q -n 2 --dist loadgroup "$@"
