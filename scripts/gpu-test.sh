#!/usr/bin/env bash
# The test suite on a GPU machine: every GPU test collected first (a test module that does not
# import, or a fixture that does not exist, fails at once and is listed), the quick GPU tests,
# then the slow ones, then the rest of the suite and `placement demo` on the GPU.
#
# On a machine with no package registry (the GPU image: torch with CUDA, onnxruntime CPU build),
# onnxruntime-gpu travels in parts, prepared beforehand with `bash ../shared/gpu/prepare.sh`
# (fills .gpu/) and assembled by .gpu/bin/device-setup.sh once all four parts have arrived;
# this script sources it when it is there. Elsewhere it runs with $PYTHON (default python3).
#
#   bash scripts/gpu-test.sh            # collect, quick GPU tests, slow GPU tests, the rest, demo
#   bash scripts/gpu-test.sh --gpu      # collect, quick then slow GPU tests
#   bash scripts/gpu-test.sh --quick    # collect, quick GPU tests only
#   GPU_TEST_WORKERS=4 bash scripts/gpu-test.sh --gpu -k streaming   # extra arguments go to pytest
#
# Every step runs under `timeout` (GPU_TEST_COLLECT_TIMEOUT, GPU_TEST_QUICK_TIMEOUT,
# GPU_TEST_SLOW_TIMEOUT, GPU_TEST_REST_TIMEOUT seconds). Without a CUDA GPU it collects the GPU
# tests, says that nothing can run here, and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .gpu/bin/device-setup.sh ]; then
    # shellcheck disable=SC1091
    source .gpu/bin/device-setup.sh
fi
PYTHON="${PYTHON:-python3}"
mode=full
case "${1:-}" in
    --quick) mode=quick; shift ;;
    --gpu) mode=gpu; shift ;;
esac
workers=(-n "${GPU_TEST_WORKERS:-8}")
"$PYTHON" -c "import xdist" 2>/dev/null || workers=()

# What this machine has: torch's GPUs, and whether an ONNX Runtime session asked for CUDA
# really runs there (ONNX Runtime lists the provider even where it cannot load).
set +e
timeout 120 "$PYTHON" - <<'PY'
import sys

import torch

gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
line = f"gpu-test: torch {torch.__version__}, {gpus} GPU(s)"
if gpus:
    line += f" ({torch.cuda.get_device_name(0)})"
try:
    import onnxruntime as ort

    from placement.runtime.ort.sessions import cuda_provider_error

    listed = ort.get_available_providers()
    real = None
    if gpus and "CUDAExecutionProvider" in listed:
        from onnx import TensorProto, helper

        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
        graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "probe", [x], [y])
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
        session = ort.InferenceSession(proto.SerializeToString(), providers=listed)
        real = session.get_providers()[0]
    line += f"; onnxruntime {ort.__version__} lists {listed}"
    if real is not None:
        line += f", a CUDA session runs on {real}"
        if real != "CUDAExecutionProvider":
            line += f" ({cuda_provider_error()}): the ONNX Runtime GPU tests will fail"
except ImportError as err:
    line += f"; no onnxruntime ({err})"
print(line)
sys.exit(0 if gpus else 3)
PY
probe=$?
set -e
if [ "$probe" -ne 0 ] && [ "$probe" -ne 3 ]; then
    echo "gpu-test: the probe failed (exit $probe)" >&2
    exit "$probe"
fi

# Collect every GPU test first: import errors and broken fixtures fail here, all of them listed.
collected="$(mktemp)"
trap 'rm -f "$collected"' EXIT
set +e
timeout "${GPU_TEST_COLLECT_TIMEOUT:-900}" "$PYTHON" -m pytest --collect-only -q -p no:cacheprovider \
    -m gpu tests "$@" >"$collected" 2>&1
status=$?
set -e
if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then
    echo "gpu-test: collecting the GPU tests failed (exit $status):" >&2
    grep -E "^(ERROR|E   )" "$collected" >&2 || tail -n 40 "$collected" >&2
    exit 1
fi
echo "gpu-test: $(grep -cE '::' "$collected" || true) GPU tests collected"

if [ "$probe" -eq 3 ]; then
    echo "gpu-test: no CUDA GPU here: the GPU tests are skipped (nothing else to do)"
    exit 0
fi

run() {  # run <timeout-variable> <default seconds> <marker expression> [pytest arguments]
    local limit="${!1:-$2}" marks="$3"
    shift 3
    echo "gpu-test: pytest -m '$marks' (at most ${limit} s)"
    timeout "$limit" "$PYTHON" -m pytest -q -p no:cacheprovider "${workers[@]}" -m "$marks" tests "$@"
}

run GPU_TEST_QUICK_TIMEOUT 900 "gpu and not slow" "$@"
[ "$mode" = quick ] && exit 0
run GPU_TEST_SLOW_TIMEOUT 1800 "gpu and slow" "$@"
[ "$mode" = gpu ] && exit 0
run GPU_TEST_REST_TIMEOUT 3600 "not gpu" "$@"
timeout 600 "$PYTHON" -m placement.cli demo
