#!/usr/bin/env bash
# Run whole matrices on this (GPU) machine through `hpcfsdp submit --executor local`, i.e. one
# `torchrun ... -m hpcfsdp run` per cell, then collect. Raw logs and records are packed into one
# archive per sweep under $OUT (or ./bench-out), with the summary table beside it.
#   bash bench/gpu_matrix.sh bench/jobs/gpu_strategies.yaml [jobs/other.yaml ...]
#   GPUS_PER_NODE=1 bash bench/gpu_matrix.sh bench/jobs/overhead.yaml   # the matrix on fewer GPUs
# SWEEP_TIMEOUT_S (default: none) stops a sweep's submit after that many seconds; the cells that
# finished are collected and packed all the same.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/gpu_env.sh  # root, out (made) and python
results="$(mktemp -d)"
write_machine_info "$out/machine.txt"
for jobs in "$@"; do
  if [[ -n "${GPUS_PER_NODE:-}" ]]; then  # the same YAML with base.gpus_per_node replaced
    copy="$results/$(basename "$jobs")"
    python3 - "$jobs" "$copy" "$GPUS_PER_NODE" <<'PY'
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
doc.setdefault("base", {})["gpus_per_node"] = int(sys.argv[3])
yaml.safe_dump(doc, open(sys.argv[2], "w"), sort_keys=False)
PY
    jobs="$copy"
  fi
  name="$(python3 -c 'import sys; from hpcfsdp.sweep.define.matrix import load_sweep; print(load_sweep(sys.argv[1]).name)' "$jobs")"
  echo "[matrix] $(date -u +%T) $name${GPUS_PER_NODE:+ on $GPUS_PER_NODE GPU(s) per node}"
  timeout --kill-after=15 "${SWEEP_TIMEOUT_S:-0}" python3 -m hpcfsdp submit "$jobs" --executor local \
    --results-dir "$results" --force 2>&1 | tee "$out/$name.log"
  [[ -f "$results/$name/report/summary.md" ]] || python3 -m hpcfsdp collect "$results/$name" >> "$out/$name.log" 2>&1
  cp "$results/$name/report/summary.md" "$out/$name.summary.md" 2>/dev/null
  tar -czf "$out/$name.tar.gz" -C "$results" "$name"
done
