#!/usr/bin/env bash
# Start a throwaway multi-node Slurm cluster on this one machine (Debian/Ubuntu, as root):
# slurmctld plus one `slurmd -N <node>` per node, all on 127.0.0.1, with fake GPUs, and accounting
# (slurmdbd with a MariaDB server of the cluster's own) so that sacct answers.
#
# Usage:  eval "$(slurm/local/start.sh | tail -1)"      # sets SLURM_CONF in this shell
#
# Idempotent: daemons already running with the same configuration are left alone; a changed
# configuration restarts them. Progress goes to stderr; the LAST line on stdout is
# `export SLURM_CONF=...`.
#
# Knobs (environment):
#   HPCFSDP_SLURM_RELEASE  the Slurm release to start: 22.05 (Debian 12's packages, with MariaDB
#                          10.11), 24.11 (Debian 13's, with MariaDB 11.8), or `system`: what this
#                          machine's packages give. A release they do not give is refused, naming
#                          the Debian 13 root that bench/debian13_suite.sh makes (docs/clusters.md).
#                          start.sh prints the release it started                       [system]
#   HPCFSDP_SLURM_DIR      state folder (conf/ log/ spool/ state/ run/ gpu/)  [/tmp/hpcfsdp-slurm]
#   HPCFSDP_SLURM_NODES    number of nodes, named hpcfsdp-n1..N             [2]
#   HPCFSDP_SLURM_GPUS     fake GPUs per node, or `host`: the machine's real GPUs (/dev/nvidiaK),
#                          split evenly across the nodes (2 x 2 on 4 GPUs, 2 x 1 on 2): each node's
#                          gres.conf names its own devices, and a TaskProlog points each task's
#                          CUDA_VISIBLE_DEVICES at its node's devices (slurm/local/README.md)  [4]
#   HPCFSDP_SLURM_HOST_GPUS  with HPCFSDP_SLURM_GPUS=host, the host's GPUs the cluster takes, e.g.
#                          2,3 (the others stay free for runs beside the cluster)      [all of them]
#   HPCFSDP_SLURM_GPU_DEVICES  the folder of the host's GPU device files nvidiaK (tests: links to
#                          /dev/null)                                                      [/dev]
#   HPCFSDP_SLURM_DEBS     a folder of Debian 12's Slurm and munge .deb files, unpacked (dpkg -x) into
#                          the state folder and run from there, for a machine where Slurm is not
#                          installed and apt cannot install it (a GPU machine without network);
#                          no accounting there                                            [unset]
#   HPCFSDP_SLURM_CPUS     CPUs declared per node                           [max(4, nproc)]
#   HPCFSDP_SLURM_MEM_MB   RealMemory per node in MB                        [8000]
#   HPCFSDP_SLURM_PORT     slurmctld port; slurmd of node i uses PORT+i,     [6817]
#                          slurmdbd PORT+NODES+1, MariaDB PORT+NODES+2
#   HPCFSDP_SLURM_ACCOUNTING  1: slurmdbd + MariaDB (sacct answers); 0: none  [1]
#   HPCFSDP_SLURM_TIMEOUT  seconds to wait for the nodes to become idle     [60]
#   HPCFSDP_SLURM_MAX_ARRAY_SIZE   MaxArraySize (array indices 0..N-1)       [10001]
#   HPCFSDP_SLURM_MAX_TIME         the partition's MaxTime in minutes         [INFINITE]
#   HPCFSDP_SLURM_ENFORCE          AccountingStorageEnforce (needs accounting) [none]
#   HPCFSDP_SLURM_FEATURES         Features of every node (for --constraint)  [none]
#   HPCFSDP_SLURM_DEF_MEM_PER_CPU  the partition's DefMemPerCPU in MB         [none]
#   HPCFSDP_SLURM_CLUSTER_NAME     ClusterName (what sbatch -M names)        [hpcfsdp-local]
#   HPCFSDP_SLURM_DBD_PORT  port of another cluster's running slurmdbd that keeps this cluster's
#                          accounting (then no slurmdbd or MariaDB of its own); clusters that
#                          share one slurmdbd reach each other with -M              [unset: its own]
#   HPCFSDP_SLURM_PREEMPT  1: partition `urgent` (PriorityTier 2) on the nodes of `gpu` (PriorityTier
#                          1) preempts its jobs (preempt/partition_prio, PreemptMode=REQUEUE,
#                          KillWait 20 s)                                                   [0]
#   HPCFSDP_SLURM_MEMORY_LIMIT  1: memory is a consumable (CR_CPU_Memory, DefMemPerNode 2000) and a
#                          step above its job's memory is killed (jobacct_gather/linux every
#                          second, OverMemoryKill): OUT_OF_MEMORY without cgroups        [0]
#   HPCFSDP_SLURM_POWER_SAVE  1: power saving whose ResumeProgram fails (a node that does not boot):
#                          SuspendProgram/ResumeProgram, ResumeTimeout 10 s, SuspendTime 1 h
#                          suspend (power a node down with `scontrol update State=POWER_DOWN_FORCE`) [0]
#   HPCFSDP_SLURM_FIRST_JOB_ID  FirstJobId: clusters side by side with different job ids, so that
#                          what derives from a job id (a cell's MASTER_PORT) differs too  [1]
set -euo pipefail

# Everything we (and the tools we call) print goes to stderr; fd 3 keeps the real stdout for the
# final `export` line.
exec 3>&1 1>&2

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
RELEASE=${HPCFSDP_SLURM_RELEASE:-system}
DIR=${HPCFSDP_SLURM_DIR:-/tmp/hpcfsdp-slurm}
NNODES=${HPCFSDP_SLURM_NODES:-2}
GPUS=${HPCFSDP_SLURM_GPUS:-4}
DEBS=${HPCFSDP_SLURM_DEBS:-}
GPU_DEVICES=${HPCFSDP_SLURM_GPU_DEVICES:-/dev}
TAKE_GPUS=${HPCFSDP_SLURM_HOST_GPUS:-}
NPROC=$(nproc)
CPUS=${HPCFSDP_SLURM_CPUS:-$((NPROC > 4 ? NPROC : 4))}
MEM_MB=${HPCFSDP_SLURM_MEM_MB:-8000}
PORT=${HPCFSDP_SLURM_PORT:-6817}
TIMEOUT=${HPCFSDP_SLURM_TIMEOUT:-60}
MAX_ARRAY_SIZE=${HPCFSDP_SLURM_MAX_ARRAY_SIZE:-10001}
MAX_TIME=${HPCFSDP_SLURM_MAX_TIME:-INFINITE}
ACCOUNTING=${HPCFSDP_SLURM_ACCOUNTING:-$([[ -n $DEBS ]] && echo 0 || echo 1)}
ENFORCE=${HPCFSDP_SLURM_ENFORCE:-}                  # AccountingStorageEnforce, e.g. associations,limits,qos
FEATURES=${HPCFSDP_SLURM_FEATURES:-}                # every node's Features (for --constraint)
DEF_MEM_PER_CPU=${HPCFSDP_SLURM_DEF_MEM_PER_CPU:-}  # the partition's DefMemPerCPU, MB
SHARED_DBD=${HPCFSDP_SLURM_DBD_PORT:-}
DBD_PORT=${SHARED_DBD:-$((PORT + NNODES + 1))}
DB_PORT=$((PORT + NNODES + 2))
OWN_DBD=$((ACCOUNTING && ${#SHARED_DBD} == 0))   # a slurmdbd and MariaDB of its own
CLUSTER=${HPCFSDP_SLURM_CLUSTER_NAME:-hpcfsdp-local}
PREEMPT=${HPCFSDP_SLURM_PREEMPT:-0}
MEMORY_LIMIT=${HPCFSDP_SLURM_MEMORY_LIMIT:-0}
POWER_SAVE=${HPCFSDP_SLURM_POWER_SAVE:-0}
FIRST_JOB_ID=${HPCFSDP_SLURM_FIRST_JOB_ID:-1}
# SIGTERM to SIGKILL. With preemption 20 s: a preempted job's ranks ask squeue why, then write a
# record. (A partition GraceTime would do it too, but a job that ends within its GraceTime ends
# FAILED and is not requeued.)
KILL_WAIT=$((PREEMPT ? 20 : 5))

CONF=$DIR/conf/slurm.conf
NODES=()
for ((i = 1; i <= NNODES; i++)); do NODES+=("hpcfsdp-n$i"); done

log() { echo "[hpcfsdp-slurm] $*"; }
die() { echo "[hpcfsdp-slurm] ERROR: $*"; exit 1; }

[[ $ACCOUNTING == [01] ]] || die "HPCFSDP_SLURM_ACCOUNTING must be 0 or 1, not '$ACCOUNTING'"
[[ -z $ENFORCE || $ACCOUNTING == 1 ]] || die "HPCFSDP_SLURM_ENFORCE needs accounting (HPCFSDP_SLURM_ACCOUNTING=1)"
[[ $PREEMPT == [01] ]] || die "HPCFSDP_SLURM_PREEMPT must be 0 or 1, not '$PREEMPT'"
[[ $MEMORY_LIMIT == [01] ]] || die "HPCFSDP_SLURM_MEMORY_LIMIT must be 0 or 1, not '$MEMORY_LIMIT'"
[[ $POWER_SAVE == [01] ]] || die "HPCFSDP_SLURM_POWER_SAVE must be 0 or 1, not '$POWER_SAVE'"
[[ $FIRST_JOB_ID =~ ^[1-9][0-9]*$ ]] || die "HPCFSDP_SLURM_FIRST_JOB_ID must be a positive number, not '$FIRST_JOB_ID'"
[[ $CLUSTER =~ ^[a-z0-9_-]+$ ]] || die "HPCFSDP_SLURM_CLUSTER_NAME must be lower-case letters, digits, '-' and '_', not '$CLUSTER'"
[[ -z $SHARED_DBD || ($SHARED_DBD =~ ^[0-9]+$ && $ACCOUNTING == 1) ]] ||
    die "HPCFSDP_SLURM_DBD_PORT must be a port number, with HPCFSDP_SLURM_ACCOUNTING=1, not '$SHARED_DBD'"
[[ -z $DEBS || $ACCOUNTING == 0 ]] || die "HPCFSDP_SLURM_DEBS runs without accounting (no slurmdbd or MariaDB there)"
[[ $RELEASE =~ ^(system|22\.05|24\.11)$ ]] || die "HPCFSDP_SLURM_RELEASE must be 22.05, 24.11 or system, not '$RELEASE'"
[[ $(id -u) == 0 ]] || die "must run as root (installs packages, starts munged, edits /etc/hosts)"

# The machine's GPUs as the nodes' gres (HPCFSDP_SLURM_GPUS=host): /dev/nvidia0..K-1, split evenly.
HOST_GPUS=()   # the host's numbers K of the GPUs the cluster takes, node by node
if [[ $GPUS == host ]]; then
    if [[ -n $TAKE_GPUS ]]; then
        [[ $TAKE_GPUS =~ ^[0-9]+(,[0-9]+)*$ ]] || die "HPCFSDP_SLURM_HOST_GPUS must be GPU numbers like 2,3, not '$TAKE_GPUS'"
        IFS=, read -ra HOST_GPUS <<<"$TAKE_GPUS"
        for k in "${HOST_GPUS[@]}"; do [[ -e $GPU_DEVICES/nvidia$k ]] || die "HPCFSDP_SLURM_HOST_GPUS: no $GPU_DEVICES/nvidia$k"; done
    else
        mapfile -t HOST_GPUS < <(find "$GPU_DEVICES" -maxdepth 1 -regex '.*/nvidia[0-9]+' | sed 's/.*nvidia//' | sort -n)
    fi
    ((${#HOST_GPUS[@]})) || die "HPCFSDP_SLURM_GPUS=host, but $GPU_DEVICES holds no nvidiaK"
    ((${#HOST_GPUS[@]} % NNODES == 0)) || die "${#HOST_GPUS[@]} GPUs do not split evenly across $NNODES nodes"
    GPUS=$((${#HOST_GPUS[@]} / NNODES))
fi
[[ $GPUS =~ ^[0-9]+$ ]] || die "HPCFSDP_SLURM_GPUS must be a number or 'host', not '$GPUS'"

# Slurm from unpacked packages (HPCFSDP_SLURM_DEBS): its programs, libraries and plugins under
# $DIR/pkg, munged with a key and socket of the cluster's own. conf/env.sh says where they are, for
# the cluster's users (`source $DIR/conf/env.sh`) and for stop.sh.
PKG=$DIR/pkg
MUNGE_SOCKET_OWN=$DIR/run/munge.socket
if [[ -n $DEBS ]]; then
    [[ -d $DEBS ]] || die "HPCFSDP_SLURM_DEBS=$DEBS is not a folder"
    if [[ ! -x $PKG/usr/sbin/slurmctld-wlm ]]; then
        log "unpacking the packages of $DEBS into $PKG"
        mkdir -p "$PKG"
        for deb in "$DEBS"/*.deb; do dpkg -x "$deb" "$PKG"; done
        [[ -x $PKG/usr/sbin/slurmctld-wlm ]] || die "$DEBS holds no slurmctld package (slurmctld-wlm)"
    fi
    # Debian names the daemons *-wlm and links the plain names with update-alternatives, which
    # dpkg -x does not run.
    for d in slurmctld slurmd slurmstepd; do ln -sfn "$d-wlm" "$PKG/usr/sbin/$d"; done
    mkdir -p "$DIR"/{conf,run,log}
    libs="$PKG/lib/x86_64-linux-gnu:$PKG/usr/lib/x86_64-linux-gnu:$PKG/usr/lib/x86_64-linux-gnu/slurm-wlm"
    cat >"$DIR/conf/env.sh" <<EOF
# Generated by slurm/local/start.sh: Slurm from the unpacked packages in $PKG.
export PATH=$PKG/usr/bin:$PKG/usr/sbin\${PATH:+:\$PATH}
export LD_LIBRARY_PATH=$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
EOF
    # shellcheck disable=SC1091
    source "$DIR/conf/env.sh"
fi

# Sections 1, 2 and 4 change the machine (packages, /etc/hosts, munged), which every cluster on it
# shares: one start.sh at a time does them (pytest's parallel workers each start a cluster, and
# a test that installs another package takes the same lock).
exec {machine_lock}>/tmp/hpcfsdp-machine.lock
flock "$machine_lock"

# --- 1. packages -------------------------------------------------------------------------------
# The release: the installed slurmctld's, else the one apt would install.
machine_release() {
    if command -v slurmctld >/dev/null; then
        slurmctld -V 2>/dev/null | grep -oE '[0-9]+\.[0-9]+' | head -1
    else
        apt-cache policy slurmctld 2>/dev/null | awk '/Candidate:/ {print $2}' | grep -oE '^[0-9]+\.[0-9]+' | head -1
    fi
}
if [[ $RELEASE != system ]]; then
    have=$(machine_release || true)
    if [[ $have != "$RELEASE" ]]; then
        os=$( (. /etc/os-release && echo "$PRETTY_NAME") 2>/dev/null || echo "this system")
        die "Slurm $RELEASE asked (HPCFSDP_SLURM_RELEASE), but the packages of $os give ${have:-none}; 22.05 is Debian 12's, 24.11 Debian 13's: bench/debian13_suite.sh --root DIR makes a Debian 13 root to run start.sh in (docs/clusters.md)"
    fi
fi
packages=()
[[ -n $DEBS ]] || for tool in slurmctld:slurm-wlm slurmd:slurm-wlm munged:munge; do
    command -v "${tool%%:*}" >/dev/null || packages+=("${tool#*:}")
done
if ((OWN_DBD)); then
    command -v slurmdbd >/dev/null || packages+=(slurmdbd)
    command -v mariadbd >/dev/null || packages+=(mariadb-server)
fi
if ((${#packages[@]})); then
    mapfile -t packages < <(printf '%s\n' "${packages[@]}" | sort -u)
    log "installing ${packages[*]} with apt-get"
    export DEBIAN_FRONTEND=noninteractive
    # The packages' scripts must not start system-wide services (MariaDB, slurmdbd): the cluster
    # runs daemons of its own, only while it runs. A policy-rc.d answering 101 forbids that.
    policy=/usr/sbin/policy-rc.d
    made_policy=0
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 0755 "$policy"
        made_policy=1
        trap 'rm -f "$policy"' EXIT
    fi
    apt-get update -q
    apt-get install -y -q "${packages[@]}"
    if ((made_policy)); then
        rm -f "$policy"
        trap - EXIT
    fi
    if [[ -d /run/systemd/system ]]; then   # under systemd they would still start at the next boot
        systemctl disable --now --quiet mariadb slurmdbd 2>/dev/null || true
    fi
fi

# --- 2. node names must resolve (torch.distributed uses the first node as MASTER_ADDR) ----------
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

# --- 3. configuration ----------------------------------------------------------------------------
mkdir -p "$DIR"/{conf,log,state,run,spool}
if ((OWN_DBD)); then mkdir -p "$DIR/db"; fi
for n in "${NODES[@]}"; do
    mkdir -p "$DIR/spool/$n" "$DIR/gpu/$n"
    # Fake GPUs: gres.conf needs File= entries or the node registers with 0 GPUs. Plain files are
    # accepted, but slurmd then logs "not a valid character or block device" and jobs get no
    # CUDA_VISIBLE_DEVICES / SLURM_JOB_GPUS. Links to the character device /dev/null behave like
    # real GPUs (jobs get CUDA_VISIBLE_DEVICES=0,1,...) and are harmless: with task/none nothing
    # restricts or opens them.
    # With HPCFSDP_SLURM_GPUS=host the links lead to the node's share of the real devices, under
    # the host's numbers (node 2 of 2 x 2: nvidia2, nvidia3).
    rm -f "$DIR/gpu/$n"/nvidia*
done
host_gpus_of() { echo "${HOST_GPUS[@]:$((($1 - 1) * GPUS)):GPUS}"; }   # node i (from 1): its GPUs' host numbers
for ((i = 1; i <= NNODES; i++)); do
    for ((g = 0; g < GPUS; g++)); do
        if ((${#HOST_GPUS[@]})); then
            k=${HOST_GPUS[(i - 1) * GPUS + g]}
            ln -sfn "$GPU_DEVICES/nvidia$k" "$DIR/gpu/${NODES[i-1]}/nvidia$k"
        else
            ln -sfn /dev/null "$DIR/gpu/${NODES[i-1]}/nvidia$g"
        fi
    done
done

CTLD_HOST=$(hostname -s)   # slurmctld only runs on a host named in SlurmctldHost

{
    cat <<EOF
# Generated by slurm/local/start.sh -- edits are overwritten.
ClusterName=$CLUSTER
SlurmctldHost=$CTLD_HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
EOF
    if [[ -n $DEBS ]]; then
        cat <<EOF
# Slurm from the unpacked packages of $DEBS, munged on a socket of this cluster's own.
AuthInfo=socket=$MUNGE_SOCKET_OWN
PluginDir=$PKG/usr/lib/x86_64-linux-gnu/slurm-wlm
EOF
    fi
    if ((${#HOST_GPUS[@]})); then
        cat <<EOF
# The host's GPUs, split across nodes that share one host and no cgroup: Slurm numbers each node's
# GPUs from 0 in CUDA_VISIBLE_DEVICES, which on this host are the first node's. The TaskProlog
# puts the host's numbers in their place (conf/task-prolog).
TaskProlog=$DIR/conf/task-prolog
EOF
    fi
    cat <<EOF
# No cgroups/systemd needed:
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
EOF
    if ((MEMORY_LIMIT)); then
        cat <<EOF
# Memory limits without cgroups: every second slurmstepd reads each step's memory from /proc and
# kills a step that uses more than its job asked for (OUT_OF_MEMORY).
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=task=1
JobAcctGatherParams=OverMemoryKill
EOF
    else
        echo "JobAcctGatherType=jobacct_gather/none"
    fi
    if ((ACCOUNTING)); then
        cat <<EOF
# Accounting through this cluster's slurmdbd (conf/slurmdbd.conf), so that sacct answers. No
# energy plugin (AcctGatherEnergyType=none): sacct reports no consumed energy.
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$DBD_PORT
EOF
        if [[ -n $ENFORCE ]]; then echo "AccountingStorageEnforce=$ENFORCE"; fi
    else
        echo "AccountingStorageType=accounting_storage/none"
    fi
    cat <<EOF
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# batch_sched_delay (default 3 s) holds every new batch job back until the next pass; tests want
# jobs to start at once.
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
EOF
    if ((MEMORY_LIMIT)); then
        echo "# CPUs and memory are consumables; a job that does not ask for memory gets DefMemPerNode."
        echo "SelectTypeParameters=CR_CPU_Memory"
    else
        echo "# CPUs only; memory is not a consumable, so jobs need not ask for --mem."
        echo "SelectTypeParameters=CR_CPU"
    fi
    if ((PREEMPT)); then
        cat <<EOF
# A job of partition urgent (PriorityTier 2) takes the nodes of running jobs of partition gpu
# (PriorityTier 1): they are requeued (ended, if they may not be requeued).
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
EOF
    fi
    if ((POWER_SAVE)); then
        cat <<EOF
# Power saving whose nodes never boot: ResumeProgram fails the jobs that wait for them, as a site's
# resume program does when a boot fails (BOOT_FAIL for a job that may not be requeued). No idle
# node is powered down within a test (SuspendTime 1 h): scontrol update State=POWER_DOWN_FORCE does.
SuspendProgram=/bin/true
ResumeProgram=$DIR/conf/boot-fails
SuspendTime=3600
SuspendTimeout=5
ResumeTimeout=10
EOF
    fi
    cat <<EOF
GresTypes=gpu
# Nodes declare more CPUs than the machine has (oversubscription on purpose). Without
# config_overrides slurmctld would drain them for "Low CPU count".
SlurmdParameters=config_overrides
ReturnToService=2
MaxArraySize=$MAX_ARRAY_SIZE
FirstJobId=$FIRST_JOB_ID
MaxJobCount=50000
# Short timeouts for tests; finished jobs stay visible in squeue for MinJobAge seconds.
MinJobAge=300
KillWait=$KILL_WAIT
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
        echo "NodeName=${NODES[i-1]} NodeHostname=${NODES[i-1]} NodeAddr=127.0.0.1 Port=$((PORT + i)) CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:$GPUS${FEATURES:+ Features=$FEATURES} State=UNKNOWN"
    done
    partition="Nodes=$(IFS=,; echo "${NODES[*]}") MaxTime=$MAX_TIME${DEF_MEM_PER_CPU:+ DefMemPerCPU=$DEF_MEM_PER_CPU} State=UP OverSubscribe=NO"
    if ((MEMORY_LIMIT)) && [[ -z $DEF_MEM_PER_CPU ]]; then partition+=" DefMemPerNode=2000"; fi
    if ((PREEMPT)); then
        echo "PartitionName=gpu $partition Default=YES PriorityTier=1"
        echo "PartitionName=urgent $partition PriorityTier=2"
    else
        echo "PartitionName=gpu $partition Default=YES"
    fi
} >"$CONF.new"

if ((POWER_SAVE)); then
    # slurm_requeue(job, JOB_RECONFIG_FAIL) is what Slurm's API offers a resume program whose node
    # failed to boot (contribs/cray/capmc_resume.c does it); scontrol cannot send that flag, so the
    # library is called through Python's ctypes. SLURM_RESUME_FILE (JSON) names the waiting jobs.
    libslurm=$(ls /usr/lib/*/slurm-wlm/libslurmfull.so 2>/dev/null | head -1)
    [[ -n $libslurm ]] || die "power saving needs libslurmfull.so (package slurm-wlm-basic-plugins)"
    cat >"$DIR/conf/boot-fails" <<EOF
#!/bin/bash
# Generated by slurm/local/start.sh: the ResumeProgram of nodes that fail to boot.
export SLURM_CONF=$CONF
exec /usr/bin/python3 - "\$SLURM_RESUME_FILE" <<'PY'
import ctypes, json, sys
slurm = ctypes.CDLL("$libslurm", mode=ctypes.RTLD_GLOBAL)  # its plugins need its symbols
slurm.slurm_init(None)
for job in json.load(open(sys.argv[1])).get("jobs", []):
    slurm.slurm_requeue(ctypes.c_uint32(job["job_id"]), ctypes.c_uint32(1 << 17))  # JOB_RECONFIG_FAIL
PY
EOF
    chmod 0755 "$DIR/conf/boot-fails"
fi

{
    echo "# Generated by slurm/local/start.sh -- edits are overwritten."
    echo "AutoDetect=off"
    for ((i = 1; i <= NNODES; i++)); do
        if ((${#HOST_GPUS[@]})); then
            for k in $(host_gpus_of "$i"); do echo "NodeName=${NODES[i-1]} Name=gpu File=$DIR/gpu/${NODES[i-1]}/nvidia$k"; done
        else
            echo "NodeName=${NODES[i-1]} Name=gpu File=$DIR/gpu/${NODES[i-1]}/nvidia[0-$((GPUS - 1))]"
        fi
    done
} >"$DIR/conf/gres.conf.new"

# slurmd loads a cgroup plugin whatever the task and proctrack plugins are, and on a cgroup v2 host
# it fails without systemd and D-Bus unless told to ignore them (the GPU machines: no systemd).
if [[ -e /sys/fs/cgroup/cgroup.controllers ]]; then
    printf '%s\n' "# Generated by slurm/local/start.sh -- edits are overwritten." "CgroupPlugin=cgroup/v2" \
        "IgnoreSystemd=yes" "IgnoreSystemdOnFailure=yes" "CgroupAutomount=no" >"$DIR/conf/cgroup.conf.new"
    # without systemd it makes the stepds' scope itself, in a system.slice that systemd would have made
    mkdir -p /sys/fs/cgroup/system.slice 2>/dev/null || true
else
    rm -f "$DIR/conf/cgroup.conf"
fi

if ((${#HOST_GPUS[@]})); then
    # A task's CUDA_VISIBLE_DEVICES (Slurm's numbers within its node) -> the host's numbers, with
    # CUDA numbering GPUs as nvidia-smi and /dev/nvidiaK do (PCI order). Each rank's record names
    # its GPU's UUID and bus id, so that which GPU a rank used is read, not assumed.
    {
        echo "#!/bin/bash"
        echo "# Generated by slurm/local/start.sh: the TaskProlog of a cluster on the host's GPUs."
        echo 'case $SLURMD_NODENAME in'
        for ((i = 1; i <= NNODES; i++)); do echo "    ${NODES[i-1]}) gpus=($(host_gpus_of "$i")) ;;"; done
        echo '    *) exit 0 ;;'
        echo 'esac'
        echo 'echo "export CUDA_DEVICE_ORDER=PCI_BUS_ID"'
        echo '[[ ${CUDA_VISIBLE_DEVICES:-} =~ ^[0-9]+(,[0-9]+)*$ ]] || exit 0'
        echo 'host=""'
        echo 'for g in ${CUDA_VISIBLE_DEVICES//,/ }; do host+="${host:+,}${gpus[g]}"; done'
        echo 'echo "export CUDA_VISIBLE_DEVICES=$host"'
    } >"$DIR/conf/task-prolog.new"
    chmod 0755 "$DIR/conf/task-prolog.new"
    mv "$DIR/conf/task-prolog.new" "$DIR/conf/task-prolog"
fi

# slurmdbd reads slurmdbd.conf from the folder of SLURM_CONF; the file must be private to SlurmUser.
DBD_CONF=$DIR/conf/slurmdbd.conf
DB_CNF=$DIR/conf/mariadb.cnf
DB_SOCKET=$DIR/run/mariadb.sock
DB_PASS=hpcfsdp   # a throwaway database of a test cluster, on 127.0.0.1 only
if ((OWN_DBD)); then
    (
        umask 077
        cat >"$DBD_CONF.new" <<EOF
# Generated by slurm/local/start.sh -- edits are overwritten.
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
LogFile=$DIR/log/slurmdbd.log
PidFile=$DIR/run/slurmdbd.pid
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
    )
    # A MariaDB server of this cluster only: its own data folder, socket and port. It runs as root,
    # like the Slurm daemons, so that it can write to the state folder; small buffers (a test DB).
    cat >"$DB_CNF.new" <<EOF
# Generated by slurm/local/start.sh -- edits are overwritten.
[mariadbd]
user=root
datadir=$DIR/db
socket=$DB_SOCKET
pid-file=$DIR/run/mariadb.pid
port=$DB_PORT
bind-address=127.0.0.1
skip-name-resolve
log-error=$DIR/log/mariadb.log
innodb_buffer_pool_size=32M
innodb_log_file_size=16M
# No TLS on 127.0.0.1: MariaDB 11.8 turns it on, and slurmdbd 24.11 then dies in its first query
# ("5027 ... maximum allowed number of columns", "fatal: _check_mysql_concat_is_sane").
skip-ssl
EOF
fi

# Is the daemon of this pid file alive and ours? Started with our slurm.conf on its command line, or
# (slurmdbd, mariadbd) with SLURM_CONF set to it in its environment.
ours() {
    local pidfile=$1 pid
    [[ -s $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ -r /proc/$pid/cmdline ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$CONF" && return 0
    tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qxF -- "SLURM_CONF=$CONF"
}
any_running() {
    local f
    for f in "$DIR"/run/*.pid; do [[ -e $f ]] && ours "$f" && return 0; done
    return 1
}

generated=("$CONF" "$DIR/conf/gres.conf")
if [[ -e $DIR/conf/cgroup.conf.new ]]; then generated+=("$DIR/conf/cgroup.conf"); fi
if ((OWN_DBD)); then generated+=("$DBD_CONF" "$DB_CNF"); fi
changed=0
for f in "${generated[@]}"; do
    if ! cmp -s "$f.new" "$f"; then changed=1; fi
done
if ((!OWN_DBD)) && [[ -e $DBD_CONF || -e $DB_CNF ]]; then changed=1; fi
if ((changed)); then
    if any_running; then
        log "configuration changed: restarting the daemons"
        HPCFSDP_SLURM_DIR=$DIR bash "$HERE/stop.sh"
    fi
    for f in "${generated[@]}"; do mv "$f.new" "$f"; done
    if ((!OWN_DBD)); then rm -f "$DBD_CONF" "$DB_CNF"; fi
else
    for f in "${generated[@]}"; do rm -f "$f.new"; done
fi
export SLURM_CONF=$CONF

# --- 4. munge (authentication between all Slurm daemons and clients) ----------------------------
# After a restart, not before: stop.sh stops the munged that start.sh started once no Slurm daemon
# is left on the machine, which a restart of the only cluster here is (slurmdbd would then not answer).
munge_own_ok() {
    munge --socket="$MUNGE_SOCKET_OWN" -n </dev/null 2>/dev/null | unmunge --socket="$MUNGE_SOCKET_OWN" >/dev/null 2>&1
}
if [[ -n $DEBS ]]; then
    # munged of the unpacked package, as root (there is no munge user), key and socket in the state folder.
    if ! munge_own_ok; then
        log "starting munged (socket $MUNGE_SOCKET_OWN)"
        [[ -s $DIR/conf/munge.key ]] || (umask 077 && dd if=/dev/urandom of="$DIR/conf/munge.key" bs=1024 count=1 status=none)
        mkdir -p "$DIR/munge"
        munged --force --key-file="$DIR/conf/munge.key" --socket="$MUNGE_SOCKET_OWN" --pid-file="$DIR/run/munged.pid" \
            --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/seed" </dev/null >/dev/null 2>&1 3>&- {machine_lock}>&-
        for _ in $(seq 50); do munge_own_ok && break; sleep 0.2; done
        munge_own_ok || die "munged does not answer; see $DIR/log/munged.log"
    fi
elif [[ ! -s /etc/munge/munge.key ]]; then
    log "creating /etc/munge/munge.key"
    install -d -o munge -g munge -m 0700 /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
fi
MUNGED_OURS=/run/munge/started-by-hpcfsdp   # shared by every cluster of this script on the machine
munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }
if [[ -z $DEBS ]] && ! munge_ok; then
    log "starting munged"
    # No systemd here: start it by hand, as the munge user, like the packaged service does.
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge /var/lib/munge
    # Daemons must not inherit our stdout/stderr or fd 3: a caller's `start.sh | tail -1` would
    # otherwise wait for them forever (munged keeps inherited descriptors open).
    runuser -u munge -- /usr/sbin/munged </dev/null >/dev/null 2>&1 3>&- {machine_lock}>&-
    for _ in $(seq 50); do munge_ok && break; sleep 0.2; done
    munge_ok || die "munged does not answer; see /var/log/munge/munged.log"
    touch "$MUNGED_OURS"   # stop.sh stops it once no cluster of ours runs
fi
flock -u "$machine_lock"
exec {machine_lock}>&-

# --- 5. daemons ----------------------------------------------------------------------------------
# A daemon that does not answer: its last log lines, and the process that holds its port if one
# does; then the daemons this run started are stopped (those it found running are left alone).
STARTED=()   # the pid files of the daemons this run started, in the order it started them
port_holder() {   # port: "pid P (its command line)" of the process listening on it, else nothing
    local port=$1 hex inode fd pid
    hex=$(printf ':%04X' "$port")
    inode=$(awk -v p="$hex" 'substr($2, length($2) - 4) == p && $4 == "0A" {print $10; exit}' /proc/net/tcp /proc/net/tcp6 2>/dev/null)
    [[ -n $inode ]] || return 0
    for fd in /proc/[0-9]*/fd/*; do
        [[ $(readlink "$fd" 2>/dev/null) == "socket:[$inode]" ]] || continue
        pid=${fd#/proc/}
        pid=${pid%%/*}
        echo "pid $pid ($(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-160))"
        return 0
    done
    echo "a process not seen from here (socket inode $inode)"
}
fail() {   # daemon logfile port why
    local name=$1 logfile=$2 port=$3 holder i pid
    log "ERROR: $4"
    if [[ -s $logfile ]]; then
        log "the last lines of $logfile:"
        tail -n 15 "$logfile" | sed 's/^/    /'
    fi
    if [[ -n $port ]]; then
        holder=$(port_holder "$port")
        if [[ -n $holder ]]; then log "port $port ($name's) is held by $holder"; else log "port $port ($name's): nothing listens on it"; fi
    fi
    for ((i = ${#STARTED[@]} - 1; i >= 0; i--)); do
        ours "${STARTED[i]}" || continue
        pid=$(<"${STARTED[i]}")
        log "stopping $(basename "${STARTED[i]}" .pid) (pid $pid), which this run started"
        kill -TERM "$pid" 2>/dev/null || continue
        for _ in $(seq 50); do [[ -e /proc/$pid ]] || break; sleep 0.2; done
        kill -KILL "$pid" 2>/dev/null || true
        rm -f "${STARTED[i]}"
    done
    exit 1
}
# Accounting first: slurmctld registers with slurmdbd as it starts.
db() { mariadb --defaults-file="$DB_CNF" --socket="$DB_SOCKET" --skip-ssl -uroot "$@"; }
if ((OWN_DBD)); then
    if ours "$DIR/run/mariadb.pid"; then
        log "mariadbd already running (pid $(<"$DIR/run/mariadb.pid"))"
    else
        if [[ ! -d $DIR/db/mysql ]]; then
            log "creating the accounting database in $DIR/db"
            mariadb-install-db --defaults-file="$DB_CNF" --auth-root-authentication-method=socket --skip-test-db \
                </dev/null >>"$DIR/log/mariadb-install.out" 2>&1 3>&- ||
                die "mariadb-install-db failed; see $DIR/log/mariadb-install.out"
        fi
        log "starting mariadbd (port $DB_PORT)"
        rm -f "$DIR/run/mariadb.pid"
        setsid mariadbd --defaults-file="$DB_CNF" </dev/null >>"$DIR/log/mariadb.out" 2>&1 3>&- &
        mariadbd_pid=$!
        STARTED+=("$DIR/run/mariadb.pid")
        for _ in $(seq 150); do
            db -e 'SELECT 1' >/dev/null 2>&1 && break
            kill -0 "$mariadbd_pid" 2>/dev/null || break   # it ended: no use waiting
            sleep 0.2
        done
        db -e 'SELECT 1' >/dev/null 2>&1 || fail mariadbd "$DIR/log/mariadb.log" "$DB_PORT" "mariadbd does not answer"
    fi
    db -e "CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
           GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" || die "cannot create the database user slurm"
    if ours "$DIR/run/slurmdbd.pid"; then
        log "slurmdbd already running (pid $(<"$DIR/run/slurmdbd.pid"))"
    else
        log "starting slurmdbd (port $DBD_PORT)"
        rm -f "$DIR/run/slurmdbd.pid"
        STARTED+=("$DIR/run/slurmdbd.pid")
        slurmdbd </dev/null >>"$DIR/log/slurmdbd.out" 2>&1 3>&- || fail slurmdbd "$DIR/log/slurmdbd.log" "$DBD_PORT" "slurmdbd failed to start"
    fi
fi
if ((ACCOUNTING)); then
    # The cluster must be in the database before slurmctld registers with slurmdbd.
    for _ in $(seq 150); do
        clusters=$(sacctmgr --noheader --parsable2 list cluster format=cluster 2>/dev/null) && break
        clusters=NONE
        sleep 0.2
    done
    [[ $clusters != NONE ]] || fail slurmdbd "$DIR/log/slurmdbd.log" "$DBD_PORT" "slurmdbd does not answer"
    if ! grep -qxF "$CLUSTER" <<<"$clusters"; then
        log "registering cluster $CLUSTER with slurmdbd"
        sacctmgr --immediate add cluster "$CLUSTER" >/dev/null || die "sacctmgr add cluster $CLUSTER failed"
    fi
fi
started_at=$(date +%s)
fresh=()   # nodes whose slurmd we start now: they must register anew before we report ready
if ours "$DIR/run/slurmctld.pid"; then
    log "slurmctld already running (pid $(<"$DIR/run/slurmctld.pid"))"
else
    log "starting slurmctld (port $PORT)"
    rm -f "$DIR/run/slurmctld.pid"
    STARTED+=("$DIR/run/slurmctld.pid")
    slurmctld -f "$CONF" </dev/null >>"$DIR/log/slurmctld.out" 2>&1 3>&- || fail slurmctld "$DIR/log/slurmctld.log" "$PORT" "slurmctld failed to start"
fi
for n in "${NODES[@]}"; do
    if ours "$DIR/run/slurmd-$n.pid"; then
        log "slurmd $n already running (pid $(<"$DIR/run/slurmd-$n.pid"))"
    else
        log "starting slurmd $n"
        rm -f "$DIR/run/slurmd-$n.pid"
        STARTED+=("$DIR/run/slurmd-$n.pid")
        # shellcheck disable=SC2086
        slurmd -f "$CONF" -N "$n" ${DEBS:+-d $PKG/usr/sbin/slurmstepd} </dev/null >>"$DIR/log/slurmd-$n.out" 2>&1 3>&- ||
            fail "slurmd $n" "$DIR/log/slurmd-$n.log" "$((PORT + ${n#hpcfsdp-n}))" "slurmd $n failed to start"
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
    # A daemon that ended (a port taken, a bad configuration) will not register: no use waiting.
    # (It writes its pid file a moment after it starts: 5 s of grace.)
    if ((SECONDS >= deadline - TIMEOUT + 5)); then
        ours "$DIR/run/slurmctld.pid" || fail slurmctld "$DIR/log/slurmctld.log" "$PORT" "slurmctld ended"
        for n in "${fresh[@]}"; do
            ours "$DIR/run/slurmd-$n.pid" || fail "slurmd $n" "$DIR/log/slurmd-$n.log" "$((PORT + ${n#hpcfsdp-n}))" "slurmd $n ended"
        done
    fi
    if ((SECONDS >= deadline)); then
        printf '    %s\n' "$states"
        fail slurmctld "$DIR/log/slurmctld.log" "$PORT" "nodes not idle after ${TIMEOUT}s; logs are in $DIR/log/"
    fi
    sleep 1
done
sinfo -N -o '%N %t %c %m %G' | sed 's/^/    /'
started_release=$(slurmctld -V 2>/dev/null | grep -oE '[0-9]+\.[0-9]+(\.[0-9]+)?' | head -1)
if ((OWN_DBD)); then
    database=", MariaDB $(mariadbd --version 2>/dev/null | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | head -1)"
else
    database=""
fi
if ((ACCOUNTING)); then
    log "cluster $CLUSTER is up: Slurm $started_release$database, with accounting (logs: $DIR/log/)"
else
    log "cluster $CLUSTER is up: Slurm $started_release, without accounting (logs: $DIR/log/)"
fi

echo "export SLURM_CONF=$CONF" >&3
