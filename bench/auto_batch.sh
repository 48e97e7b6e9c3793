#!/usr/bin/env bash
# batch_size: auto on 2 GPUs (issue 14): Qwen2.5-1.5B, seq 4096, synthetic data, bf16 mixed
# precision; DDP, FSDP2 ZeRO-2 and ZeRO-3, each without and with full activation checkpointing;
# then one cell with a CUDA memory snapshot. Each cell is one torchrun launch (as python -m
# torch.distributed.run, which needs no torchrun on PATH):
#   torchrun --standalone --nproc-per-node 2 -m hpcfsdp run KEY=VALUE ... --results-dir ...
# The printed table (last) gives per cell the batch found, whether the next batch up ran out of
# memory in the search, the search's wall time against a hand grid's, and the measured peak beside
# `plan --memory`'s prediction. Logs, records and the report go to $OUT (or ./bench-out):
# auto_batch.tar.gz, memory_snapshot.tar.gz, auto_batch.summary.md, auto_batch.log.
#
#   bash bench/auto_batch.sh                      # on the GPU machine, from the repository root
#   AUTO_BATCH_SMOKE=1 bash bench/auto_batch.sh   # tiny model on 2 CPU processes; a fault hook
#                                                 # makes batches above 3 run out of memory
# Knobs: AUTO_BATCH_BUDGET_S (default 265 s for the cells, smoke 900; a search cell starts only
# with 40 s of it left, the snapshot cell with 25 s, and a running cell is stopped at the budget;
# collecting and packing take some 15 s more), AUTO_BATCH_GRID=1 (also run a fresh cell at each found batch + 1;
# default in smoke mode only), AUTO_BATCH_MAX (max_batch_size, default 64), AUTO_BATCH_NPROC (GPUs per cell, default 2).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/gpu_env.sh  # root, out (made) and python
budget="${AUTO_BATCH_BUDGET_S:-$([[ "${AUTO_BATCH_SMOKE:-0}" == 1 ]] && echo 900 || echo 265)}"
nproc="${AUTO_BATCH_NPROC:-2}"  # processes (GPUs) per cell
started=$SECONDS
work="$(mktemp -d)"
results="$work/results"
sweep="$results/auto_batch"
log="$out/auto_batch.log"
timings="$work/timings.txt"
mkdir -p "$work/logs" && : >"$timings" && : >"$log"

if [[ "${AUTO_BATCH_SMOKE:-0}" == 1 ]]; then
  model=tiny seq=32 device=cpu precision=fp32 grid="${AUTO_BATCH_GRID:-1}" gib=0 machine="2 CPU processes (smoke)"
  export HPCFSDP_FAULT="train_step:oom>3" OMP_NUM_THREADS=1  # the CPU's memory budget: batch 3
else
  model=qwen2.5-1.5b seq=4096 device=cuda precision=bf16_mixed grid="${AUTO_BATCH_GRID:-0}"
  gib="$(gpu_memory_gib)"
  machine="${nproc} x $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
fi
max="${AUTO_BATCH_MAX:-64}"
# steps=3, warmup 1: the measurement at the batch found times 2 steps; each probe trains 2.
common=(model=$model seq_len=$seq data=synthetic device=$device precision=$precision steps=3 warmup_steps=1
        comm_profile_steps=0 nvml=true)
search=(batch_size=auto max_batch_size=$max batch_probe_steps=2)

{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  $python -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)'
  git -C "$root" rev-parse HEAD 2>/dev/null; date -u; } 2>&1 | tee -a "$log"

# The same cells as a jobs YAML, for `plan --memory` (predicted batch and peak of every cell).
cat >"$work/auto_batch.yaml" <<EOF
name: auto_batch
base: {model: $model, seq_len: $seq, device: $device, precision: $precision, gpus_per_node: $nproc, steps: 3,
       warmup_steps: 1, comm_profile_steps: 0, batch_size: auto, max_batch_size: $max}
slurm: {gpu_memory_gib: $gib}
matrix:
  strategy: [fsdp2_zero3, fsdp2_zero2, ddp]
  activation_checkpointing: [none, full]
include:
  - {strategy: fsdp2_zero3, activation_checkpointing: none, batch_size: 1, memory_snapshot: true}
EOF
echo "== plan --memory ($gib GiB per GPU)" | tee -a "$log"
$python -m hpcfsdp plan "$work/auto_batch.yaml" --memory 2>&1 | tee -a "$log"

# run LABEL NEED_S KEY=VALUE...: one cell under torchrun, started only with NEED_S of the budget
# left and stopped at the budget; its wall time and exit status go to the timings file (-1: not
# started).
run() {
  local label="$1" need="$2"; shift 2
  local left=$((budget - (SECONDS - started)))
  if ((left < need)); then
    echo "== $label: not started, ${left} s of the ${budget} s budget left" | tee -a "$log"
    echo "$label 0 -1" >>"$timings"; return
  fi
  echo "== $label ($((SECONDS - started)) s elapsed)" | tee -a "$log"
  local t0=$EPOCHREALTIME
  timeout --kill-after=5 "$left" $python -m torch.distributed.run --standalone --nproc-per-node "$nproc" -m hpcfsdp run "$@" \
    --results-dir "$results" --sweep auto_batch >"$work/logs/${label//\//_}.log" 2>&1
  local code=$?
  local wall; wall=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN {printf "%.1f", b - a}')
  grep -E "batch search|failed|Error" "$work/logs/${label//\//_}.log" | grep -v "^\s*File" | tail -20 | tee -a "$log"
  echo "   exit $code, $wall s" | tee -a "$log"
  echo "$label $wall $code" >>"$timings"
}

for ckpt in none full; do
  for strategy in fsdp2_zero3 fsdp2_zero2 ddp; do
    run "$strategy/$ckpt" 40 "${common[@]}" "${search[@]}" strategy=$strategy activation_checkpointing=$ckpt
  done
done

# A fresh launch at each found batch + 1 (the hand grid's deciding cell); the search's own probe
# of that batch already answers it, so this runs only when asked (AUTO_BATCH_GRID=1).
if [[ "$grid" == 1 ]]; then
  for record in "$sweep"/cells/*-bauto-*/result.json; do
    next=$($python -c 'import json, sys; r = json.load(open(sys.argv[1])); s = r.get("batch_search") or {}
if r["status"] == "ok" and not s.get("capped"):
    print(r["spec"]["strategy"], r["spec"]["activation_checkpointing"], s["largest_fitting_batch"] + 1)' "$record")
    [[ -n "$next" ]] || continue
    read -r strategy ckpt batch <<<"$next"
    run "$strategy/$ckpt/grid" 30 "${common[@]}" strategy=$strategy activation_checkpointing=$ckpt batch_size=$batch
  done
fi

run "fsdp2_zero3/none/snapshot" 25 "${common[@]}" strategy=fsdp2_zero3 batch_size=1 memory_snapshot=true

echo "== collect" | tee -a "$log"
$python -m hpcfsdp collect "$sweep" >"$work/logs/collect.log" 2>&1; tail -4 "$work/logs/collect.log" | tee -a "$log"
{ echo "# auto_batch: predicted against measured peak, cells and probes"; echo
  $python bench/memory_prediction.py "$sweep"; } >"$work/memory_prediction.md" 2>&1
table="$($python bench/auto_batch_summary.py "$sweep" "$timings" "$gib" 2>&1)"
{ echo "# bench/auto_batch.sh: batch_size: auto on $machine, $((SECONDS - started)) s"
  echo; echo "$table"; echo; cat "$work/memory_prediction.md"; echo
  echo "Recommendation (hpcfsdp collect):"; grep -E "^(Fastest|Most memory headroom|Cheapest):" "$work/logs/collect.log"
} >"$out/auto_batch.summary.md"

cp "$log" "$timings" "$work/auto_batch.yaml" "$work/memory_prediction.md" "$work/logs/"
snapshots=("$sweep"/cells/*/memory_snapshot_rank*.pickle)
if [[ -e "${snapshots[0]}" ]]; then
  tar -czf "$out/memory_snapshot.tar.gz" -C "$sweep" "${snapshots[@]#"$sweep"/}" && rm -f "${snapshots[@]}"
fi
tar -czf "$out/auto_batch.tar.gz" -C "$work" results logs
echo
echo "total $((SECONDS - started)) s; files in $out: $(cd "$out" && ls | tr '\n' ' ')"
echo "$table"
