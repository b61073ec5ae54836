#!/usr/bin/env bash
# One command for a bare GPU machine with torch, triton and transformers but no network:
# installs the carried wheels (.whl/: msgspec, pyzmq), runs the CUDA tests, then the N256
# benchmark, writing its JSON (and logs) to ${OUT:-bench}.
#   bash bench/gpu.sh [bench_n256.py args...]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench}
if ls .whl/*.whl >/dev/null 2>&1; then  # by name: pip takes the wheels that fit this Python
  python3 -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site msgspec pyzmq || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -s 2>&1 | tee "$out/cuda_tests.log" | grep -E "rel err|passed|failed|Error|error" | tail -30
fi
python3 bench/bench_n256.py --json "$out/n256_h100.json" "$@" 2>&1 | tee "$out/bench.log" | tail -40
