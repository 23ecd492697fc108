#!/usr/bin/env bash
# The GPU check, run once on a lent CUDA machine (its own python3 with torch, cupy, numba):
#   1. every gpu-marked test (CUDA kernels vs the CPU path, the decode path on the device)
#      and the nvcc compile check of kernels/*.cu for sm_80 and sm_90;
#   2. `python -m bench.retrieval --part cuda` (score + select at 4K..512K tokens, the 50 us target).
# Usage: OUT=/some/dir bash bench/gpu_check.sh   (logs, JSON and the updated RESULTS.md land in $OUT)
# Each step has its own time limit and runs whatever the previous one did, so one failure still
# leaves the other results.
set -o pipefail
OUT=${OUT:?set OUT to a directory for the logs}
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PYTHON:-python3}

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  nvcc --version | tail -n 2
  $PY -c "import sys, torch, cupy, numpy, numba, transformers; print('python', sys.version.split()[0], \
'torch', torch.__version__, 'cupy', cupy.__version__, 'numpy', numpy.__version__, 'numba', numba.__version__, \
'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/env.txt"

timeout 300 $PY -m pytest -p no:cacheprovider -q -rA -m gpu \
  tests/test_kernels.py tests/test_cuda_decode.py 2>&1 | tee "$OUT/gpu-tests.txt"
echo "gpu tests exit: $?" | tee -a "$OUT/gpu-tests.txt"
timeout 90 $PY -m pytest -p no:cacheprovider -q -rA \
  "tests/test_kernels.py::test_cuda_sources_compile_to_cubin" 2>&1 | tee -a "$OUT/gpu-tests.txt"
echo "nvcc compile check exit: $?" | tee -a "$OUT/gpu-tests.txt"

# The CLI end to end on both devices, when a small model directory was carried along (an HF
# directory with a tokenizer, e.g. a randomly initialised 4-layer Llama with SmolLM2's tokenizer).
if [ -d .gpu-carry/tiny-smol ]; then
  for dev in cpu cuda; do
    echo "== spotlight generate --device $dev"
    SPOTLIGHT_HOME=/tmp/spotlight-home timeout 120 $PY -m spotlight generate --model .gpu-carry/tiny-smol \
      --prompt-file .gpu-carry/prompt.txt --max-new-tokens 48 --device $dev 2>&1 | tail -n 2
  done 2>&1 | tee "$OUT/cli.txt"
fi

[ -n "$SKIP_BENCH" ] && exit 0
timeout 180 $PY -m bench.retrieval --part cuda --json "$OUT/retrieval-cuda.json" 2>&1 | tee "$OUT/bench-cuda.txt"
echo "bench exit: $?" | tee -a "$OUT/bench-cuda.txt"
cp docs/RESULTS.md "$OUT/RESULTS.md"
