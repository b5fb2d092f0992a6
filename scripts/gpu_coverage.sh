#!/bin/bash
# Line coverage of the GPU backends (dtorch_mpi/comm/gpu.py, gpu_select.py, nccl_backend.py,
# staging.py: what comm/gpu.py held before it was split) on the emulated device (tests/emulated_cupy, a test
# double of CuPy and NCCL, not a GPU): the CPU tests of the GPU path at 1 and 2 ranks, then
# tests/test_gpu.py and test_redistribute.py with --device emulated at 1 and 2 ranks per
# backend, each rank under `coverage run --parallel-mode`, combined into one report.
# Needs coverage.py importable by $PYTHON (e.g. pip install --target DIR coverage; PYTHONPATH=DIR).
set -eu
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
MPIEXEC=${MPIEXEC:-$(dirname "$PY")/mpiexec}
DATA=${GPU_COVERAGE_DATA:-.coverage-gpu}
rm -rf "$DATA"; mkdir -p "$DATA"
RC="$DATA/rc"
printf '[run]\nparallel = True\ninclude = */dtorch_mpi/comm/gpu.py,*/dtorch_mpi/comm/gpu_select.py,*/dtorch_mpi/comm/nccl_backend.py,*/dtorch_mpi/comm/staging.py\ndata_file = %s/.coverage\n' "$PWD/$DATA" > "$RC"
export COVERAGE_RCFILE="$PWD/$RC" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
cov() { "$PY" -m coverage run -m pytest -q -p no:cacheprovider "$@" | tail -1; }
cov_mpi() { "$MPIEXEC" -n 2 tests/rank_wrapper.sh "$PY" -m coverage run -m pytest -q -p no:cacheprovider --with-mpi "$@" \
  | grep -E "passed|failed" | tail -1; }
cov tests/test_gpu.py tests/test_comm.py
cov_mpi tests/test_gpu.py tests/test_comm.py
for backend in nccl cuda-aware-mpi host-staging; do
  echo "== DTORCH_GPU_BACKEND=$backend --device emulated"
  DTORCH_GPU_BACKEND=$backend cov --device emulated tests/test_gpu.py tests/test_redistribute.py
  DTORCH_GPU_BACKEND=$backend cov_mpi --device emulated tests/test_gpu.py tests/test_redistribute.py
done
"$PY" -m coverage combine -q
"$PY" -m coverage report -m
