#!/usr/bin/env bash
# GPU acceptance in one short run: the quick GPU tests, the offload benchmark (outputs against
# all-on-GPU, peak allocated and peak reserved GPU memory within the budget), and GPipe / 1F1B
# on two logical devices of one GPU (two GPUs too where there are two). Prints PASS/FAIL per
# step and a summary; exits 1 when a step failed. Without a CUDA GPU it says so and exits 0.
#
#   bash scripts/gpu-acceptance.sh
#   ACCEPTANCE_OFFLOAD_ARGS="--size large --gpu-budget 1GiB --repeats 3" bash scripts/gpu-acceptance.sh
#
# Each step runs under `timeout` (ACCEPTANCE_TESTS_TIMEOUT, ACCEPTANCE_OFFLOAD_TIMEOUT,
# ACCEPTANCE_GPIPE_TIMEOUT seconds); results go to ACCEPTANCE_OUT (default a temporary folder).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -f .gpu/bin/device-setup.sh ]; then
    # shellcheck disable=SC1091
    source .gpu/bin/device-setup.sh
fi
PYTHON="${PYTHON:-python3}"
export PYTHON
out="${ACCEPTANCE_OUT:-$(mktemp -d -t placement-acceptance.XXXXXX)}"
mkdir -p "$out"

if ! timeout 120 "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)"; then
    echo "gpu-acceptance: no CUDA GPU here: skipped"
    exit 0
fi

failed=()
step() {  # step <name> <command...>
    local name="$1"
    shift
    echo "=== gpu-acceptance: $name"
    "$@"
    local status=$?
    if [ "$status" -eq 0 ]; then
        echo "=== PASS: $name"
    else
        echo "=== FAIL: $name (exit $status$([ "$status" -eq 124 ] && echo ', timed out'))"
        failed+=("$name")
    fi
}

step "quick GPU tests" timeout "${ACCEPTANCE_TESTS_TIMEOUT:-420}" bash scripts/gpu-test.sh --quick
# shellcheck disable=SC2086
step "offload benchmark" timeout "${ACCEPTANCE_OFFLOAD_TIMEOUT:-300}" "$PYTHON" benchmarks/offload.py \
    ${ACCEPTANCE_OFFLOAD_ARGS:---repeats 3} --out "$out/offload.json"
step "offload: outputs and peak reserved memory within the budget" timeout 60 "$PYTHON" - "$out/offload.json" <<'PY'
import json
import sys

result = json.load(open(sys.argv[1]))
row, budget = result["rows"]["placement"], result["gpu_budget_bytes"]
# fp16 on both sides, host layers in fp32: a difference within 1% of the largest logit
relative = row["max_abs_diff"] / max(row["logit_scale"], 1e-12)
print(f"offload: max |diff| {row['max_abs_diff']:.3e} ({relative:.2e} of the largest logit); peak allocated "
      f"{row['peak_gpu_bytes']} B, peak reserved {row.get('peak_gpu_reserved_bytes')} B, budget {budget} B, "
      f"plan {row['plan_gpu_bytes']} B")
problems = []
if not relative <= 1e-2:
    problems.append("outputs differ from all-on-GPU by more than 1% of the largest logit")
if row["peak_gpu_bytes"] is None or row["peak_gpu_bytes"] > budget:
    problems.append("peak allocated GPU memory over the budget")
if row.get("peak_gpu_reserved_bytes") is None or row["peak_gpu_reserved_bytes"] > budget:
    problems.append("peak reserved GPU memory over the budget")
for problem in problems:
    print(f"offload: {problem}")
sys.exit(1 if problems else 0)
PY
step "GPipe and 1F1B on two logical devices" timeout "${ACCEPTANCE_GPIPE_TIMEOUT:-300}" "$PYTHON" scripts/gpu_gpipe_check.py

echo "gpu-acceptance: results in $out"
if [ "${#failed[@]}" -gt 0 ]; then
    printf 'gpu-acceptance: FAILED: %s\n' "${failed[@]}"
    exit 1
fi
echo "gpu-acceptance: all steps passed"
