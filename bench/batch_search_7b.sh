#!/usr/bin/env bash
# issue 45, item 2: `batch_size: auto` on the 7B preset (CodeLlama-7b, seq 2048, fsdp2_zero3, full
# activation checkpointing, bf16 mixed, fused AdamW) on 2 GPUs through `submit --executor local`:
# where the search starts (the prediction of `plan --memory`), its probes and the batch it chose,
# from the record (bench/launch_phases_table.py). Output in $OUT (./bench-out).
#   bash bench/batch_search_7b.sh                 # 2 GPUs
#   MODEL=tiny DEVICE=cpu bash bench/batch_search_7b.sh   # the same on 2 CPU processes
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/gpu_env.sh  # root, out (made) and python
model="${MODEL:-codellama-7b}"
device="${DEVICE:-cuda}"
if [[ $device == cpu ]]; then
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  shape="precision: fp32, seq_len: 64, max_batch_size: 8"
  memory="gpu_memory_gib: 2.01"
else
  write_machine_info "$out/machine.batch_search_7b.txt"
  shape="precision: bf16_mixed, seq_len: 2048, adamw_impl: fused, activation_checkpointing: full, max_batch_size: 64"
  memory="gpu_memory_gib: $(gpu_memory_gib)"
fi
jobs="$out/batch_search_7b.yaml"
cat > "$jobs" <<YAML
name: batch_search_7b
base: {model: $model, device: $device, $shape, strategy: fsdp2_zero3, gpus_per_node: 2, steps: 12, batch_size: auto}
slurm: {time_min: 10, $memory}
YAML
rm -rf "$out/results/batch_search_7b"
"$python" -m hpcfsdp plan "$jobs" --memory > "$out/batch_search_7b.plan.txt" 2>&1
started=$(date +%s.%N)
"$python" -m hpcfsdp submit "$jobs" --executor local --results-dir "$out/results" > "$out/batch_search_7b.submit.log" 2>&1
echo "submit exited $?"
ended=$(date +%s.%N)
"$python" bench/launch_phases_table.py "$out/results/batch_search_7b" --wall-s "$(python3 -c "print($ended - $started)")" \
  | tee "$out/batch_search_7b.md"
