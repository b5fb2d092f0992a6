#!/bin/sh
# Runs one MPI rank of the test suite. Ranks other than 0 write to a log file (rank 0 reports
# every rank's failures through the collective verdict); DTORCH_TEST_ALL_OUTPUT=1 shows all.
rank="${PMI_RANK:-${OMPI_COMM_WORLD_RANK:-${SLURM_PROCID:-0}}}"
if [ "$rank" != "0" ] && [ -z "$DTORCH_TEST_ALL_OUTPUT" ]; then
  logdir="${DTORCH_TEST_LOGDIR:-.mpi-logs}"
  mkdir -p "$logdir"
  exec > "$logdir/rank$rank.log" 2>&1
fi
exec "$@"
