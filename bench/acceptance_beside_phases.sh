#!/usr/bin/env bash
# On a 4-GPU machine, in one device call: bench/gpu_acceptance.sh on GPUs 0,1 and, beside it,
# bench/launch_phases.sh on GPUs 2,3 (each on its own pair, so neither's processes are the other's
# "left on a GPU"). The wheels are installed once, before either starts (two pip installs into
# /tmp/site at once would replace files the other is importing). Outputs: $OUT/acceptance/ and
# $OUT/phases/, and each script's console in $OUT/*.out.
#   BENCH_COMMIT=<commit> bash bench/acceptance_beside_phases.sh      # carry .whl
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
out="${OUT:-$root/bench-out}"
mkdir -p "$out/acceptance" "$out/phases"
source bench/gpu_env.sh
export BENCH_WHEELS_INSTALLED=1 CUDA_DEVICE_ORDER=PCI_BUS_ID   # nvidia-smi's numbers are CUDA's
CUDA_VISIBLE_DEVICES=0,1 OUT="$out/acceptance" timeout "${ACCEPTANCE_LIMIT_S:-570}" bash bench/gpu_acceptance.sh \
  >"$out/acceptance.out" 2>&1 &
acceptance=$!
CUDA_VISIBLE_DEVICES=2,3 OUT="$out/phases" timeout "${PHASES_LIMIT_S:-560}" bash bench/launch_phases.sh \
  >"$out/phases.out" 2>&1 &
phases=$!
wait "$acceptance"; echo "gpu_acceptance.sh exited $?"
wait "$phases"; echo "launch_phases.sh exited $?"
tail -30 "$out/acceptance.out"
tail -25 "$out/phases.out"
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
