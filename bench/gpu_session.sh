#!/usr/bin/env bash
# What one lent-GPU call runs: CUDA tests, the tuning probes, then the N256 benchmark.
# SKIP_TESTS / SKIP_PROBE / SKIP_BENCH=1 leave a part out; PROBE_ARGS go to profile_gpu.py.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench}
# By name from .whl/: pip takes the wheels that fit this Python and ignores the others.
# The tests and the benchmark need msgspec only (pyzmq: the daemon check), so a pyzmq wheel
# this machine cannot take costs nothing here.
if ! ls .whl/msgspec-*.whl >/dev/null 2>&1; then
  echo "no .whl/msgspec-*.whl: download the wheels and carry .whl (DEVELOPERS.md, GPU work)" >&2
  exit 1
fi
pip_install() {
  python3 -m pip install -q --no-index --find-links .whl --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$@"
}
pip_install msgspec || exit 1
pip_install pyzmq || echo "pyzmq did not install: bench/gpu_daemon_check.py will not run" >&2
export PYTHONPATH=src:/tmp/site PYTHONUNBUFFERED=1
if [ -z "${SKIP_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py -s 2>&1 | tee "$out/cuda_tests.log" | grep -E "passed|failed|^E " | tail -12
fi
if [ -z "${SKIP_PROBE:-}" ]; then
  python3 bench/profile_gpu.py ${PROBE_ARGS:-} 2>&1 | tee "$out/probe.log" | grep -vE "^ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ +[0-9]+ " | tail -40
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  SKIP_TESTS=1 bash bench/gpu.sh "$@" | tail -12
fi
