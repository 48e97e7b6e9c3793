#!/usr/bin/env bash
# Run whole matrices on this (GPU) machine through `hpcfsdp submit --executor local`, i.e. one
# `torchrun ... -m hpcfsdp run` per cell, then collect. Raw logs and records are packed into one
# archive per sweep under $OUT (or ./bench-out), with the summary table beside it.
#   bash bench/gpu_matrix.sh jobs/gpu_strategies.yaml [jobs/other.yaml ...]
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$root/bench-out}"
mkdir -p "$out"
cd "$root"
source bench/gpu_env.sh
results="$(mktemp -d)"
write_machine_info "$out/machine.txt"
for jobs in "$@"; do
  name="$(python3 -c 'import sys; from hpcfsdp.sweep.matrix import load_sweep; print(load_sweep(sys.argv[1]).name)' "$jobs")"
  python3 -m hpcfsdp submit "$jobs" --executor local --results-dir "$results" --force 2>&1 | tee "$out/$name.log"
  cp "$results/$name/report/summary.md" "$out/$name.summary.md" 2>/dev/null
  tar -czf "$out/$name.tar.gz" -C "$results" "$name"
done
