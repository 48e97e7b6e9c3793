#!/usr/bin/env bash
# issue 45: where a launch's time goes. The issue's 9-cell matrix (4 strategies x 2 checkpointing
# settings at batch 4, and one `batch_size: auto` cell; Qwen2.5-1.5B, seq 4096, 12 steps a cell)
# with `submit --executor local` on the GPUs here, then one table of each cell's phases (its
# record's `phases` and `launch_span_s`), the matrix's wall time and GPU-hours, and the auto cell's
# probes (bench/launch_phases_table.py). One device call of under 10 minutes on 2 x H100.
# Raw logs, records and the table go to $OUT (./bench-out).
#   bash bench/launch_phases.sh                          # 2 GPUs, Qwen2.5-1.5B
#   MODEL=tiny DEVICE=cpu bash bench/launch_phases.sh    # the same launches on CPU (no FSDP1 there:
#                                                        # ddp and FSDP2 only, seq 64, fp32)
# STEPS overrides the 12 steps a cell; STRATEGIES the four strategies (space-separated).
# TUNE=1 then runs `hpcfsdp tune` on the same YAML and writes tune against this grid
# (bench/tune_vs_grid_table.py: the pick, where the grid ranks it, each one's GPU-hours) to
# $OUT/tune_vs_grid.md: issue 45's tune on the small matrix, from the same launches' grid.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/gpu_env.sh  # root, out (made) and python
model="${MODEL:-qwen2.5-1.5b}"
device="${DEVICE:-cuda}"
if [[ $device == cpu ]]; then
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  strategies="${STRATEGIES:-ddp fsdp2_zero2 fsdp2_zero3}"
  shape="precision: fp32, seq_len: 64"
  memory="gpu_memory_gib: 2.01"  # a memory for the prediction the auto cell's search starts from
  auto="max_batch_size: 8"  # a CPU never runs out of memory: the search stops at its cap
else
  write_machine_info "$out/machine.$(date -u +%Y%m%dT%H%M%S).txt"
  strategies="${STRATEGIES:-fsdp1_shard_grad_op fsdp1_full_shard fsdp2_zero2 fsdp2_zero3}"
  shape="precision: bf16_mixed, seq_len: 4096, adamw_impl: fused"
  memory="gpu_memory_gib: $(gpu_memory_gib)"
  auto="max_batch_size: 64"
fi
jobs="$out/launch_phases.yaml"
cat > "$jobs" <<YAML
name: launch_phases
base: {model: $model, device: $device, $shape, gpus_per_node: 2, steps: ${STEPS:-12}, batch_size: 4}
slurm: {time_min: 10, $memory}
matrix:
  strategy: [$(echo "$strategies" | sed 's/ /, /g')]
  activation_checkpointing: [none, full]
include:
  - {strategy: fsdp2_zero2, batch_size: auto, $auto}
YAML
echo "[launch_phases] $(date -u +%T) $model on $device: $jobs"
rm -rf "$out/results/launch_phases"
started=$(date +%s.%N)
"$python" -m hpcfsdp submit "$jobs" --executor local --results-dir "$out/results" > "$out/submit.log" 2>&1
echo "submit exited $? (3: some cells not ok)"
ended=$(date +%s.%N)
"$python" bench/launch_phases_table.py "$out/results/launch_phases" --wall-s "$(python3 -c "print($ended - $started)")" \
  | tee "$out/launch_phases.md"
if [[ ${TUNE:-0} == 1 ]]; then
  rm -rf "$out/tune"
  echo "[launch_phases] $(date -u +%T) tune on the same matrix"
  "$python" -m hpcfsdp tune "$jobs" --executor local --results-dir "$out/tune" > "$out/tune.log" 2>&1
  echo "tune exited $?"
  tail -5 "$out/tune.log"
  "$python" bench/tune_vs_grid_table.py --tune "$out/tune/launch_phases" --jobs "$jobs" \
    --grid "$out/results/launch_phases" | tee "$out/tune_vs_grid.md"
fi
# Every record, log and tune's folder in one archive, beside the tables: the device machine sends
# back a limited number of files, and the third lease lost all but the table (2026-11-27).
tar -czf "$out/launch_phases_raw.tar.gz" -C "$out" --exclude='*.tar.gz' --exclude='*.pt' --exclude='*.pickle' . \
  && find "$out" -mindepth 1 -maxdepth 1 ! -name '*.md' ! -name '*.tar.gz' ! -name 'machine.*' ! -name '*.yaml' \
    -exec rm -rf {} +
