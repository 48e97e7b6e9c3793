#!/usr/bin/env bash
# Do float8 and the fused losses still train like bf16 (issue 13)? Trains the same model on the
# same real text, from the same seed and in the same sample order, once per variant, and compares
# the loss curves: each lever must stay within 1% (relative) of bf16 over the last 50 steps.
#
#   python3 bench/make_text_data.py            # once, where the text is: writes .data/ (carry it)
#   bash bench/loss_agreement.sh               # on a GPU machine, from the repository root
#   SMOKE=1 bash bench/loss_agreement.sh       # tiny model, CPU: tests the script
#   VARIANTS_ONLY="bf16 cce_exact" bash bench/loss_agreement.sh   # some of the variants below
#
# Every variant is one process on one GPU (FSDP2 on a one-rank mesh: the float8 casts, the float8
# all-gather path and the scale precomputation run as with more ranks, and the numerics do not
# depend on the number of ranks). All variants run at once, spread over the GPUs (variant i on GPU
# i % GPUS; a few tens of GiB each at the default shape, so 3 share an H200): their compilations
# overlap, and their speed is not measured. Writes under $OUT (default ./bench-out):
# loss_agreement.md (the table), loss_agreement.csv (every step's loss per variant) and
# loss_agreement.tar.gz (logs, records, machine.txt, the data manifest). Prints the table last.
# Each run is cut at RUN_TIMEOUT_S (default 330), and no wave starts after BUDGET_S (default 420);
# the table is rewritten under $OUT after every wave, so a cut run keeps what finished.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
started=$SECONDS

# ---- what is compared (edit here) ---------------------------------------------------------------
# A name, then the RunSpec fields that make the variant; the first is the reference.
VARIANTS=(  # in waves of PER_GPU x GPUS, most telling first
  "bf16 float8=none loss=default"
  "bf16_seed1 float8=none loss=default seed=1"  # another initialisation and sample order
  "cce_exact float8=none loss=cce_exact"
  "float8_tensorwise float8=tensorwise loss=default"
  "float8_tensorwise+cce_exact float8=tensorwise loss=cce_exact"
  "cce float8=none loss=cce"
  "cce_kahan_full_c float8=none loss=cce_kahan_full_c"
  "float8_rowwise float8=rowwise loss=default"
  "float8_tensorwise+cce_kahan_full_c float8=tensorwise loss=cce_kahan_full_c"
)
COMMON=(
  model=qwen2.5-1.5b device=cuda precision=bf16_mixed strategy=fsdp2_zero2 compile=true adamw_impl=fused
  seq_len=2048 batch_size=2 lr=1e-4 seed=0 expandable_segments=true
)
STEPS=${STEPS:-300}
LAST=${LAST:-50}            # the steps compared
TOLERANCE=${TOLERANCE:-0.01}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-330}
BUDGET_S=${BUDGET_S:-420}   # no wave is started after this many seconds
GPUS=${GPUS:-}              # GPUs to spread the variants over (default: all that nvidia-smi lists)
# -------------------------------------------------------------------------------------------------

if [[ "${SMOKE:-0}" == 1 ]]; then  # the same script on the CPU with the tiny model
  tiny="$(mktemp -d)"  # the tiny preset with room for the text's 16k-token vocabulary
  python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["vocab_size"] = 16384; json.dump(c, open(sys.argv[2], "w"))' \
    src/hpcfsdp/presets/tiny.json "$tiny/config.json"
  VARIANTS=("fp32 loss=default" "cce loss=cce" "cce_kahan_full_c loss=cce_kahan_full_c")
  COMMON=(model="$tiny" device=cpu precision=fp32 strategy=fsdp2_zero2 seq_len=64 batch_size=2 lr=1e-3 seed=0)
  STEPS=${SMOKE_STEPS:-30} LAST=10 GPUS=1
  export OMP_NUM_THREADS=1
fi

if [[ -n "${VARIANTS_ONLY:-}" ]]; then  # e.g. VARIANTS_ONLY="bf16 cce_exact": these names, in this order
  chosen=()
  for name in $VARIANTS_ONLY; do
    for variant in "${VARIANTS[@]}"; do [[ "${variant%% *}" == "$name" ]] && chosen+=("$variant"); done
  done
  VARIANTS=("${chosen[@]}")
fi

data="$root/.data"
if [[ ! -f "$data/loss_text/corpus.jsonl" || ! -f "$data/tokenizer/tokenizer.json" ]]; then
  echo "loss_agreement: no $data/loss_text or $data/tokenizer; run python3 bench/make_text_data.py and carry .data" >&2
  exit 2
fi
out="${OUT:-$root/bench-out}"
mkdir -p "$out"
work="$(mktemp -d)"
mkdir -p "$work/logs" "$work/suite"
source bench/gpu_env.sh
if [[ -z "$GPUS" ]]; then
  GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
  (( GPUS > 0 )) || GPUS=1
fi
write_machine_info "$work/machine.txt"
printf '%s\n' "COMMON: ${COMMON[*]}" "STEPS=$STEPS LAST=$LAST TOLERANCE=$TOLERANCE GPUS=$GPUS" >> "$work/machine.txt"
cp "$data/manifest.json" "$work/data_manifest.json" 2>/dev/null

run_variant() {  # run_variant GPU NAME FIELDS...: one cell, one process on that GPU
  local gpu=$1 name=$2; shift 2
  echo "[loss] $(date -u +%T) $name on GPU $gpu"
  CUDA_VISIBLE_DEVICES=$gpu timeout --kill-after=10 "$RUN_TIMEOUT_S" \
    python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m hpcfsdp run \
    --results-dir "$work/suite" --sweep "$name" "${COMMON[@]}" "$@" \
    data="$data/loss_text" tokenizer="$data/tokenizer" steps="$STEPS" warmup_steps=5 \
    nvml=false comm_profile_steps=0 > "$work/logs/$name.log" 2>&1 \
    || echo "[loss] $name: exit $? (log: logs/$name.log)" | tee -a "$work/failed.txt"
  echo "[loss] $(date -u +%T) $name done"
}

summarize() {  # the table (loss_agreement.md) and every step's loss (loss_agreement.csv), under $OUT
  python3 - "$work" "$LAST" "$TOLERANCE" "${VARIANTS[@]%% *}" > "$work/loss_agreement.md" 2> "$work/loss_agreement.csv" <<'EOF'
"""Mean loss over the last steps per variant, relative to the first variant (the table on stdout;
every step's loss as CSV on stderr)."""
import json, sys
from pathlib import Path

work, last, tolerance, names = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]
records = {}
for name in names:
    found = sorted((work / "suite" / name / "cells").glob("*/result.json"))
    records[name] = json.loads(found[-1].read_text()) if found else None
losses = {n: r["losses"] for n, r in records.items() if r and r.get("status") == "ok"}
reference = names[0]
steps = max((len(v) for v in losses.values()), default=0)
print("step," + ",".join(losses), file=sys.stderr)
for step in range(steps):
    print(f"{step + 1}," + ",".join(f"{v[step]:.6f}" if step < len(v) else "" for v in losses.values()), file=sys.stderr)


def tail_mean(values):
    return sum(values[-last:]) / len(values[-last:])


ref = losses.get(reference)
header = ["variant", "float8", "loss", "first loss", f"mean loss, last {last} steps", f"relative to {reference}",
          f"largest step deviation, last {last}", f"within {tolerance:.0%}", "peak GiB"]
print("| " + " | ".join(header) + " |")
print("|" + "---|" * len(header))
for name in names:
    record = records[name]
    if not record or record.get("status") != "ok":
        why = (record.get("error") or "")[:80] if record else "not run"
        print(f"| {name} | | | | | | | no ({why}) | |")
        continue
    values, spec = record["losses"], record["spec"]
    row = [name, spec["float8"], spec["loss"], f"{values[0]:.4f}", f"{tail_mean(values):.4f}"]
    if ref and name != reference and len(values) == len(ref):
        rel = tail_mean(values) / tail_mean(ref) - 1
        step_dev = max(abs(a / b - 1) for a, b in zip(values[-last:], ref[-last:]))
        row += [f"{rel:+.3%}", f"{step_dev:.2%}", "yes" if abs(rel) <= tolerance else "NO"]
    else:
        row += ["reference" if name == reference else "-", "-", "-"]
    row.append(f"{record['peak_memory_gib']:.1f}")
    print("| " + " | ".join(row) + " |")
print()
first = next((r for r in records.values() if r), None) or {}
spec, source = first.get("spec", {}), first.get("data_source", {})
print(f"{spec.get('model', '?')}, {spec.get('precision', '?')}, seq {spec.get('seq_len', '?')}, batch "
      f"{spec.get('batch_size', '?')} x {first.get('world_size', '?')} rank(s), {steps} steps, lr {spec.get('lr', '?')}; "
      f"text: {source.get('documents', '?')} documents, {source.get('tokens', '?')} tokens in "
      f"{source.get('blocks', '?')} blocks (bench/make_text_data.py). Runs shared GPUs: no speeds.")
if (work / "failed.txt").exists():
    print("failed: " + "; ".join((work / "failed.txt").read_text().split("\n")).strip("; "))
EOF
  cp "$work/loss_agreement.md" "$work/loss_agreement.csv" "$out/"
  tar -czf "$out/loss_agreement.tar.gz" -C "$work" .
}

PER_GPU=${PER_GPU:-3}  # variants at once on one GPU (bf16_mixed keeps fp32 weights and states: ~35 GiB each)
wave=$(( GPUS * PER_GPU ))
for (( i = 0; i < ${#VARIANTS[@]}; i += wave )); do
  if (( SECONDS - started > BUDGET_S )); then
    echo "[loss] not started after ${BUDGET_S}s: ${VARIANTS[*]:i}" | tee -a "$work/failed.txt"
    break
  fi
  for (( j = i; j < i + wave && j < ${#VARIANTS[@]}; j++ )); do
    # shellcheck disable=SC2086
    run_variant $(( j % GPUS )) ${VARIANTS[$j]} &
  done
  wait
  summarize  # the table so far, under $OUT: a cut run keeps every finished wave
done
echo
echo "[loss] $(( SECONDS - started )) s; logs and records: $out/loss_agreement.tar.gz"
cat "$out/loss_agreement.md"
