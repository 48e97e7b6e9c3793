#!/usr/bin/env bash
# The record's GPU-only paths, after the record got its typed shape (issue 24): one ok cell with
# NVML, float8 and the fused loss, and one cell that runs out of memory with a memory snapshot,
# each under torchrun on one GPU; bench/record_check.py then reads both records as collect does
# and names any field that is missing. Raw logs and records under $OUT.
#
#   OUT=/tmp/check bash bench/record_check.sh          # on a GPU machine (wheels in .whl/)
#   OUT=/tmp/check CPU=1 bash bench/record_check.sh    # the same on the CPU, tiny model (a smoke run)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:?set OUT to a folder for the logs}  # before gpu_env.sh, which makes $OUT (or bench-out)
source bench/gpu_env.sh
write_machine_info "$OUT/machine.txt"
results="$OUT/results"

cell() {  # cell NAME KEY=VALUE...: one cell under torchrun; its failure is a record, not a stop
  local name=$1
  shift
  echo "== $name: $*" | tee -a "$OUT/record_check.log"
  python3 -m torch.distributed.run --standalone --nproc-per-node=1 -m hpcfsdp run \
    --results-dir "$results" --sweep check "$@" >"$OUT/$name.log" 2>&1 || true
  tail -2 "$OUT/$name.log" | tee -a "$OUT/record_check.log"
}

if [[ ${CPU:-0} == 1 ]]; then
  export OMP_NUM_THREADS=1
  cell ok model=tiny device=cpu precision=fp32 seq_len=32 steps=4 warmup_steps=1 comm_profile_steps=0
  HPCFSDP_FAULT=train:error cell error model=tiny device=cpu precision=fp32 seq_len=32 steps=4 warmup_steps=1 \
    comm_profile_steps=0 strategy=ddp
  python3 bench/record_check.py "$results/check" --cpu | tee -a "$OUT/record_check.log"
else
  cell ok model=qwen3-1.7b strategy=single precision=bf16_mixed compile=true float8=tensorwise loss=liger \
    batch_size=2 seq_len=4096 steps=12 warmup_steps=4
  cell oom model=qwen3-1.7b strategy=fsdp2_zero2 precision=bf16_mixed batch_size=64 seq_len=8192 steps=3 \
    warmup_steps=1 memory_snapshot=true
  python3 bench/record_check.py "$results/check" | tee -a "$OUT/record_check.log"
fi
