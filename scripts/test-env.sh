#!/usr/bin/env bash
# The tests on one of CI's other environments (.ci/envs/NAME.txt): another Python, torch,
# transformers, onnx, onnxscript, onnx-ir, onnxruntime than the pinned .venv.
#
#   bash scripts/test-env.sh newest                         # the version-sensitive tests
#   bash scripts/test-env.sh gpu-image --all                # the whole suite
#   bash scripts/test-env.sh newest tests/external -x       # these tests (extra arguments go to pytest)
#   bash scripts/test-env.sh newest LANG=C OMP_NUM_THREADS=1 --all   # with these settings for the run
#
# Creates .venv-NAME from scratch when it is missing (the Python named by the file's
# `# python: X.Y` line: $PYTHON, else pythonX.Y on PATH, else pyenv's), installs `-e .[test]` and the
# extras its `# extras: a, b` line names (`vision`: torchvision and timm) under the file's constraints
# (again whenever pyproject.toml or the file is newer than the install), prints the versions it got,
# then runs pytest on 2 workers. PLACEMENT_ENV_UNPINNED=1 installs without the file's pins (the
# newest releases of the day) into .venv-NAME-unpinned.
# A machine-wide pip configuration (constraints capping torch) is bypassed: the env's file decides.
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: scripts/test-env.sh NAME [VAR=value ...] [--all | pytest arguments]}
shift
pins=.ci/envs/$name.txt
[ -f "$pins" ] || { echo "test-env: no $pins (envs: $(ls .ci/envs | sed 's/\.txt$//' | xargs))" >&2; exit 2; }

# VAR=value arguments: settings for the run (a locale, a thread count)
settings=()
while [ $# -gt 0 ] && [[ $1 =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do
    settings+=("$1")
    shift
done

version=$(sed -n 's/^# python: *\([0-9.]*\).*/\1/p' "$pins" | head -1)
[ -n "$version" ] || { echo "test-env: $pins has no '# python: X.Y' line" >&2; exit 2; }
extras=$(sed -n 's/^# extras: *//p' "$pins" | head -1 | tr -d ' ')
venv=.venv-$name
constraint=(-c "$pins")
if [ -n "${PLACEMENT_ENV_UNPINNED:-}" ]; then
    venv=$venv-unpinned
    constraint=()
fi
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1

start=$SECONDS
if [ ! -x "$venv/bin/python" ]; then
    py=${PYTHON:-}
    if [ -z "$py" ]; then
        # pythonX.Y on PATH (one that runs: a pyenv shim may not), else pyenv's own
        for candidate in "$(command -v "python$version" || true)" \
            "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version".*/bin/python"$version"; do
            if [ -z "$py" ] && [ -x "$candidate" ] && "$candidate" -c '' 2>/dev/null; then
                py=$candidate
            fi
        done
    fi
    [ -n "$py" ] || { echo "test-env: no python$version (set PYTHON=/path/to/python$version)" >&2; exit 2; }
    "$py" -m venv "$venv"
fi
stamp=$venv/.placement-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$pins" -nt "$stamp" ]; then
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q ${constraint[@]+"${constraint[@]}"} -e ".[test${extras:+,$extras}]"
    touch "$stamp"
fi
install_s=$((SECONDS - start))

"$venv/bin/python" - "$name" "$install_s" <<'PY'
import importlib.metadata as md
import platform
import sys

name, seconds = sys.argv[1], sys.argv[2]
dists = ["torch", "transformers", "onnx", "onnxscript", "onnx-ir", "onnxruntime-gpu", "onnxruntime"]
dists += ["torchvision", "timm"]  # the vision extra, where the env installs it
got = []
for dist in dists:
    try:
        got.append(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        pass
print(f"test-env {name}: python {platform.python_version()}, " + ", ".join(got) + f" (set up in {seconds} s)")
PY

# the tests that depend on versions and pass in every environment CI proves: export and saving
# (tests/graph), launch and distributed, the command line, the zoo, Hugging Face models and their
# mixture-of-experts exports, ONNX's node tests against the conformance lists (entries with
# version conditions: docs/testing.md), the torchvision/timm sweep (the `vision` extra; it skips
# without it), the README's examples, the demo. No `-m` here: `slow` tests run too.
# `--all` runs the whole suite (what CI runs in the gpu-image env).
default=(
    tests/test_ci_envs.py tests/graph tests/distributed tests/cli tests/models tests/external/test_moe.py
    tests/external/test_transformers.py tests/external/test_vision_sweep.py tests/conformance
    tests/test_readme.py tests/test_demo.py
)
args=()
paths=0
for arg in "$@"; do
    if [ "$arg" = --all ]; then
        paths=1
        continue
    fi
    [[ $arg != -* && -e ${arg%%::*} ]] && paths=1
    args+=("$arg")
done
[ "$paths" = 1 ] || args=("${default[@]}" ${args[@]+"${args[@]}"})
[ ${#settings[@]} -eq 0 ] || echo "test-env $name: with ${settings[*]}"
exec env ${settings[@]+"${settings[@]}"} "$venv/bin/python" -m pytest -q -n 2 --dist loadgroup \
    ${args[@]+"${args[@]}"}
