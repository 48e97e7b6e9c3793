#!/usr/bin/env bash
# Do the levers still train like bf16, beyond seed-to-seed noise (issues 13, 22)? Trains the same
# model on the same real text once per (variant, seed), and compares each lever's mean loss over
# the last steps with the spread of the bf16 baseline's seeds.
#
#   python3 bench/make_text_data.py            # once, where the text is: writes .data/ (carry it)
#   bash bench/loss_agreement.sh               # on a GPU machine, from the repository root
#   SMOKE=1 bash bench/loss_agreement.sh       # tiny model, CPU: tests the script
#   VARIANTS_ONLY="bf16 liger" bash bench/loss_agreement.sh   # some of the variants below
#
# The seed sets the initialisation and the sample order; a lever's run with seed k starts from the
# same weights and sees the same batches as the baseline's run with seed k. The baseline runs
# BASE_SEEDS seeds (default 3), every lever LEVER_SEEDS (default 2). Agreement: a lever's mean
# over its seeds of the last-LAST-steps mean loss lies inside [min, max] of the baseline seeds'
# last-LAST-steps means (the spread that a different seed alone gives); the table also shows the
# paired difference (lever seed k against baseline seed k), which seed noise does not blur.
#
# Every run is one process on one GPU (FSDP2 on a one-rank mesh; on one rank tensorwise float8 casts
# each weight inside the compiled layer rather than at a float8 all-gather: the same scale, amax
# over the whole weight, taken of its bf16 copy rather than of the fp32 master). Runs go in waves of
# PER_GPU per GPU (GPU_IDS, default all that nvidia-smi lists): their compilations overlap, and
# their speed is not measured. Writes under $OUT (default ./bench-out): loss_agreement.md (the
# table), loss_agreement.csv (every step's loss per run) and loss_agreement.tar.gz (logs, records,
# machine.txt, the data manifest). Prints the table last. Each run is cut at RUN_TIMEOUT_S, and no
# wave starts after BUDGET_S; the table is rewritten under $OUT after every wave, so a cut run keeps
# what finished.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
started=$SECONDS

# ---- what is compared (edit here) ---------------------------------------------------------------
# A name, then the RunSpec fields that make the variant; the first is the reference.
BASELINE="bf16 float8=none loss=default"
LEVERS=(  # most telling first: the waves run in this order, seed 0 of every lever before seed 1
  "liger float8=none loss=liger"
  "float8_tensorwise+liger float8=tensorwise loss=liger"
  "compiled float8=none loss=compiled"
  "float8_tensorwise float8=tensorwise loss=default"
  "float8_rowwise float8=rowwise loss=default"
  "cce_exact float8=none loss=cce_exact"
  "cce_kahan_full_c float8=none loss=cce_kahan_full_c"
  "cce float8=none loss=cce"
)
BASE_SEEDS=${BASE_SEEDS:-3}
LEVER_SEEDS=${LEVER_SEEDS:-2}
COMMON=(
  model=qwen2.5-1.5b device=cuda precision=bf16_mixed strategy=fsdp2_zero2 compile=true adamw_impl=fused
  seq_len=2048 batch_size=2 lr=1e-4 seed=0 expandable_segments=true
)
STEPS=${STEPS:-200}
LAST=${LAST:-50}            # the steps compared
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-300}
BUDGET_S=${BUDGET_S:-400}   # no wave is started after this many seconds
GPU_IDS=${GPU_IDS:-}        # GPUs to spread the runs over (default: all that nvidia-smi lists)
# -------------------------------------------------------------------------------------------------

if [[ "${SMOKE:-0}" == 1 ]]; then  # the same script on the CPU with the tiny model
  tiny="$(mktemp -d)"  # the tiny preset with room for the text's 16k-token vocabulary
  python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["vocab_size"] = 16384; json.dump(c, open(sys.argv[2], "w"))' \
    src/hpcfsdp/presets/tiny.json "$tiny/config.json"
  BASELINE="fp32 loss=default"
  LEVERS=("cce loss=cce" "compiled loss=compiled")
  COMMON=(model="$tiny" device=cpu precision=fp32 strategy=fsdp2_zero2 seq_len=64 batch_size=2 lr=1e-3)
  STEPS=${SMOKE_STEPS:-30} LAST=10 GPU_IDS=cpu
  export OMP_NUM_THREADS=1
fi

if [[ -n "${VARIANTS_ONLY:-}" ]]; then  # e.g. VARIANTS_ONLY="liger compiled": these levers, in this order
  chosen=()
  for name in $VARIANTS_ONLY; do
    for lever in "${LEVERS[@]}"; do [[ "${lever%% *}" == "$name" ]] && chosen+=("$lever"); done
  done
  LEVERS=("${chosen[@]}")
fi
# The runs: "GROUP_sSEED FIELDS... seed=SEED", the baseline's seeds first, then seed by seed.
RUNS=()
for (( seed = 0; seed < BASE_SEEDS; seed++ )); do RUNS+=("${BASELINE%% *}_s$seed ${BASELINE#* } seed=$seed"); done
for (( seed = 0; seed < LEVER_SEEDS; seed++ )); do
  for lever in "${LEVERS[@]}"; do RUNS+=("${lever%% *}_s$seed ${lever#* } seed=$seed"); done
done

data="$root/.data"
if [[ ! -f "$data/loss_text/corpus.jsonl" || ! -f "$data/tokenizer/tokenizer.json" ]]; then
  echo "loss_agreement: no $data/loss_text or $data/tokenizer; run python3 bench/make_text_data.py and carry .data" >&2
  exit 2
fi
work="$(mktemp -d)"
mkdir -p "$work/logs" "$work/suite"
source bench/gpu_env.sh  # out (made) and python
if [[ -z "$GPU_IDS" ]]; then
  GPU_IDS=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | tr '\n' ' ')
  [[ -n "${GPU_IDS// }" ]] || GPU_IDS=0
fi
read -r -a gpus <<< "$GPU_IDS"
write_machine_info "$work/machine.txt"
printf '%s\n' "COMMON: ${COMMON[*]}" "RUNS: ${RUNS[*]}" "STEPS=$STEPS LAST=$LAST GPU_IDS=$GPU_IDS" >> "$work/machine.txt"
cp "$data/manifest.json" "$work/data_manifest.json" 2>/dev/null

run_variant() {  # run_variant GPU NAME FIELDS...: one cell, one process on that GPU
  local gpu=$1 name=$2; shift 2
  echo "[loss] $(date -u +%T) $name on GPU $gpu"
  local devices=()
  [[ $gpu == cpu ]] || devices=(env CUDA_VISIBLE_DEVICES="$gpu")
  "${devices[@]}" timeout --kill-after=10 "$RUN_TIMEOUT_S" \
    python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m hpcfsdp run \
    --results-dir "$work/suite" --sweep "$name" "${COMMON[@]}" "$@" \
    data="$data/loss_text" tokenizer="$data/tokenizer" steps="$STEPS" warmup_steps=5 \
    nvml=false comm_profile_steps=0 > "$work/logs/$name.log" 2>&1 \
    || echo "[loss] $name: exit $? (log: logs/$name.log)" | tee -a "$work/failed.txt"
  echo "[loss] $(date -u +%T) $name done"
}

summarize() {  # the table (loss_agreement.md) and every step's loss (loss_agreement.csv), under $OUT
  python3 bench/loss_agreement_table.py "$work" "$LAST" "${RUNS[@]%% *}" > "$work/loss_agreement.md" \
    2> "$work/loss_agreement.csv"
  cp "$work/loss_agreement.md" "$work/loss_agreement.csv" "$out/"
  tar -czf "$out/loss_agreement.tar.gz" -C "$work" .
}

PER_GPU=${PER_GPU:-3}  # variants at once on one GPU (bf16_mixed keeps fp32 weights and states: ~35 GiB each)
wave=$(( ${#gpus[@]} * PER_GPU ))
for (( i = 0; i < ${#RUNS[@]}; i += wave )); do
  if (( SECONDS - started > BUDGET_S )); then
    echo "[loss] not started after ${BUDGET_S}s: ${RUNS[*]:i}" | tee -a "$work/failed.txt"
    break
  fi
  for (( j = i; j < i + wave && j < ${#RUNS[@]}; j++ )); do
    # shellcheck disable=SC2086
    run_variant "${gpus[$(( j % ${#gpus[@]} ))]}" ${RUNS[$j]} &
  done
  wait
  summarize  # the table so far, under $OUT: a cut run keeps every finished wave
done
echo
echo "[loss] $(( SECONDS - started )) s; logs and records: $out/loss_agreement.tar.gz"
cat "$out/loss_agreement.md"
