#!/usr/bin/env bash
# On a 4-GPU machine, in one device call: bench/gpu_acceptance.sh on GPUs 0,1 and, beside it,
# bench/launch_phases.sh on GPUs 2,3 (each on its own pair, so neither's processes are the other's
# "left on a GPU"); with SEARCH_7B=1, bench/batch_search_7b.sh after it on GPUs 2,3 in what is
# left of PHASES_LIMIT_S (TUNE=1 is passed on to launch_phases.sh). The wheels are installed once, before either starts (two pip installs into
# /tmp/site at once would replace files the other is importing). Outputs: $OUT/acceptance/ and
# $OUT/phases/, and each script's console in $OUT/*.out.
#   BENCH_COMMIT=<commit> TUNE=1 SEARCH_7B=1 bash bench/acceptance_beside_phases.sh      # carry .whl
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
phases_side() {
  local deadline=$(( SECONDS + ${PHASES_LIMIT_S:-560} ))
  timeout "${PHASES_LIMIT_S:-560}" bash bench/launch_phases.sh
  echo "launch_phases.sh exited $?"
  if [[ ${SEARCH_7B:-0} == 1 ]] && (( deadline - SECONDS > 60 )); then
    timeout $(( deadline - SECONDS )) bash bench/batch_search_7b.sh
    echo "batch_search_7b.sh exited $?"
  fi
}
CUDA_VISIBLE_DEVICES=2,3 OUT="$out/phases" phases_side >"$out/phases.out" 2>&1 &
phases=$!
wait "$acceptance"; echo "gpu_acceptance.sh exited $?"
wait "$phases"
tail -30 "$out/acceptance.out"
tail -25 "$out/phases.out"
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
