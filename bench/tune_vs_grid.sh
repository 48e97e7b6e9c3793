#!/usr/bin/env bash
# issue 36: `hpcfsdp tune` against the whole grid of the same YAML, both with the local executor
# on this machine, then one table (bench/tune_vs_grid_table.py): the grid's best and top three,
# tune's pick and where the grid ranks it, and what each spent in GPU-hours, counted as wall time
# per launch x its GPUs (tune: its launches; the grid: the whole submit's wall time x GPUs, which
# is its launches one after another). Raw logs, records and the table go to $OUT (./bench-out).
#   bash bench/tune_vs_grid.sh                                   # bench/jobs/tune_zero2_vs_zero3.yaml, GPUs
#   SMOKE=1 bash bench/tune_vs_grid.sh                           # the tiny model on CPU, a small matrix
#   SKIP_GRID=1 GRID_DIR=earlier/grid bash bench/tune_vs_grid.sh # the grid's records from an earlier run
# TUNE_ARGS are passed on to `hpcfsdp tune` (e.g. "--top 3 --eta 3").
# Both halves go on where an earlier call stopped (the grid skips cells with a record, tune resumes
# its search), so a grid longer than one sitting runs over several calls with the same OUT:
# GRID_TIMEOUT_S / TUNE_TIMEOUT_S stop each half after that many seconds (default: none), and
# SKIP_TUNE=1 runs the grid only. Each call's wall time is appended to grid_wall_s.txt /
# tune_wall_s.txt and the table sums them; FRESH_TUNE=1 starts the search again.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${OUT:-$root/bench-out}"
mkdir -p "$out"
cd "$root"
jobs="${1:-bench/jobs/tune_zero2_vs_zero3.yaml}"
if [[ "${SMOKE:-0}" == 1 ]]; then
  py="${PYTHON:-python3}"
  gpus=2
  jobs="$out/tune_smoke.yaml"
  cat > "$jobs" <<'YAML'
name: tune_smoke
base: {model: tiny, device: cpu, precision: fp32, seq_len: 64, steps: 10, warmup_steps: 2, gpus_per_node: 2, comm_profile_steps: 0}
slurm: {time_min: 10}
matrix:
  strategy: [ddp, fsdp2_zero3]
  batch_size: [1, 4]
  grad_accum: [1, 2]
YAML
else
  source bench/gpu_env.sh
  py=python3
  write_machine_info "$out/machine.txt"
  gpus="$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)"
  memory_gib="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print $1 / 1024}')"
  copy="$out/$(basename "$jobs")"  # the card's own memory for tune's pruning
  "$py" - "$jobs" "$copy" "$memory_gib" <<'PY'
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
doc.setdefault("slurm", {}).pop("gpu_name", None)
doc["slurm"]["gpu_memory_gib"] = round(float(sys.argv[3]), 1)
yaml.safe_dump(doc, open(sys.argv[2], "w"), sort_keys=False)
PY
  jobs="$copy"
fi
name="$("$py" -c 'import sys; from hpcfsdp.sweep.define.matrix import load_sweep; print(load_sweep(sys.argv[1]).name)' "$jobs")"
grid="${GRID_DIR:-$out/grid}"
if [[ "${SKIP_GRID:-0}" != 1 ]]; then
  echo "[tune_vs_grid] $(date -u +%T) grid: $name"
  start=$EPOCHREALTIME
  timeout --kill-after=30 "${GRID_TIMEOUT_S:-0}" "$py" -m hpcfsdp submit "$jobs" --executor local \
    --results-dir "$grid" >> "$out/grid.log" 2>&1
  awk -v a="$EPOCHREALTIME" -v b="$start" 'BEGIN { print a - b }' >> "$out/grid_wall_s.txt"
fi
[[ "${SKIP_TUNE:-0}" == 1 ]] && exit 0
echo "[tune_vs_grid] $(date -u +%T) tune: $name"
if [[ "${FRESH_TUNE:-0}" == 1 ]]; then
  rm -rf "$out/tune/$name" "$out/tune_wall_s.txt"
fi
start=$EPOCHREALTIME
# shellcheck disable=SC2086
timeout --kill-after=30 "${TUNE_TIMEOUT_S:-0}" "$py" -m hpcfsdp tune "$jobs" --executor local \
  --results-dir "$out/tune" ${TUNE_ARGS:-} >> "$out/tune.log" 2>&1
awk -v a="$EPOCHREALTIME" -v b="$start" 'BEGIN { print a - b }' >> "$out/tune_wall_s.txt"
[[ -f "$out/tune/$name/tune.json" ]] || { echo "tune has not finished: run the same command again"; exit 0; }
sum() { awk '{ total += $1 } END { print total + 0 }' "$1" 2>/dev/null || echo 0; }
"$py" bench/tune_vs_grid_table.py --grid "$grid/$name" --tune "$out/tune/$name" --gpus "$gpus" \
  --grid-wall "$(sum "$out/grid_wall_s.txt")" --tune-wall "$(sum "$out/tune_wall_s.txt")" | tee "$out/tune_vs_grid.md"
tar -czf "$out/$name.tar.gz" -C "$out" tune grid.log tune.log 2>/dev/null
tar -czf "$out/$name.grid.tar.gz" -C "$(dirname "$grid")" "$(basename "$grid")" 2>/dev/null
