#!/usr/bin/env bash
# The whole test suite on a GPU machine, the `gpu` tests included, then the main job on the GPU.
#
# On a machine with no package registry (the GPU image: torch with CUDA, onnxruntime CPU build),
# onnxruntime-gpu travels in parts, prepared beforehand with `bash ../shared/gpu/prepare.sh`
# (fills .gpu/) and assembled by .gpu/bin/device-setup.sh once all four parts have arrived;
# this script sources it when it is there. Elsewhere it runs with the python3 on PATH.
#
#   bash scripts/gpu-test.sh                 # the suite with 8 workers, then `placement demo`
#   bash scripts/gpu-test.sh -m gpu          # only the GPU tests (extra arguments go to pytest)
#   GPU_TEST_WORKERS=4 bash scripts/gpu-test.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .gpu/bin/device-setup.sh ]; then
    # shellcheck disable=SC1091
    source .gpu/bin/device-setup.sh
fi
python3 - <<'PY'
import sys

import onnxruntime
import torch

gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
providers = onnxruntime.get_available_providers()
print(f"gpu-test: torch {torch.__version__}, {gpus} GPU(s)"
      + (f" ({torch.cuda.get_device_name(0)})" if gpus else "")
      + f"; onnxruntime {onnxruntime.__version__} {providers}")
if not gpus or "CUDAExecutionProvider" not in providers:
    sys.exit("gpu-test: needs torch with a CUDA GPU and onnxruntime's CUDAExecutionProvider "
             "(onnxruntime-gpu: see ../shared/gpu/README.md)")
PY
python3 -m pytest -q -p no:cacheprovider -n "${GPU_TEST_WORKERS:-8}" tests "$@"
python3 -m placement.cli demo
