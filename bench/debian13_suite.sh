#!/usr/bin/env bash
# The test suite on Debian 13 (Slurm 24.11, MariaDB 11.8, Python 3.13) on any Debian machine:
# a Debian 13 root made with debootstrap from deb.debian.org, Debian 13's packages installed in it,
# a clone of this checkout at one commit, its venv (env/setup.sh --dev), and the tests run inside
# it (chroot, with /proc, /sys and /dev bound). Issue 53; docs/clusters.md and docs/testing.md.
#
# Usage (as root; CPU-heavy, so nice it on a shared machine):
#   nice -n 10 bench/debian13_suite.sh [--root DIR] [--commit REV] [--log FILE] [--shell] [-- PYTEST-ARGS]
#     --root DIR     the Debian 13 root, made if missing and reused   [/var/tmp/hpcfsdp-debian13]
#     --commit REV   the commit of this checkout to test               [HEAD]
#     --log FILE     where pytest's output goes as well, and FILE's stem + .xml pytest's JUnit XML
#                    (each test's outcome; kept even when xdist's teardown fails) [stdout only]
#     --shell        a shell in the root, in the clone, instead of the tests: `slurm/local/start.sh`
#                    there starts Slurm 24.11 with MariaDB 11.8 (HPCFSDP_SLURM_RELEASE=24.11)
#     PYTEST-ARGS    [-n 2 --dist loadfile: the README's test command]; -v -rfE always go first, so
#                    each test's name and outcome is in the log as it ends and a summary names each
#                    failure and error, even when a crashed worker or a stop leaves no summary
# HPCFSDP_SLURM_DIR, HPCFSDP_SLURM_PORT and HPCFSDP_SLURM_FIRST_JOB_ID pass into the root (the
# root shares this machine's network: a cluster there needs ports of its own).
# Needs: deb.debian.org (debootstrap and apt) and PyPI. debootstrap is taken from Debian's packages
# (apt-get download, unpacked) where it is not installed. The root takes about 5 GB: Python 3.13
# gets PyPI's build of torch 2.13.0, the CUDA one (CPU builds for cp313 are on
# download.pytorch.org only), which runs on the CPU here.
set -euo pipefail

ROOT=/var/tmp/hpcfsdp-debian13
COMMIT=HEAD
LOG=""
SHELL_ONLY=0
PYTEST_ARGS=(-n 2 --dist loadfile)
while (($#)); do
    case $1 in
        --root) ROOT=$2; shift ;;
        --commit) COMMIT=$2; shift ;;
        --log) LOG=$2; shift ;;
        --shell) SHELL_ONLY=1 ;;
        --) shift; PYTEST_ARGS=("$@"); break ;;
        -h | --help) sed -n '2,24p' "$0"; exit 0 ;;
        *) echo "debian13_suite.sh: unknown option '$1' (--help)" >&2; exit 2 ;;
    esac
    shift
done
[[ $(id -u) == 0 ]] || { echo "debian13_suite.sh: must run as root (debootstrap, chroot, mounts)" >&2; exit 2; }
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SHA=$(git -C "$REPO" rev-parse --verify "$COMMIT^{commit}")
MIRROR=http://deb.debian.org/debian
say() { echo "[debian13] $(date -u +%H:%M:%S) $*" >&2; }

# --- the root -------------------------------------------------------------------------------------
if ! grep -q '^VERSION_CODENAME=trixie' "$ROOT/etc/os-release" 2>/dev/null; then
    [[ ! -e $ROOT ]] || { echo "debian13_suite.sh: $ROOT exists and is no Debian 13 root" >&2; exit 2; }
    debootstrap=(debootstrap)
    if ! command -v debootstrap >/dev/null; then
        tools=$(mktemp -d)
        say "debootstrap from Debian's packages (apt-get download, unpacked in $tools)"
        (cd "$tools" && apt-get download -q debootstrap >/dev/null 2>&1 && dpkg -x debootstrap_*.deb x)
        export DEBOOTSTRAP_DIR=$tools/x/usr/share/debootstrap
        debootstrap=("$tools/x/usr/sbin/debootstrap")
    fi
    say "debootstrap --variant=minbase trixie $ROOT $MIRROR"
    "${debootstrap[@]}" --variant=minbase trixie "$ROOT.partial" "$MIRROR" >&2
    mv "$ROOT.partial" "$ROOT"
fi

mounted=()
unmount() {
    local i
    for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do umount -R -l "${mounted[i]}" 2>/dev/null || true; done
}
trap unmount EXIT
bind() {   # what where: bound once
    mountpoint -q "$ROOT$2" && return 0
    mkdir -p "$ROOT$2"
    mount --rbind "$1" "$ROOT$2"
    mount --make-rslave "$ROOT$2"
    mounted+=("$ROOT$2")
}
# The root a mount point of its own, bound onto itself: in a chroot into a plain folder `/` is no
# mount point, and podman cannot run there (containers/storage makes `/` private to unpack an image
# and runc pivots a container's root: the kernel refuses both, EINVAL). The container tests need it.
if ! mountpoint -q "$ROOT"; then
    mount --bind "$ROOT" "$ROOT"
    mount --make-rslave "$ROOT"
    mounted+=("$ROOT")
fi
bind /proc /proc
bind /sys /sys
bind /dev /dev
# The root is this machine: its name must resolve there as here (torchrun --standalone
# rendezvouses on the host name; without it a local cell waits out c10d's 300 s timeout).
cp /etc/resolv.conf /etc/hosts "$ROOT/etc/"
# This network's CA bundle, for pip (a proxy here signs PyPI's certificates with its own CA).
HOST_CA=/etc/ssl/certs/ca-certificates.crt
if [[ -s $HOST_CA ]]; then cp "$HOST_CA" "$ROOT/etc/host-ca-bundle.crt"; fi
in_root() {   # a command in the root, with a plain environment and the cluster's place
    chroot "$ROOT" env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 \
        TERM="${TERM:-dumb}" DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 \
        ${HOST_CA:+PIP_CERT=/etc/host-ca-bundle.crt} \
        ${HPCFSDP_SLURM_DIR:+HPCFSDP_SLURM_DIR=$HPCFSDP_SLURM_DIR} ${HPCFSDP_SLURM_PORT:+HPCFSDP_SLURM_PORT=$HPCFSDP_SLURM_PORT} \
        ${HPCFSDP_SLURM_FIRST_JOB_ID:+HPCFSDP_SLURM_FIRST_JOB_ID=$HPCFSDP_SLURM_FIRST_JOB_ID} "$@"
}

# --- Debian 13's packages ---------------------------------------------------------------------------
# What the suite needs beside what the tests install themselves: Python 3.13 and git; Slurm, munge
# and MariaDB (start.sh would install them too, one worker at a time). No service starts in the
# root (policy-rc.d: 101). g++: inductor compiles on CPU (the compiled loss, cut-cross-entropy's
# kernels), as on the Debian 12 machine, which has it.
PACKAGES=(ca-certificates git python3 python3-venv python3-dev procps iproute2 g++ slurm-wlm slurmdbd munge mariadb-server)
if ! in_root dpkg -s "${PACKAGES[@]}" >/dev/null 2>&1; then
    say "apt-get install ${PACKAGES[*]}"
    printf '#!/bin/sh\nexit 101\n' >"$ROOT/usr/sbin/policy-rc.d"
    chmod 0755 "$ROOT/usr/sbin/policy-rc.d"
    in_root apt-get update -q >&2
    in_root apt-get install -y -q --no-install-recommends "${PACKAGES[@]}" >&2
    rm -f "$ROOT/usr/sbin/policy-rc.d"
fi
say "in the root: $(in_root python3 --version), $(in_root slurmctld -V), MariaDB $(in_root mariadbd --version | grep -oE '[0-9]+\.[0-9]+\.[0-9]+' | head -1)"

# --- the checkout and its venv ------------------------------------------------------------------------
CLONE=/work/hpcfsdp
if [[ $(git -C "$ROOT$CLONE" rev-parse HEAD 2>/dev/null) != "$SHA" ]]; then
    say "cloning $REPO at $SHA into $ROOT$CLONE"
    mkdir -p "$ROOT$CLONE"
    if [[ ! -d $ROOT$CLONE/.git ]]; then git clone -q --no-checkout "$REPO" "$ROOT$CLONE"; fi
    git -C "$ROOT$CLONE" fetch -q "$REPO" "$SHA"
    git -C "$ROOT$CLONE" -c advice.detachedHead=false checkout -q -f "$SHA"
    git -C "$ROOT$CLONE" clean -q -fdx -e .venv
fi
# The venv is made again when it does not import or pyproject.toml changed since it was made (a new
# dependency of the tests; setup.sh keeps what is installed already).
STAMP=$ROOT$CLONE/.venv/pyproject.sha256
if ! in_root "$CLONE/.venv/bin/python" -c 'import hpcfsdp, pytest, torch' 2>/dev/null ||
    [[ $(cat "$STAMP" 2>/dev/null) != $(sha256sum <"$ROOT$CLONE/pyproject.toml") ]]; then
    say "env/setup.sh --dev in the root (Python 3.13)"
    in_root bash -c "cd $CLONE && bash env/setup.sh --dev" >&2
    sha256sum <"$ROOT$CLONE/pyproject.toml" >"$STAMP"
fi
say "venv: $(in_root "$CLONE/.venv/bin/python" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)')"

if ((SHELL_ONLY)); then
    say "a shell in the root ($CLONE); exit to leave (the mounts are undone)"
    in_root bash -c "cd $CLONE && exec bash -i"
    exit
fi

# --- the suite ------------------------------------------------------------------------------------------
JUNIT=/tmp/debian13-junit.xml   # in the root
PYTEST_ARGS=(-v -rfE ${LOG:+--junitxml=$JUNIT} "${PYTEST_ARGS[@]}")
say "pytest ${PYTEST_ARGS[*]} at $SHA (Slurm 24.11, Python 3.13)"
started=$SECONDS
set +e
if [[ -n $LOG ]]; then
    rm -f "$ROOT$JUNIT"
    in_root bash -c "cd $CLONE && .venv/bin/python -m pytest $(printf '%q ' "${PYTEST_ARGS[@]}")" 2>&1 | tee "$LOG"
    code=${PIPESTATUS[0]}
    if [[ -s $ROOT$JUNIT ]]; then cp "$ROOT$JUNIT" "${LOG%.*}.xml"; fi
else
    in_root bash -c "cd $CLONE && .venv/bin/python -m pytest $(printf '%q ' "${PYTEST_ARGS[@]}")"
    code=$?
fi
set -e
say "pytest exited $code after $((SECONDS - started)) s at $SHA"
# The clusters the tests started are stopped by the tests; any left (a crash) are stopped here.
for conf in "$ROOT"/tmp/hpcfsdp-slurm*/conf/slurm.conf ${HPCFSDP_SLURM_DIR:+"$ROOT$HPCFSDP_SLURM_DIR"*/conf/slurm.conf}; do
    [[ -e $conf ]] || continue
    dir=${conf%/conf/slurm.conf}
    in_root env HPCFSDP_SLURM_DIR="${dir#"$ROOT"}" bash "$CLONE/slurm/local/stop.sh" 2>/dev/null || true
done
# stop.sh leaves munged to run while any Slurm daemon runs on the machine, and it sees this
# machine's own: the root's munged is stopped here (the one whose root is this one).
if [[ -s $ROOT/run/munge/munged.pid ]] && pid=$(<"$ROOT/run/munge/munged.pid") &&
    [[ $(readlink "/proc/$pid/root" 2>/dev/null) == "$(realpath "$ROOT")" ]]; then
    kill -TERM "$pid" 2>/dev/null || true
fi
exit "$code"
