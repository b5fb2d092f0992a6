#!/bin/bash
# A real single-node Slurm on this machine: munge and the Slurm daemons started by hand (no
# systemd), all state under a temporary root; submits quickstart.sbatch and checks its output.
# Used by `make test-slurm`. Needs root (it installs Debian packages when they are missing).
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PACKAGES="slurmctld slurmd slurm-client munge libpmix2 libpmix-dev"
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $PACKAGES
fi
ROOT=$(mktemp -d /tmp/dtorch-slurm.XXXXXX)
chmod 755 "$ROOT"
HOST=$(hostname -s)
stop() {
  for pidfile in "$ROOT/slurmd.pid" "$ROOT/slurmctld.pid" "$ROOT/munge/run/munged.pid"; do
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  sleep 1
  rm -rf "$ROOT"
}
trap stop EXIT

# munge, as the munge user, with its own key and a socket directory of mode 755
mkdir -p "$ROOT/munge/etc" "$ROOT/munge/run" "$ROOT/munge/log" "$ROOT/munge/lib"
mungekey --create --keyfile "$ROOT/munge/etc/munge.key" --force
chown -R munge:munge "$ROOT/munge"
chmod 700 "$ROOT/munge/etc" "$ROOT/munge/log" "$ROOT/munge/lib"
chmod 755 "$ROOT/munge/run"
chmod 600 "$ROOT/munge/etc/munge.key"
SOCKET="$ROOT/munge/run/munge.socket"
runuser -u munge -- munged --key-file="$ROOT/munge/etc/munge.key" --socket="$SOCKET" \
  --pid-file="$ROOT/munge/run/munged.pid" --log-file="$ROOT/munge/log/munged.log" \
  --seed-file="$ROOT/munge/lib/munged.seed"

mkdir -p "$ROOT/state" "$ROOT/spool"
# a random first job id: MPICH names its shared-memory segments after the PMI job id, and a
# killed earlier run leaves /dev/shm/mpich_shm_* behind that a new "job 1" would attach to and spin
cat > "$ROOT/slurm.conf" <<CONF
ClusterName=dtorch
FirstJobId=$(( (RANDOM * 32768 + RANDOM) % 60000000 + 1000 ))
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmi2
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=$ROOT/state
SlurmdSpoolDir=$ROOT/spool
SlurmctldPidFile=$ROOT/slurmctld.pid
SlurmdPidFile=$ROOT/slurmd.pid
SlurmctldLogFile=$ROOT/slurmctld.log
SlurmdLogFile=$ROOT/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=10 State=UP
CONF
export SLURM_CONF="$ROOT/slurm.conf"
slurmctld
slurmd
for _ in $(seq 1 60); do
  sinfo -h -o %t 2>/dev/null | grep -q idle && break
  sleep 0.5
done
sinfo
OUT="$ROOT/job.out"
DTORCH_PYTHON=${DTORCH_PYTHON:-$REPO/.venv/bin/python} timeout 180 sbatch --wait -o "$OUT" scripts/slurm/quickstart.sbatch
cat "$OUT"
test "$(grep -c 'quickstart done' "$OUT")" = 2
echo "slurm: 2 passed, 0 failed"
