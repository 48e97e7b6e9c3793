#!/usr/bin/env bash
# Stop the local Slurm cluster started by slurm/local/start.sh.
#
# Usage:  slurm/local/stop.sh [--purge]
#   --purge   also delete the state folder (configuration, logs, job state, fake GPU files)
#
# Only the daemons named by the pid files in the state folder are stopped (slurmd, slurmctld, then
# the accounting: slurmdbd and the cluster's own MariaDB server), and only if they run with that
# folder's slurm.conf; other Slurm daemons on the machine are left alone. Jobs still running on
# this cluster are cancelled first. munged is stopped too if start.sh started it and no Slurm
# daemon is left on the machine.
# Idempotent: nothing running is fine.
set -euo pipefail

DIR=${HPCFSDP_SLURM_DIR:-/tmp/hpcfsdp-slurm}
CONF=$DIR/conf/slurm.conf
PURGE=0
for arg in "$@"; do
    case $arg in
        --purge) PURGE=1 ;;
        -h | --help) sed -n '2,10p' "$0"; exit 0 ;;
        *) echo "usage: $0 [--purge]" >&2; exit 2 ;;
    esac
done

log() { echo "[hpcfsdp-slurm] $*" >&2; }

# A cluster run from unpacked packages (start.sh's HPCFSDP_SLURM_DEBS): its programs and libraries.
# shellcheck disable=SC1091
if [[ -f $DIR/conf/env.sh ]]; then source "$DIR/conf/env.sh"; fi

# Pid from a pid file if that process is alive and was started with our slurm.conf: on its command
# line, or (slurmdbd, mariadbd) as SLURM_CONF in its environment.
our_pid() {
    local pidfile=$1 pid
    [[ -s $pidfile ]] || return 1
    pid=$(<"$pidfile")
    [[ -r /proc/$pid/cmdline ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -qF -- "$CONF" ||
        tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -qxF -- "SLURM_CONF=$CONF" || return 1
    echo "$pid"
}

descendants() {   # pid: every process below it
    local child
    for child in $(pgrep -P "$1" || true); do
        echo "$child"
        descendants "$child"
    done
}

stop_pid() {   # name pid: SIGTERM, wait up to 15 s, then SIGKILL
    local name=$1 pid=$2
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || return 0
    for _ in $(seq 75); do
        [[ -e /proc/$pid ]] || return 0
        sleep 0.2
    done
    log "$name did not stop, sending SIGKILL"
    kill -KILL "$pid" 2>/dev/null || true
}

if [[ -d $DIR/run ]]; then
    ctld_pid=$(our_pid "$DIR/run/slurmctld.pid") || ctld_pid=""

    # Cancel jobs first so no job steps (slurmstepd, user processes) outlive their slurmd.
    jobs=()
    if [[ -n $ctld_pid ]]; then
        mapfile -t jobs < <(SLURM_CONF=$CONF squeue -h -t RUNNING,PENDING,SUSPENDED,CONFIGURING,COMPLETING -o %A 2>/dev/null || true)
    fi
    if ((${#jobs[@]})); then
        log "cancelling jobs: ${jobs[*]}"
        SLURM_CONF=$CONF scancel "${jobs[@]}" 2>/dev/null || true
        # Wait (KillWait=5 s plus a margin) until they are gone.
        for _ in $(seq 30); do
            left=$(SLURM_CONF=$CONF squeue -h -t RUNNING,COMPLETING,CONFIGURING -o %A 2>/dev/null) || break
            [[ -z $left ]] && break
            sleep 1
        done
    fi

    for pidfile in "$DIR"/run/slurmd-*.pid; do
        [[ -e $pidfile ]] || continue
        name=$(basename "$pidfile" .pid)
        if pid=$(our_pid "$pidfile"); then stop_pid "$name" "$pid"; fi
        rm -f "$pidfile"
    done
    # A job step that outlived its slurmd (its job did not end in time) would go on running with
    # what it runs: end both, the step's own processes too.
    if command -v pgrep >/dev/null; then
        for stepd in $(pgrep -x slurmstepd || true); do
            tr '\0' '\n' <"/proc/$stepd/environ" 2>/dev/null | grep -qxF -- "SLURM_CONF=$CONF" || continue
            log "ending a job step left running (slurmstepd pid $stepd)"
            # shellcheck disable=SC2046
            kill -KILL $(descendants "$stepd") "$stepd" 2>/dev/null || true
        done
    fi
    if [[ -n $ctld_pid ]]; then stop_pid slurmctld "$ctld_pid"; fi
    rm -f "$DIR/run/slurmctld.pid"
    # Accounting last: slurmctld hands slurmdbd what it still holds as it stops.
    for name in slurmdbd mariadb; do
        if pid=$(our_pid "$DIR/run/$name.pid"); then stop_pid "$name" "$pid"; fi
        rm -f "$DIR/run/$name.pid"
    done
fi

# The munged of a cluster run from unpacked packages is its own (its key and socket in the state folder).
if [[ -s $DIR/run/munged.pid ]] && pid=$(<"$DIR/run/munged.pid") && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$DIR/"; then
    stop_pid munged "$pid"
    rm -f "$DIR/run/munged.pid"
fi

# munged, if start.sh started it, once no Slurm daemon runs on this machine any more (another
# cluster of this script, with another state folder, may still need it).
MUNGED_OURS=/run/munge/started-by-hpcfsdp
slurm_daemons_left() { local d; for d in slurmctld slurmd slurmdbd; do pgrep -x "$d" >/dev/null && return 0; done; return 1; }
if [[ -e $MUNGED_OURS ]] && command -v pgrep >/dev/null && ! slurm_daemons_left; then
    if [[ -s /run/munge/munged.pid ]] && pid=$(</run/munge/munged.pid) && [[ -e /proc/$pid ]]; then
        stop_pid munged "$pid"
    fi
    rm -f "$MUNGED_OURS"
fi

if ((PURGE)); then
    # Guard against an unlucky HPCFSDP_SLURM_DIR (/, /etc, ...): only delete a folder we made.
    if [[ -f $CONF ]] && grep -q '^# Generated by slurm/local/start.sh' "$CONF"; then
        log "removing $DIR"
        rm -rf -- "$DIR"
    elif [[ -e $DIR ]]; then
        log "not removing $DIR: it holds no slurm.conf written by start.sh"
    fi
fi
log "stopped"
