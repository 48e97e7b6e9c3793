#!/usr/bin/env bash
# The README's test command on a bare machine, as CI's first run meets it (docs/testing.md): every
# package the tests or the setup install themselves is purged (Slurm, munge, MariaDB, podman, runc,
# Chromium), hpcfsdp's cache (mypy's) removed, and the command runs in a fresh clone of COMMIT.
#   bash bench/bare_machine.sh [COMMIT] [LOG]        # as root, on a machine of no other work
# COMMIT defaults to HEAD; LOG to bench/results/<date>-cpu/bare_machine_<commit>.log. The clone
# is /tmp/hpcfsdp-bare-<commit>; the log's last lines give the seed, the counts and the times.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
commit=$(git rev-parse --short "${1:-HEAD}")
log=${2:-$PWD/bench/results/$(date -u +%F)-cpu/bare_machine_$commit.log}
mkdir -p "$(dirname "$log")"
for daemon in slurmctld slurmd slurmdbd munged mariadbd; do  # pgrep -x matches 15 characters at most
  if pgrep -x "$daemon" >/dev/null; then
    echo "bare_machine: $daemon still runs (pgrep -a $daemon); stop it first" >&2
    exit 2
  fi
done
export DEBIAN_FRONTEND=noninteractive
packages=(slurm-wlm slurmctld slurmd slurmdbd slurm-client munge mariadb-server podman runc chromium)
installed=()
for package in "${packages[@]}"; do
  dpkg -s "$package" >/dev/null 2>&1 && installed+=("$package")
done
{
  echo "== bare machine: commit $commit, $(date -u), purging: ${installed[*]:-nothing}"
  if ((${#installed[@]})); then
    apt-get purge -y -q "${installed[@]}" >/dev/null && apt-get autoremove -y -q --purge >/dev/null
  fi
  for tool in sbatch slurmctld munged mariadbd podman chromium; do
    ! command -v "$tool" >/dev/null || { echo "still installed: $tool"; exit 2; }
  done
  rm -rf "${XDG_CACHE_HOME:-$HOME/.cache}/hpcfsdp"
  clone=/tmp/hpcfsdp-bare-$commit
  rm -rf "$clone" && git clone -q "$PWD" "$clone" && git -C "$clone" checkout -q "$commit"
  cd "$clone"
  start=$SECONDS
  status=0
  bash .ci/run || status=$?
  echo "== exit $status; $((SECONDS - start)) s with the setup; $(date -u)"
  exit "$status"
} 2>&1 | tee "$log"
