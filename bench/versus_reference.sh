#!/usr/bin/env bash
# The suite's best configuration against the plain compiled FSDP2 loop (bench/reference_loop.py),
# side by side on one 2-GPU machine (issue 13): Qwen2.5-1.5B shape, random tokens, alternating
# reference and suite, REPEATS times at each sequence length, then a table of the medians.
#
#   bash bench/versus_reference.sh             # on 2 GPUs, from the repository root
#   SMOKE=1 bash bench/versus_reference.sh     # tiny model on 2 CPU processes: tests the script
#
# Writes under $OUT (default ./bench-out): versus_reference.md (the table), versus_reference.tar.gz
# (every run's log, the suite's records, the reference's result lines, machine.txt). The table is
# printed last. It starts no run after BUDGET_S seconds (default 420), cuts each run at
# RUN_TIMEOUT_S (default 150) and every run at HARD_LIMIT_S (default 500), so the whole script
# ends within about 8.5 minutes, with the table of whatever ran.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
started=$SECONDS

# ---- what is compared (edit here) ---------------------------------------------------------------
# One case per line: sequence length, the reference loop's batch per GPU, the suite's batch per GPU.
# The reference gets the largest batch it fits (issue 13: batch 2 at 8192, batch 4 at 4096); the
# suite's levers free memory for a larger one.
CASES=(
  "4096 4 8"
  "8192 2 4"
)
if [[ -n "${VERSUS_CASES:-}" ]]; then IFS=';' read -r -a CASES <<< "$VERSUS_CASES"; fi  # e.g. "4096 4 16;8192 2 8"
# The suite's configuration: every RunSpec field (docs/levers.md), as `hpcfsdp run` takes them.
SUITE=(
  model=qwen2.5-1.5b device=cuda precision=bf16 strategy=fsdp2_zero2
  compile=true adamw_impl=fused float8=tensorwise loss=cce attention=sdpa
  activation_checkpointing=none expandable_segments=true
)
# shellcheck disable=SC2206
SUITE+=(${SUITE_EXTRA:-})  # more fields, later ones win: SUITE_EXTRA="attention=cudnn"
REFERENCE=(--model qwen2.5-1.5b --device cuda --precision bf16)  # bench/reference_loop.py flags
WARMUP=${WARMUP:-5}
TIMED=${TIMED:-12}
REPEATS=${REPEATS:-2}
NPROC=${NPROC:-2}
BUDGET_S=${BUDGET_S:-420}       # no run is started after this many seconds
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-150}
HARD_LIMIT_S=${HARD_LIMIT_S:-500}  # no run goes on past this many seconds
PEAK_TFLOPS=${PEAK_TFLOPS:-989.5}  # dense bf16 peak per GPU (H100 / H200 SXM)
# -------------------------------------------------------------------------------------------------

if [[ "${SMOKE:-0}" == 1 ]]; then  # the same script on 2 CPU processes with the tiny model
  CASES=("64 2 4" "128 1 2")
  SUITE=(model=tiny device=cpu precision=fp32 strategy=fsdp2_zero2 compile=false adamw_impl=foreach loss=cce
         activation_checkpointing=op)
  REFERENCE=(--model tiny --device cpu --precision bf16 --no-compile)
  WARMUP=1 TIMED=3 REPEATS=${REPEATS:-2} BUDGET_S=${BUDGET_S:-420}
  export OMP_NUM_THREADS=1
fi

work="$(mktemp -d)"
mkdir -p "$work/logs" "$work/suite"
source bench/gpu_env.sh  # out (made) and python
write_machine_info "$work/machine.txt"
printf '%s\n' "SUITE: ${SUITE[*]}" "REFERENCE: ${REFERENCE[*]}" "CASES: ${CASES[*]}" \
  "WARMUP=$WARMUP TIMED=$TIMED REPEATS=$REPEATS NPROC=$NPROC" >> "$work/machine.txt"

launch() {  # launch NAME CMD...: run under the time limits, log to logs/NAME.log
  local name=$1; shift
  local elapsed=$(( SECONDS - started ))
  local limit=$(( HARD_LIMIT_S - elapsed < RUN_TIMEOUT_S ? HARD_LIMIT_S - elapsed : RUN_TIMEOUT_S ))
  if (( elapsed >= BUDGET_S || limit < 45 )); then
    echo "[versus] $name: not started, ${elapsed}s of the ${BUDGET_S}s budget spent" | tee -a "$work/skipped.txt"
    return 1
  fi
  echo "[versus] $(date -u +%T) $name (at ${elapsed}s, limit ${limit}s)"
  timeout --kill-after=10 "$limit" "$@" > "$work/logs/$name.log" 2>&1
  local rc=$?
  (( rc == 0 )) || echo "[versus] $name: exit $rc (log: logs/$name.log)" | tee -a "$work/failed.txt"
}

for repeat in $(seq 1 "$REPEATS"); do
  for case in "${CASES[@]}"; do
    read -r seq ref_batch suite_batch <<< "$case"
    launch "reference-s$seq-r$repeat" python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" bench/reference_loop.py \
      "${REFERENCE[@]}" --seq-len "$seq" --batch-size "$ref_batch" --warmup "$WARMUP" --steps "$TIMED"
    launch "suite-s$seq-r$repeat" python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m hpcfsdp run \
      --results-dir "$work/suite" --sweep "s$seq-r$repeat" "${SUITE[@]}" seq_len="$seq" batch_size="$suite_batch" \
      steps=$(( WARMUP + TIMED )) warmup_steps="$WARMUP" nvml=false comm_profile_steps=0
  done
done

python3 - "$work" "$PEAK_TFLOPS" "${SUITE[*]}" "${REFERENCE[*]}" > "$work/versus_reference.md" <<'EOF'
"""Medians per shape over the repeats: reference (REFERENCE_RESULT lines) and suite (records)."""
import json, re, statistics, sys
from pathlib import Path

work, peak, suite_fields, reference_flags = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
runs = {}  # (seq, side) -> list of dicts
for log in sorted((work / "logs").glob("reference-*.log")):
    seq = int(re.search(r"-s(\d+)-", log.name).group(1))
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("REFERENCE_RESULT "):
            runs.setdefault((seq, "reference"), []).append(json.loads(line.split(" ", 1)[1]))
for path in sorted((work / "suite").glob("*/cells/*/result.json")):
    record = json.loads(path.read_text())
    if record.get("status") == "ok":
        runs.setdefault((record["spec"]["seq_len"], "suite"), []).append(record)
float8 = not re.search(r"\bfloat8=none\b", suite_fields) and "float8=" in suite_fields
mfu_label = "MFU (bf16 peak; the suite's matmuls run in float8)" if float8 else "MFU (bf16 peak)"
rows = []
for seq in sorted({s for s, _ in runs}):
    ref, suite = runs.get((seq, "reference"), []), runs.get((seq, "suite"), [])
    ref_tps = [r["tokens_per_s_per_gpu"] for r in ref]
    suite_tps = [r["tokens_per_s_per_gpu"] for r in suite]
    ref_med = statistics.median(ref_tps) if ref_tps else None
    suite_med = statistics.median(suite_tps) if suite_tps else None
    flops = suite[0]["flops_per_token"] if suite else None  # same model and seq: the same for both sides
    def mfu(tps):
        return f"{tps * flops / (peak * 1e12):.1%}" if tps and flops and peak else "-"
    fmt = lambda v: f"{v:,.0f}" if v else "-"
    rows.append([
        f"seq {seq}, batch {ref[0]['batch_size'] if ref else '?'} / {suite[0]['spec']['batch_size'] if suite else '?'}",
        f"{fmt(ref_med)} ({len(ref_tps)}: {', '.join(fmt(v) for v in ref_tps)})",
        f"{fmt(suite_med)} ({len(suite_tps)}: {', '.join(fmt(v) for v in suite_tps)})",
        f"{suite_med / ref_med:.3f}" if ref_med and suite_med else "-",
        mfu(ref_med), mfu(suite_med),
        f"{max(r['peak_memory_gib'] for r in ref):.1f} / {max(r['peak_memory_gib'] for r in suite):.1f}" if ref and suite else "-",
    ])
header = ["shape (reference / suite batch)", "reference tok/s/GPU, median (runs)", "suite tok/s/GPU, median (runs)",
          "ratio of medians", "reference MFU (bf16 peak)", f"suite {mfu_label}",
          "peak GiB ref / suite"]
print("| " + " | ".join(header) + " |")
print("|" + "---|" * len(header))
for row in rows:
    print("| " + " | ".join(row) + " |")
print()
print(f"Suite: `hpcfsdp run {suite_fields}` (+ seq_len, batch_size). Reference: `bench/reference_loop.py {reference_flags}` "
      "(per-layer fully_shard and torch.compile, ZeRO-2, fused AdamW, the model's own loss).")
print(f"MFU: tokens/s/GPU x FLOPs per token (6 x non-embedding params + 12 x layers x hidden x seq + "
      f"6 x vocab x hidden for the tied LM head) / {peak} TFLOP/s (dense bf16 peak).")
for name in ("skipped.txt", "failed.txt"):
    if (work / name).exists():
        print(f"{name[:-4]}: " + "; ".join((work / name).read_text().split("\n")).strip("; "))
EOF
cp "$work/versus_reference.md" "$out/versus_reference.md"
tar -czf "$out/versus_reference.tar.gz" -C "$work" .
echo
echo "[versus] $(( SECONDS - started )) s; logs and records: $out/versus_reference.tar.gz"
cat "$out/versus_reference.md"
