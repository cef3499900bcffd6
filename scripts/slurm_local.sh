#!/usr/bin/env bash
# A real Slurm cluster on this machine for the scheduler tests: munged, slurmctld and two slurmd
# (nodes n1 and n2, two CPUs each, on 127.0.0.1: two 2-task jobs run side by side) from Debian's slurm-wlm and munge packages.
#
#   bash scripts/slurm_local.sh start     # install (apt, as root) if missing, write the config, start
#   bash scripts/slurm_local.sh stop
#   source <(bash scripts/slurm_local.sh env)   # SLURM_CONF for sbatch/squeue/scontrol
#
# Everything lives under $DTORCH_SLURM_DIR (default /tmp/dtorch-slurm). Prints one line saying why
# and exits 3 when Slurm cannot be installed or started here, or DTORCH_SLURM=off (the tests then
# skip with that line).
set -uo pipefail
DIR=${DTORCH_SLURM_DIR:-/tmp/dtorch-slurm}
CONF=$DIR/slurm.conf
CPUS_PER_NODE=${DTORCH_SLURM_CPUS:-2}

fail() { echo "slurm unavailable: $*"; exit 3; }

install() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return 0
  [ "$(id -u)" = 0 ] || fail "slurm-wlm/munge are not installed and installing them needs root"
  command -v apt-get >/dev/null || fail "slurm-wlm/munge are not installed and there is no apt-get"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge) \
    >"$DIR/apt.log" 2>&1 || fail "apt-get install slurm-wlm munge failed (see $DIR/apt.log)"
}

write_conf() {
  local host; host=$(hostname -s)
  mkdir -p "$DIR"/{state,spool/n1,spool/n2,log}
  cat >"$CONF" <<CONF
ClusterName=dtorch-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits cred_expire seconds before it may start again (default 120)
AuthInfo=cred_expire=10
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/log/jobcomp.txt
JobRequeue=1
MinJobAge=600
KillWait=10
ReturnToService=2
MpiDefault=none
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
NodeName=n1 NodeAddr=127.0.0.1 NodeHostname=$host Port=16821 CPUs=$CPUS_PER_NODE RealMemory=2000 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 NodeHostname=$host Port=16822 CPUs=$CPUS_PER_NODE RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=60 State=UP OverSubscribe=NO
CONF
}

start_munge() {
  if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then return 0; fi
  mkdir -p /run/munge /var/lib/munge /var/log/munge /etc/munge
  if [ ! -s /etc/munge/munge.key ]; then
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  fi
  chown -R munge:munge /run/munge /var/lib/munge /var/log/munge /etc/munge 2>/dev/null || true
  chmod 0700 /etc/munge /var/lib/munge /var/log/munge; chmod 0400 /etc/munge/munge.key; chmod 0755 /run/munge
  if id munge >/dev/null 2>&1; then runuser -u munge -- munged || munged --force; else munged --force; fi
  for _ in $(seq 50); do munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return 0; sleep 0.1; done
  fail "munged did not start"
}

up() {
  for _ in $(seq 100); do
    if SLURM_CONF=$CONF sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /^idle/' | wc -l | grep -q '^2$'; then
      return 0
    fi
    sleep 0.2
  done
  return 1
}

start() {
  [ "${DTORCH_SLURM:-on}" = off ] && fail "DTORCH_SLURM=off"
  mkdir -p "$DIR"
  install
  write_conf
  start_munge
  export SLURM_CONF=$CONF
  if ! { [ -f "$DIR/slurmctld.pid" ] && kill -0 "$(cat "$DIR/slurmctld.pid")" 2>/dev/null; }; then
    slurmctld -f "$CONF" -i >>"$DIR/log/start.log" 2>&1 || fail "slurmctld did not start (see $DIR/log)"
  fi
  for n in n1 n2; do
    if ! { [ -f "$DIR/slurmd-$n.pid" ] && kill -0 "$(cat "$DIR/slurmd-$n.pid")" 2>/dev/null; }; then
      slurmd -f "$CONF" -N "$n" >>"$DIR/log/start.log" 2>&1 || fail "slurmd $n did not start (see $DIR/log)"
    fi
  done
  up || { scontrol update nodename=n1,n2 state=resume >/dev/null 2>&1; up; } \
     || fail "nodes n1,n2 not idle: $(sinfo -h -N -o '%N %t %E' 2>&1 | tr '\n' ';')"
  echo "slurm up: SLURM_CONF=$CONF nodes n1,n2 ($CPUS_PER_NODE CPU each)"
}

stop() {
  for f in "$DIR"/slurmd-n1.pid "$DIR"/slurmd-n2.pid "$DIR"/slurmctld.pid; do
    [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null
  done
  return 0
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
