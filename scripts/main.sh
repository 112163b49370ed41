#!/usr/bin/env bash
# The main job: set up, then place the default model across 2 logical devices and run it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/placement demo "$@"
