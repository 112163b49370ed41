#!/usr/bin/env bash
# Create .venv (if missing) and install placement with its test extra, torch pinned by constraints.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.placement-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -c constraints.txt -e ".[test]"
    touch "$stamp"
fi

# System programs for pictures and their browser test: Graphviz's `dot` (pl.draw, `placement draw`,
# `placement report`) and Chromium (headless, tests/report/test_browser.py). Debian packages, installed
# when missing and apt-get can run (root, as in CI); set PLACEMENT_NO_APT=1 to skip. Without them,
# pictures fall back to .dot files and the browser test is skipped with its reason. Also tcmalloc, the
# allocator benchmarks/pipeline.py runs its contenders on when present (glibc otherwise; tests never need it).
need=()
command -v dot >/dev/null 2>&1 || need+=(graphviz)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
/sbin/ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal || need+=(libtcmalloc-minimal4)
if [ ${#need[@]} -gt 0 ] && [ -z "${PLACEMENT_NO_APT:-}" ] && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1; then
        apt-get update -qq >/dev/null 2>&1 || true
        apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
            || echo "setup: could not install ${need[*]} (pictures fall back to .dot files)" >&2
    fi
fi
