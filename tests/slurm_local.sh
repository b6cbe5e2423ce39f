#!/bin/bash
# The real-Slurm test, by hand: a one-node Slurm cluster on this machine (munge, slurmctld and
# slurmd, configured here and nowhere else), kvsim's emitted job array and merge job submitted to
# it, and the merged results compared byte for byte with one process's run.
#
# As root on Debian 12, from the repository root, after ./bootstrap.sh:
#     tests/slurm_local.sh [CONFIG] [SHARDS]        (default: configs/quickstart.yaml, 4 shards)
# It installs slurm-wlm and munge with apt-get where missing, starts munged (left running, as a
# system daemon), slurmctld and slurmd on ports of its own (stopped again at the end), and keeps
# everything else under a scratch folder it prints. Exit status 0 only when the merged files equal
# one process's. CI (.ci/run) runs it; it takes about 15 seconds. Not part of `meson test`: starting
# daemons as root and waiting on a scheduler is not something a unit-test run should do.
set -euo pipefail
config=${1:-configs/quickstart.yaml}
shards=${2:-4}
kvsim=$(readlink -f build/kvsim)
scratch=$(mktemp -d /tmp/kvsim-slurm-XXXXXX)
echo "scratch folder: $scratch"

if ! command -v slurmctld > /dev/null || ! command -v munged > /dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge > /dev/null
fi

# munge: a key, and the daemon (Slurm authenticates every message with it).
if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    chown munge:munge /etc/munge/munge.key 2> /dev/null || true
    chmod 400 /etc/munge/munge.key
fi
mkdir -p /run/munge /var/log/munge /var/lib/munge
chown munge:munge /run/munge /var/log/munge /var/lib/munge 2> /dev/null || true
if ! pgrep -x munged > /dev/null; then
    runuser -u munge -- munged 2> /dev/null || munged --force
fi

host=$(hostname -s)
cpus=$(nproc)
memory=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
# Ports of this run's own (another Slurm on the machine keeps 6817 and 6818).
ctld_port=$(( 20000 + ($$ % 10000) * 2 ))
slurmd_port=$(( ctld_port + 1 ))
conf=$scratch/slurm.conf
cat > "$conf" << CONF
ClusterName=kvsimlocal
SlurmctldHost=$host
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SchedulerType=sched/backfill
StateSaveLocation=$scratch/state
SlurmdSpoolDir=$scratch/spool
SlurmctldPidFile=$scratch/slurmctld.pid
SlurmdPidFile=$scratch/slurmd.pid
SlurmctldLogFile=$scratch/slurmctld.log
SlurmdLogFile=$scratch/slurmd.log
MpiDefault=none
NodeName=$host CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=local Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
mkdir -p "$scratch/state" "$scratch/spool"
export SLURM_CONF=$conf
slurmctld -f "$conf"
slurmd -f "$conf"
cleanup() {
    scancel --user=root 2> /dev/null || true
    [ -s "$scratch/slurmd.pid" ] && kill "$(cat "$scratch/slurmd.pid")" 2> /dev/null || true
    [ -s "$scratch/slurmctld.pid" ] && kill "$(cat "$scratch/slurmctld.pid")" 2> /dev/null || true
}
trap cleanup EXIT
for _ in $(seq 60); do
    sinfo -h -o %T 2> /dev/null | grep -qE '^(idle|mixed|allocated)' && break
    sleep 1
done
sinfo

# The three commands a cluster user types: emit, submit, (the merge runs by itself), then compare.
"$kvsim" sweep "$config" --out "$scratch/results" --emit-slurm "$scratch/sweep.sbatch" --shards "$shards"
bash "$scratch/sweep.sbatch" | tee "$scratch/submitted"
merge_job=$(awk '{print $NF}' "$scratch/submitted")
for _ in $(seq 600); do
    state=$(scontrol show job "$merge_job" 2> /dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2 || true)
    case "$state" in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY) break ;; esac
    sleep 1
done
echo "merge job $merge_job: $state"
if [ "$state" != COMPLETED ]; then
    echo "slurm_local: the merge job did not complete; logs: $scratch/results/slurm-*.out, $scratch/*.log"
    exit 1
fi
"$kvsim" sweep "$config" --out "$scratch/one-process" -q > /dev/null
cmp "$scratch/results/results.csv" "$scratch/one-process/results.csv"
cmp "$scratch/results/results.json" "$scratch/one-process/results.json"
echo "real Slurm: $shards shards merged into results identical to one process's, byte for byte"
