#!/usr/bin/env bash
# The README's first command in a fresh Debian container (issues 46 and 53): a minbase root made
# with debootstrap (no container registry answers here), imported into podman, and a clean clone
# of one commit bound at /repo. Only this network's CA bundle is passed in (PIP_CERT): pip takes
# everything else from PyPI, as a user's machine would.
#
# Usage (as root): [README_COMMAND=tests] nice -n 10 bench/readme_container.sh SUITE ROOT [COMMIT] >LOG 2>&1
#   README_COMMAND  main (the README's first command, the default) or tests (its second: .ci/run,
#                   which runs the README's test command exactly)
#   SUITE   bookworm (Debian 12, Python 3.11) or trixie (Debian 13, Python 3.13)
#   ROOT    a `debootstrap --variant=minbase SUITE ROOT http://deb.debian.org/debian` root, made
#           here if missing (debootstrap from Debian's packages where it is not installed)
#   COMMIT  [HEAD]
set -euo pipefail

SUITE=${1:?bookworm or trixie}
ROOT=${2:?the root folder}
COMMIT=${3:-HEAD}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
SHA=$(git -C "$REPO" rev-parse --verify "$COMMIT^{commit}")
# The test command starts Slurm's daemons (with cgroups for its memory limits) and podman for the
# container tests, as root on a machine would: the container gets a machine's rights
# (--privileged) and a /tmp on this machine's file system (podman's overlay storage cannot sit on
# the container's own overlay).
MACHINE=()
case ${README_COMMAND:-main} in
    main) COMMAND='bash env/setup.sh && .venv/bin/hpcfsdp submit jobs/smoke.yaml --wait' ;;
    tests) COMMAND='bash .ci/run'; scratch=$(mktemp -d /var/tmp/readme-tmp.XXXXXX); MACHINE=(--privileged -v "$scratch:/tmp") ;;
    *) echo "readme_container.sh: README_COMMAND is main or tests, not '$README_COMMAND'" >&2; exit 2 ;;
esac

if [[ ! -e $ROOT/etc/os-release ]]; then
    debootstrap=(debootstrap)
    if ! command -v debootstrap >/dev/null; then
        tools=$(mktemp -d)
        (cd "$tools" && apt-get download -q debootstrap >/dev/null 2>&1 && dpkg -x debootstrap_*.deb x)
        export DEBOOTSTRAP_DIR=$tools/x/usr/share/debootstrap
        debootstrap=("$tools/x/usr/sbin/debootstrap")
    fi
    "${debootstrap[@]}" --variant=minbase "$SUITE" "$ROOT" http://deb.debian.org/debian >&2
fi
image=localhost/hpcfsdp-readme-$SUITE
tar -C "$ROOT" -c . | podman import -q - "$image" >/dev/null
clone=$(mktemp -d)
trap 'rm -rf "$clone" ${scratch:+"$scratch"}; podman rmi -f "$image" >/dev/null 2>&1 || true' EXIT
git clone -q "$REPO" "$clone/repo"
git -C "$clone/repo" -c advice.detachedHead=false checkout -q "$SHA"

echo "# The README's ${README_COMMAND:-main} command in a fresh $SUITE container, $(date -u)"
echo "# image: debootstrap --variant=minbase $SUITE, podman import; checkout: git clone of $SHA"
echo "# passed in: the host's CA bundle as PIP_CERT (this network's egress proxy), nothing else"
echo "# command: $COMMAND"
started=$SECONDS
set +e
# This machine's podman: runc (crun refuses the hybrid cgroup layout), cgroupfs and a file for
# events (no systemd, no journald), and ulimits no higher than this shell's (root without
# CAP_SYS_RESOURCE cannot raise them: "error setting rlimit type 7"), as tests/container_image.py.
podman --runtime runc --cgroup-manager cgroupfs --events-backend file run --rm --network host \
    --ulimit "nofile=$(ulimit -Sn):$(ulimit -Hn)" --ulimit "nproc=32768:32768" "${MACHINE[@]}" -v "$clone/repo:/repo" -v /etc/ssl/certs/ca-certificates.crt:/host-ca.crt:ro \
    -e PIP_CERT=/host-ca.crt -w /repo "$image" bash -c "$COMMAND" 2>&1
code=$?
set -e
echo "# exit $code after $((SECONDS - started)) s"
exit "$code"
