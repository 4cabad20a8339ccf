#!/usr/bin/env bash
# Start a one-node Slurm cluster on this machine, for tests/slurm: Debian's slurm-wlm and munge,
# slurmctld and slurmd on localhost with all of the machine's CPUs. Needs root. Idempotent: a
# cluster that is already up is left alone. Prints the partition's state when ready.
set -euo pipefail

if [ "$(id -u)" -ne 0 ]; then
  echo "start_cluster.sh: needs root (it installs packages and starts daemons)" >&2
  exit 1
fi
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq slurm-wlm munge >/dev/null
fi

if ! pgrep -x munged >/dev/null; then
  mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge
  chmod 0700 /etc/munge
  chmod 0400 /etc/munge/munge.key
  runuser -u munge -- munged
fi

host=$(hostname -s)
cpus=$(nproc)
memory_mb=$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
cat > /etc/slurm/slurm.conf.new <<CONF
ClusterName=threefold-test
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
JobRequeue=1
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MinJobAge=600
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
if ! cmp -s /etc/slurm/slurm.conf.new /etc/slurm/slurm.conf 2>/dev/null; then
  mv /etc/slurm/slurm.conf.new /etc/slurm/slurm.conf
  pkill -x slurmd || true
  pkill -x slurmctld || true
  sleep 1
else
  rm /etc/slurm/slurm.conf.new
fi
pgrep -x slurmctld >/dev/null || slurmctld
pgrep -x slurmd >/dev/null || slurmd

for _ in $(seq 60); do
  state=$(sinfo -h -N -o %t 2>/dev/null || true)
  case "$state" in
    idle* | mix* | alloc*) sinfo; exit 0 ;;
    down* | drain*) scontrol update NodeName="$host" State=RESUME 2>/dev/null || true ;;
  esac
  sleep 1
done
echo "start_cluster.sh: the node did not come up; see /var/log/slurm/" >&2
exit 1
