#!/usr/bin/env bash
# Start a throwaway multi-node Slurm cluster on this one machine (Debian/Ubuntu, as root):
# slurmctld plus one `slurmd -N <node>` per node, all on 127.0.0.1, with fake GPUs.
#
# Usage:  eval "$(slurm/local/start.sh | tail -1)"      # sets SLURM_CONF in this shell
#
# Idempotent: daemons already running with the same configuration are left alone; a changed
# configuration restarts them. Progress goes to stderr; the LAST line on stdout is
# `export SLURM_CONF=...`.
#
# Knobs (environment):
#   HPCFSDP_SLURM_DIR      state folder (conf/ log/ spool/ state/ run/ gpu/)  [/tmp/hpcfsdp-slurm]
#   HPCFSDP_SLURM_NODES    number of nodes, named hpcfsdp-n1..N             [2]
#   HPCFSDP_SLURM_GPUS     fake GPUs per node                               [4]
#   HPCFSDP_SLURM_CPUS     CPUs declared per node                           [max(4, nproc)]
#   HPCFSDP_SLURM_MEM_MB   RealMemory per node in MB                        [8000]
#   HPCFSDP_SLURM_PORT     slurmctld port; slurmd of node i uses PORT+i     [6817]
#   HPCFSDP_SLURM_TIMEOUT  seconds to wait for the nodes to become idle     [60]
#   HPCFSDP_SLURM_MAX_ARRAY_SIZE   MaxArraySize (array indices 0..N-1)       [10001]
#   HPCFSDP_SLURM_MAX_TIME         the partition's MaxTime in minutes         [INFINITE]
set -euo pipefail

# Everything we (and the tools we call) print goes to stderr; fd 3 keeps the real stdout for the
# final `export` line.
exec 3>&1 1>&2

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR=${HPCFSDP_SLURM_DIR:-/tmp/hpcfsdp-slurm}
NNODES=${HPCFSDP_SLURM_NODES:-2}
GPUS=${HPCFSDP_SLURM_GPUS:-4}
NPROC=$(nproc)
CPUS=${HPCFSDP_SLURM_CPUS:-$((NPROC > 4 ? NPROC : 4))}
MEM_MB=${HPCFSDP_SLURM_MEM_MB:-8000}
PORT=${HPCFSDP_SLURM_PORT:-6817}
TIMEOUT=${HPCFSDP_SLURM_TIMEOUT:-60}
MAX_ARRAY_SIZE=${HPCFSDP_SLURM_MAX_ARRAY_SIZE:-10001}
MAX_TIME=${HPCFSDP_SLURM_MAX_TIME:-INFINITE}

CONF=$DIR/conf/slurm.conf
NODES=()
for ((i = 1; i <= NNODES; i++)); do NODES+=("hpcfsdp-n$i"); done

log() { echo "[hpcfsdp-slurm] $*"; }
die() { echo "[hpcfsdp-slurm] ERROR: $*"; exit 1; }

[[ $(id -u) == 0 ]] || die "must run as root (installs packages, starts munged, edits /etc/hosts)"

# --- 1. packages -------------------------------------------------------------------------------
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null; then
    log "installing slurm-wlm and munge with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q slurm-wlm munge
fi

# --- 2. munge (authentication between all Slurm daemons and clients) ----------------------------
if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating /etc/munge/munge.key"
    install -d -o munge -g munge -m 0700 /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
fi
munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }
if ! munge_ok; then
    log "starting munged"
    # No systemd here: start it by hand, as the munge user, like the packaged service does.
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    # Daemons must not inherit our stdout/stderr or fd 3: a caller's `start.sh | tail -1` would
    # otherwise wait for them forever (munged keeps inherited descriptors open).
    runuser -u munge -- /usr/sbin/munged </dev/null >/dev/null 2>&1 3>&-
    for _ in $(seq 50); do munge_ok && break; sleep 0.2; done
    munge_ok || die "munged does not answer; see /var/log/munge/munged.log"
fi

# --- 3. node names must resolve (torch.distributed uses the first node as MASTER_ADDR) ----------
missing=()
for n in "${NODES[@]}"; do
    addr=$(getent ahostsv4 "$n" | awk 'NR == 1 {print $1}') || true
    if [[ -z $addr ]]; then
        missing+=("$n")
    elif [[ $addr != 127.* ]]; then
        die "node name $n resolves to $addr, not to the loopback address; fix /etc/hosts"
    fi
done
if ((${#missing[@]})); then
    log "adding '127.0.0.1 ${missing[*]}' to /etc/hosts"
    echo "127.0.0.1 ${missing[*]}" >>/etc/hosts
fi

# --- 4. configuration ----------------------------------------------------------------------------
mkdir -p "$DIR"/{conf,log,state,run,spool}
for n in "${NODES[@]}"; do
    mkdir -p "$DIR/spool/$n" "$DIR/gpu/$n"
    # Fake GPUs: gres.conf needs File= entries or the node registers with 0 GPUs. Plain files are
    # accepted, but slurmd then logs "not a valid character or block device" and jobs get no
    # CUDA_VISIBLE_DEVICES / SLURM_JOB_GPUS. Links to the character device /dev/null behave like
    # real GPUs (jobs get CUDA_VISIBLE_DEVICES=0,1,...) and are harmless: with task/none nothing
    # restricts or opens them.
    for ((g = 0; g < GPUS; g++)); do ln -sfn /dev/null "$DIR/gpu/$n/nvidia$g"; done
done

CTLD_HOST=$(hostname -s)   # slurmctld only runs on a host named in SlurmctldHost

{
    cat <<EOF
# Generated by slurm/local/start.sh -- edits are overwritten.
ClusterName=hpcfsdp-local
SlurmctldHost=$CTLD_HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
# No cgroups/systemd needed:
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# batch_sched_delay (default 3 s) holds every new batch job back until the next pass; tests want
# jobs to start at once.
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
# CPUs only; memory is not a consumable, so jobs need not ask for --mem.
SelectTypeParameters=CR_CPU
GresTypes=gpu
# Nodes declare more CPUs than the machine has (oversubscription on purpose). Without
# config_overrides slurmctld would drain them for "Low CPU count".
SlurmdParameters=config_overrides
ReturnToService=2
MaxArraySize=$MAX_ARRAY_SIZE
MaxJobCount=50000
# Short timeouts for tests; finished jobs stay visible in squeue for MinJobAge seconds.
MinJobAge=300
KillWait=5
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
UnkillableStepTimeout=30
MailProg=/bin/true
StateSaveLocation=$DIR/state
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
# %n = node name: each slurmd on this host gets its own pid file, log and spool.
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldDebug=info
SlurmdDebug=info

EOF
    for ((i = 1; i <= NNODES; i++)); do
        echo "NodeName=${NODES[i-1]} NodeHostname=${NODES[i-1]} NodeAddr=127.0.0.1 Port=$((PORT + i)) CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:$GPUS State=UNKNOWN"
    done
    echo "PartitionName=gpu Nodes=$(IFS=,; echo "${NODES[*]}") Default=YES MaxTime=$MAX_TIME State=UP OverSubscribe=NO"
} >"$CONF.new"

{
    echo "# Generated by slurm/local/start.sh -- edits are overwritten."
    echo "AutoDetect=off"
    for n in "${NODES[@]}"; do
        echo "NodeName=$n Name=gpu File=$DIR/gpu/$n/nvidia[0-$((GPUS - 1))]"
    done
} >"$DIR/conf/gres.conf.new"

# Is the daemon of this pid file alive and ours (started with our slurm.conf)?
ours() {
    local pidfile=$1 pid
    [[ -s $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ -r /proc/$pid/cmdline ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$CONF"
}
any_running() {
    local f
    for f in "$DIR"/run/*.pid; do [[ -e $f ]] && ours "$f" && return 0; done
    return 1
}

changed=0
for f in "$CONF" "$DIR/conf/gres.conf"; do
    if ! cmp -s "$f.new" "$f"; then changed=1; fi
done
if ((changed)); then
    if any_running; then
        log "configuration changed: restarting the daemons"
        HPCFSDP_SLURM_DIR=$DIR bash "$HERE/stop.sh"
    fi
    mv "$CONF.new" "$CONF"
    mv "$DIR/conf/gres.conf.new" "$DIR/conf/gres.conf"
else
    rm -f "$CONF.new" "$DIR/conf/gres.conf.new"
fi
export SLURM_CONF=$CONF

# --- 5. daemons ----------------------------------------------------------------------------------
started_at=$(date +%s)
fresh=()   # nodes whose slurmd we start now: they must register anew before we report ready
if ours "$DIR/run/slurmctld.pid"; then
    log "slurmctld already running (pid $(<"$DIR/run/slurmctld.pid"))"
else
    log "starting slurmctld (port $PORT)"
    rm -f "$DIR/run/slurmctld.pid"
    slurmctld -f "$CONF" </dev/null >>"$DIR/log/slurmctld.out" 2>&1 3>&- || die "slurmctld failed to start; see $DIR/log/slurmctld.log"
fi
for n in "${NODES[@]}"; do
    if ours "$DIR/run/slurmd-$n.pid"; then
        log "slurmd $n already running (pid $(<"$DIR/run/slurmd-$n.pid"))"
    else
        log "starting slurmd $n"
        rm -f "$DIR/run/slurmd-$n.pid"
        slurmd -f "$CONF" -N "$n" </dev/null >>"$DIR/log/slurmd-$n.out" 2>&1 3>&- || die "slurmd $n failed to start; see $DIR/log/slurmd-$n.log"
        fresh+=("$n")
    fi
done

# --- 6. wait until every node is idle -------------------------------------------------------------
log "waiting up to ${TIMEOUT}s for ${NODES[*]} to be idle"
# A restarted slurmctld restores the old node states from its state files, so "idle" alone may
# be stale: a node whose slurmd was just started counts only once it has registered again.
registered() {
    local t
    t=$(scontrol show node "$1" 2>/dev/null | grep -o 'SlurmdStartTime=[^ ]*' | cut -d= -f2)
    [[ -n $t && $t != None ]] && (($(date -d "$t" +%s) >= started_at))
}
deadline=$((SECONDS + TIMEOUT))
resumed=0
while :; do
    states=$(sinfo -h -N -p gpu -o '%N %t' 2>/dev/null | sort -u) || states=""
    nidle=$(awk '$2 == "idle" || $2 == "mix" || $2 == "alloc"' <<<"$states" | wc -l)
    if ((nidle == NNODES)); then
        ready=1
        for n in "${fresh[@]}"; do registered "$n" || ready=0; done
        ((ready)) && break
    fi
    # A node left drained/down by an earlier run (e.g. a killed job) is put back once: this is a
    # throwaway test cluster. States ending in '*' (not responding) just need more time.
    if ((!resumed)) && grep -Eq ' (drain|drng|drained|down|fail)$' <<<"$states"; then
        log "resuming drained/down nodes"
        scontrol update NodeName="$(IFS=,; echo "${NODES[*]}")" State=RESUME 2>/dev/null || true
        resumed=1
    fi
    if ((SECONDS >= deadline)); then
        printf '    %s\n' "$states"
        die "nodes not idle after ${TIMEOUT}s; logs are in $DIR/log/"
    fi
    sleep 1
done
sinfo -N -o '%N %t %c %m %G' | sed 's/^/    /'
log "cluster hpcfsdp-local is up (logs: $DIR/log/)"

echo "export SLURM_CONF=$CONF" >&3
