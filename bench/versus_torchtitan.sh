#!/usr/bin/env bash
# hpcfsdp against torchtitan at the same setup (issue 22), side by side in one call: the Qwen3-1.7B
# architecture on both sides (torchtitan's qwen3 flavor "1.7B"; hpcfsdp's preset qwen3-1.7b holds
# the same numbers in an HF Qwen3Config), seq 8192, random tokens, torch.compile, float8 tensorwise
# linears (output layer excluded), bf16 compute with fp32 master weights, fused AdamW at
# torchtitan's optimizer settings (its qwen3_1.7b.toml: lr 8e-4, weight decay 0.1, max_norm 1.0; the
# lr warmed up over 2 steps, then decayed linearly, as this script asks of torchtitan), no activation
# checkpointing. The cases alternate, REPEATS times; then one table of medians, ratios
# and peak reserved memory, and the SM clock and power the GPU ran at (nvidia-smi, sampled).
#
#   TORCHTITAN_DIR=.peer/torchtitan bash bench/versus_torchtitan.sh            # 1 GPU
#   NGPU=2 RESHARD=zero3 TORCHTITAN_DIR=... bash bench/versus_torchtitan.sh    # 2 GPUs, both ZeRO-3
#   LANES="0 1" ...        # NGPU=1 on a 2-GPU machine: one repeat on each GPU at once (reverse order on GPU 1)
#   PROFILE="titan-b4 suite-b4" ...  # then one more run of each named case under torch.profiler
#                                    # (not in the table) and bench/trace_summary.py over the traces
#   SMOKE=1 bash bench/versus_torchtitan.sh    # tiny model, 2 CPU processes, the suite's side only (torchtitan
#                                              # needs a GPU): tests the script and its table
#   VERSUS_CASES="titan-b4 titan 4;titan-w-b4 titan 4 --checkpoint.initial_load_path=@WEIGHTS@ ..."
#       # cases of your own, ';'-separated; a titan case's fields are torchtitan flags. @WEIGHTS@ in
#       # any case makes bench/hf_checkpoint.py save the suite's own initial weights first (seed 0,
#       # the model of the cases) and stands for that folder: both sides start from the same weights
#
# torchtitan: a source checkout of v0.2.2 (commit 73a0e69, the last release before its config
# rewrite), never copied into this repository (docs/levers.md: how to get it and the wheels it
# needs). It runs through bench/torchtitan_random.py: its own trainer and qwen3 train spec with a
# random-token dataloader. On one GPU torchtitan applies no FSDP (bf16 autocast), nor does hpcfsdp's
# `single` strategy; on several, RESHARD picks ZeRO-3 (torchtitan's default policy,
# fsdp2_zero3) or ZeRO-2 (`never`, fsdp2_zero2), with float8 all-gather and precomputed scales on
# both sides. Writes under $OUT (default ./bench-out): versus_torchtitan.md (the table) and
# versus_torchtitan.tar.gz (every log, the records, machine.txt). No run starts after BUDGET_S.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
started=$SECONDS

# ---- what is compared (edit here) ---------------------------------------------------------------
NGPU=${NGPU:-1}
RESHARD=${RESHARD:-zero3}  # NGPU > 1: zero3 | zero2, on both sides
SEQ=${SEQ:-8192}
# One case per line: name, side (titan | suite), batch per GPU, then the suite's RunSpec fields.
CASES=(
  "titan-b2 titan 2"
  "suite-b2 suite 2 loss=compiled"
  "titan-b4 titan 4"
  "suite-b4 suite 4 loss=compiled"
  "suite-best suite 8 loss=liger"
)
# The optimizer's numbers are torchtitan's (qwen3_1.7b.toml's lr, weight decay and max_norm; the
# warm-up of 2 steps and the linear decay over the rest that torchtitan is given below), not the
# suite's defaults (lr 1e-4 constant, no weight decay, no clipping): at the GPU's power limit the SM
# clock follows the values multiplied, and so the learning rate sets the speed by 2-3% (docs/levers.md).
SUITE=(model=qwen3-1.7b device=cuda precision=bf16_mixed compile=true float8=tensorwise adamw_impl=fused
       lr=8e-4 lr_warmup_steps=2 lr_decay=linear weight_decay=0.1 max_grad_norm=1.0
       activation_checkpointing=none expandable_segments=true nvml=false comm_profile_steps=0)
WARMUP=${WARMUP:-4}
TIMED=${TIMED:-8}
REPEATS=${REPEATS:-2}
LANES=${LANES:-0}               # GPUs that each run the whole sequence at once (NGPU=1 only)
BUDGET_S=${BUDGET_S:-480}       # no run is started after this many seconds
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-170}
TORCHTITAN_DIR=${TORCHTITAN_DIR:-}
PROFILE=${PROFILE:-}            # case names to run once more under the profiler, after the table
# -------------------------------------------------------------------------------------------------

if [[ "${SMOKE:-0}" == 1 ]]; then
  NGPU=2 SEQ=64 WARMUP=1 TIMED=2 LANES=cpu
  CASES=("suite-b2 suite 2 loss=compiled" "suite-b4 suite 4 loss=default")
  SUITE=(model=tiny device=cpu precision=fp32 adamw_impl=foreach nvml=false comm_profile_steps=0)
  export OMP_NUM_THREADS=1
fi
if [[ -n "${VERSUS_CASES:-}" ]]; then IFS=';' read -r -a CASES <<< "$VERSUS_CASES"; fi
if [[ "${SMOKE:-0}" != 1 && ! -f "$TORCHTITAN_DIR/torchtitan/train.py" ]]; then
  echo "versus_torchtitan: TORCHTITAN_DIR='$TORCHTITAN_DIR' is no torchtitan checkout (docs/levers.md)" >&2
  exit 2
fi
if (( NGPU == 1 )); then
  strategy=single titan_parallel=()
else
  strategy=fsdp2_$RESHARD
  reshard=$([[ $RESHARD == zero2 ]] && echo never || echo always)
  titan_parallel=(--parallelism.fsdp_reshard_after_forward "$reshard"
                  --quantize.linear.float8.enable_fsdp_float8_all_gather
                  --quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp)
fi

work="$(mktemp -d)"
mkdir -p "$work/logs" "$work/suite" "$work/titan"
source bench/gpu_env.sh  # out (made) and python
write_machine_info "$work/machine.txt"
printf '%s\n' "SUITE: strategy=$strategy ${SUITE[*]}" "CASES: ${CASES[*]}" "TORCHTITAN_DIR: $TORCHTITAN_DIR" \
  "NGPU=$NGPU RESHARD=$RESHARD SEQ=$SEQ WARMUP=$WARMUP TIMED=$TIMED REPEATS=$REPEATS LANES=$LANES" >> "$work/machine.txt"
# torchtitan's commit: from its own .git (a clone), or the COMMIT file beside a source archive; never
# from a .git further up (the device's copy of this repository).
if [[ -e $TORCHTITAN_DIR/.git ]]; then echo "torchtitan commit: $(git -C "$TORCHTITAN_DIR" rev-parse HEAD)"
elif [[ -f $TORCHTITAN_DIR/COMMIT ]]; then echo "torchtitan commit: $(cat "$TORCHTITAN_DIR/COMMIT") (its COMMIT file)"
fi >> "$work/machine.txt"
weights="$work/weights"  # the suite's initial weights as an HF checkpoint, where a case names @WEIGHTS@
if [[ "${CASES[*]}" == *@WEIGHTS@* ]]; then
  model=$(printf '%s\n' "${SUITE[@]}" | sed -n 's/^model=//p')
  python3 bench/hf_checkpoint.py "$model" "$weights" 2>&1 | tail -3 | tee -a "$work/machine.txt"
fi

run_case() {  # run_case LANE REPEAT NAME SIDE BATCH FIELDS...: one run, logged to logs/NAME-rREPEAT.log
  # With repeat "prof": the run is profiled (two steps before the last), and kept out of the table
  # under profile/.
  local lane=$1 repeat=$2 name=$3 side=$4 batch=$5; shift 5
  set -- "${@//@WEIGHTS@/$weights}"
  local base="$work" titan_profile=() suite_profile=()
  if [[ $repeat == prof ]]; then
    base="$work/profile" suite_profile=(profile=true)
    titan_profile=(--profiling.enable_profiling --profiling.profile_freq $(( WARMUP + TIMED - 2 ))
                   --profiling.profiler_warmup 1 --profiling.profiler_active 2)
    mkdir -p "$base/logs"
  fi
  local elapsed=$(( SECONDS - started )) log="$base/logs/$name-r$repeat.log"
  if [[ $repeat != prof ]] && (( elapsed >= BUDGET_S )); then
    echo "[versus] $name r$repeat: not started, ${elapsed}s of the ${BUDGET_S}s budget spent" | tee -a "$work/skipped.txt"
    return
  fi
  echo "[versus] $(date -u +%T) $name r$repeat on ${lane} (at ${elapsed}s)"
  local devices=() launcher=(python3 -m torch.distributed.run --standalone --nproc-per-node "$NGPU")
  [[ $lane != cpu && $NGPU == 1 ]] && devices=(env CUDA_VISIBLE_DEVICES="$lane")
  local sampler=""  # the GPU's SM clock and power every 0.5 s: the same kernels run slower at a lower clock
  if [[ $lane != cpu ]] && command -v nvidia-smi > /dev/null; then
    local which=(); [[ $NGPU == 1 ]] && which=(-i "$lane")
    nvidia-smi "${which[@]}" --query-gpu=utilization.gpu,clocks.sm,power.draw --format=csv,noheader,nounits -lms 500 \
      > "${log%.log}.gpu.csv" 2> /dev/null &
    sampler=$!
  fi
  if [[ $side == titan ]]; then
    PYTHONPATH="$TORCHTITAN_DIR:$PYTHONPATH" timeout --kill-after=10 "$RUN_TIMEOUT_S" "${devices[@]}" "${launcher[@]}" \
      bench/torchtitan_random.py --job.config_file "$TORCHTITAN_DIR/torchtitan/models/qwen3/train_configs/qwen3_1.7b.toml" \
      --job.dump_folder "$base/titan/$name-r$repeat" --model.name qwen3_random --model.flavor 1.7B \
      --model.converters quantize.linear.float8 --compile.enable --activation_checkpoint.mode none \
      --training.seq_len "$SEQ" --training.local_batch_size "$batch" --training.steps $(( WARMUP + TIMED )) \
      --lr_scheduler.warmup_steps 2 --metrics.log_freq 1 --metrics.disable_color_printing "${titan_parallel[@]}" "${titan_profile[@]}" "$@" \
      > "$log" 2>&1
  else
    local fields=(strategy="$strategy" "${SUITE[@]}" "$@")  # a case's own strategy= replaces the default
    [[ " $* " == *" strategy="* ]] && fields=("${SUITE[@]}" "$@")
    timeout --kill-after=10 "$RUN_TIMEOUT_S" "${devices[@]}" "${launcher[@]}" -m hpcfsdp run \
      --results-dir "$base/suite" --sweep "$name-r$repeat" "${fields[@]}" "${suite_profile[@]}" \
      seq_len="$SEQ" batch_size="$batch" steps=$(( WARMUP + TIMED )) warmup_steps="$WARMUP" > "$log" 2>&1
  fi
  local rc=$?
  [[ -n $sampler ]] && kill "$sampler" 2> /dev/null
  (( rc == 0 )) || echo "[versus] $name r$repeat: exit $rc (log: logs/$name-r$repeat.log)" | tee -a "$work/failed.txt"
  write_table  # after every run: a call cut short keeps what finished
}

write_table() {  # the table so far and every log, under $OUT
  python3 bench/versus_torchtitan_table.py "$work" "$WARMUP" "strategy=$strategy ${SUITE[*]}" "${CASES[@]}" \
    > "$work/versus_torchtitan.md.tmp" && mv "$work/versus_torchtitan.md.tmp" "$work/versus_torchtitan.md"
  cp "$work/versus_torchtitan.md" "$out/"
  tar -czf "$out/versus_torchtitan.tar.gz" --exclude='*.pt' --exclude=weights -C "$work" .
}

run_lane() {  # run_lane LANE FIRST_REPEAT STEP: the repeats of one lane, cases alternating
  local lane=$1 repeat=$2 stride=$3 order=("${CASES[@]}")
  if [[ $lane == 1 ]]; then  # the second lane runs the cases in reverse: no case always runs first
    order=(); for (( i = ${#CASES[@]} - 1; i >= 0; i-- )); do order+=("${CASES[$i]}"); done
  fi
  for (( ; repeat <= REPEATS; repeat += stride )); do
    for case in "${order[@]}"; do
      # shellcheck disable=SC2086
      run_case "$lane" "$repeat" $case
    done
  done
}

read -r -a lanes <<< "$LANES"
(( NGPU == 1 )) || lanes=("${lanes[0]}")
for i in "${!lanes[@]}"; do run_lane "${lanes[$i]}" $(( i + 1 )) "${#lanes[@]}" & done
wait

write_table
if [[ -n $PROFILE ]]; then  # after the table, so that they never cost a timed run (and not budgeted)
  traces=()
  for case in "${CASES[@]}"; do
    read -r name _ <<< "$case"
    [[ " $PROFILE " == *" $name "* ]] || continue
    # shellcheck disable=SC2086
    run_case "${lanes[0]}" prof $case
    trace=$(find "$work/profile" -path "*$name-rprof*" -name '*trace.json*' | sort | head -1)
    [[ -n $trace ]] && traces+=("$name=$trace")
  done
  if (( ${#traces[@]} )); then
    python3 bench/trace_summary.py "${traces[@]}" > "$out/trace_summary.md" 2> "$out/trace_summary.err"
    cp "$out/trace_summary.md" "$work/"
    gzip -k "${traces[@]#*=}" 2>/dev/null
    tar -czf "$out/versus_torchtitan.tar.gz" --exclude='*.pt' --exclude='*trace.json' --exclude=weights -C "$work" .
    cat "$out/trace_summary.md"
  fi
fi
echo
echo "[versus] $(( SECONDS - started )) s; logs and records: $out/versus_torchtitan.tar.gz"
cat "$out/versus_torchtitan.md"
