#!/bin/bash
# GPU check for dtorch_mpi on a machine with one NVIDIA GPU and no internet.
# Needs CuPy and mpi4py (NCCL optional); an `mpiexec` on PATH, or the `mpich` wheel carried
# along as a file: MPICH_WHEEL=/path/to/mpich-*.whl scripts/gpu_check.sh
# Runs the same device tests CI runs on the emulated device (make test-gpu-emulated: pytest
# --device emulated), here with `--device cuda` on the real GPU: at world size 1; with 2 ranks
# sharing one GPU over host staging (NCCL refuses two ranks on
# one GPU); over NCCL with one rank per GPU when there are several. Then the short GPU
# benchmark (bench_gpu.py, against raw CuPy/NCCL), and a summary. Bounded to 10 minutes in all.
# GPU_CHECK_DEVICE=emulated runs the whole script on the emulated device (tests/emulated_cupy,
# a test double of CuPy and NCCL, not a GPU): a dry run that this script itself works.
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DEVICE" = emulated ]; then
  export PYTHONPATH="$PWD/tests/emulated_cupy:$PYTHONPATH" DTORCH_EMULATED_GPUS=${DTORCH_EMULATED_GPUS:-2}
  echo "*** EMULATED DEVICE (test double): nothing below is a GPU result"
fi
DEADLINE=$(( $(date +%s) + 590 ))
TESTS="tests/test_gpu.py tests/test_redistribute.py tests/test_ops.py"  # Makefile GPU_EMULATED_TESTS, first part
$PY -c "import hypothesis" 2>/dev/null || TESTS="tests/test_gpu.py tests/test_redistribute.py"  # test_ops needs it
# its second part, run last (after the benchmarks, with the time left): training on the device
TRAIN_TESTS="tests/test_optim.py tests/test_optim_checks.py"
$PY -c "import hypothesis" 2>/dev/null && TRAIN_TESTS="$TRAIN_TESTS tests/test_autograd.py"  # imports test_ops
TRAIN_TESTS="$TRAIN_TESTS tests/test_autograd_hooks.py tests/test_autograd_misuse.py tests/test_tp_autograd.py"
TRAIN_TESTS="$TRAIN_TESTS tests/test_replicate.py tests/test_losses.py"
$PY -c "import h5py, xxhash" 2>/dev/null && TRAIN_TESTS="$TRAIN_TESTS tests/test_training.py tests/test_checkpoint.py tests/test_nn.py tests/test_fsdp.py"
LOG=${GPU_CHECK_LOG:-/tmp/dtorch_gpu_check}
mkdir -p "$LOG"
summary=()

left() { echo $(( DEADLINE - $(date +%s) )); }
step() {  # step NAME LIMIT CMD...
  local name=$1 limit=$2; shift 2
  local budget; budget=$(left)
  [ "$budget" -lt "$limit" ] && limit=$budget
  if [ "$limit" -le 5 ]; then summary+=("$name: SKIPPED (out of time)"); return; fi
  echo "=== $name (limit ${limit}s)"
  if timeout "$limit" "$@" > "$LOG/$name.log" 2>&1; then
    summary+=("$name: PASS  $(grep -E 'passed|failed' "$LOG/$name.log" | tail -1)")
  else
    summary+=("$name: FAIL (exit $?)  see $LOG/$name.log")
  fi
  tail -15 "$LOG/$name.log"
}

nvidia-smi -L 2>/dev/null || echo "nvidia-smi not found"
if ! $PY -c "import cupy; n = cupy.cuda.runtime.getDeviceCount(); print('CuPy', cupy.__version__, n, 'GPU(s)'); assert n > 0"; then
  echo "CuPy with a visible GPU is required"; exit 1
fi
$PY -c "import cupy.cuda.nccl; print('NCCL available')" 2>/dev/null || echo "NCCL not available (not needed here)"
if ! command -v mpiexec >/dev/null 2>&1 && [ -n "${MPICH_WHEEL:-}" ]; then
  $PY -m pip install --no-index --no-deps "$MPICH_WHEEL"
fi
MPIEXEC=${MPIEXEC:-$(command -v mpiexec || echo "$(dirname "$($PY -c 'import sys; print(sys.executable)')")/mpiexec")}
PYTEST_MPI=""
$PY -c "import pytest_mpi" 2>/dev/null && PYTEST_MPI="--with-mpi"

NGPU=$($PY -c "import cupy; print(cupy.cuda.runtime.getDeviceCount())")
step gpu-tests-1-rank 150 $PY -m pytest -q -p no:cacheprovider --device $DEVICE $TESTS
step gpu-tests-2-ranks-host-staging 150 env DTORCH_GPU_BACKEND=host-staging DTORCH_TEST_ALL_OUTPUT=1 \
  "$MPIEXEC" -n 2 tests/rank_wrapper.sh $PY -m pytest -q -p no:cacheprovider $PYTEST_MPI --device $DEVICE $TESTS
if [ "$NGPU" -ge 2 ] && $PY -c "import cupy.cuda.nccl" 2>/dev/null; then
  step gpu-tests-nccl-$NGPU-ranks 150 env DTORCH_GPU_BACKEND=nccl DTORCH_TEST_ALL_OUTPUT=1 \
    "$MPIEXEC" -n "$(( NGPU < 4 ? NGPU : 4 ))" tests/rank_wrapper.sh $PY -m pytest -q -p no:cacheprovider $PYTEST_MPI \
    --device $DEVICE $TESTS
else
  summary+=("gpu-tests-nccl: SKIPPED (needs 2+ GPUs and cupy.cuda.nccl; the emulated device runs it in CI)")
fi
step gpu-benchmark-2-ranks 60 env DTORCH_GPU_BACKEND=host-staging "$MPIEXEC" -n 2 $PY scripts/bench_gpu.py
# NCCL backend's reduce_scatter (ncclReduceScatter) and all-to-all (grouped send/recv) against
# the raw CuPy NCCL calls, one rank per GPU (at most 2): one GPU still runs every NCCL call
if $PY -c "import cupy.cuda.nccl" 2>/dev/null; then
  step gpu-nccl-vs-raw 60 env DTORCH_GPU_BACKEND=nccl "$MPIEXEC" -n "$(( NGPU < 2 ? NGPU : 2 ))" $PY scripts/bench_gpu.py --nccl
else
  summary+=("gpu-nccl-vs-raw: SKIPPED (cupy.cuda.nccl not available)")
fi
# autograd, optimizers, training plans and checkpoints on device pieces (2 ranks sharing the GPU)
step gpu-train-suites-2-ranks 150 env DTORCH_GPU_BACKEND=host-staging DTORCH_TEST_ALL_OUTPUT=1 \
  "$MPIEXEC" -n 2 tests/rank_wrapper.sh $PY -m pytest -q -p no:cacheprovider $PYTEST_MPI --device $DEVICE $TRAIN_TESTS

echo
echo "=== summary"
[ "$DEVICE" = emulated ] && echo "*** EMULATED DEVICE (test double): a dry run of this script, not a GPU result"
printf '%s\n' "${summary[@]}"
grep -E "ratio|S\(0\)|P->R" "$LOG/gpu-benchmark-2-ranks.log" 2>/dev/null
grep -E "ratio|nccl" "$LOG/gpu-nccl-vs-raw.log" 2>/dev/null
! printf '%s\n' "${summary[@]}" | grep -q FAIL && ! grep -q MISMATCH "$LOG/gpu-nccl-vs-raw.log" 2>/dev/null
