#!/usr/bin/env bash
# issue 36: `hpcfsdp tune` against the whole grid of the same YAML, both with the local executor
# on this machine, then one table (bench/tune_vs_grid_table.py): the grid's best and top three,
# tune's pick and where the grid ranks it, and what each spent in GPU-hours, counted per launch
# (launcher start to end, x its GPUs): tune's from its launch files, the grid's from the manifest
# (submitted_at to ended_at of each cell). Raw logs, records and the table go to $OUT (./bench-out).
#   bash bench/tune_vs_grid.sh                                   # bench/jobs/tune_zero2_vs_zero3.yaml, GPUs
#   SMOKE=1 bash bench/tune_vs_grid.sh                           # the tiny model on CPU, a small matrix
# TUNE_ARGS are passed on to `hpcfsdp tune` (e.g. "--top 3 --eta 3").
#
# Both halves go on where an earlier call stopped (the grid skips cells with a record, tune resumes
# its search), so a grid longer than one sitting runs over several calls with the same OUT.
# STREAM_S stops the call's work after that many seconds (default: none); SKIP_TUNE=1 runs the grid
# only; FRESH_TUNE=1 starts the search again; REQUIRE_GPU=H200 refuses other cards (records of
# several calls may be combined only from one kind of card).
#
# Two streams: where the machine has GPUs for two cells at once (4 GPUs, cells of 2), or STREAMS=2
# on CPU, stream 0 (the first GPUs) runs tune and then a share of the grid's cells, and stream 1
# (the next GPUs) the rest of them, side by side; each stream's grid cells go to its own folder
# (grid/, grid1/: one submit lock each), and the table reads both. The cells without a record are
# shared by a rough cost (bench/tune_vs_grid_split.py), stream 0 behind by TUNE_HEAD_START_S
# (default 850) while tune still has to run.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/gpu_env.sh  # root, out (made) and python
jobs="${1:-bench/jobs/tune_zero2_vs_zero3.yaml}"
if [[ "${SMOKE:-0}" == 1 ]]; then
  gpus=0
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
  write_machine_info "$out/machine.$(date -u +%Y%m%dT%H%M%S).txt"
  card="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  if [[ -n ${REQUIRE_GPU:-} && $card != *"$REQUIRE_GPU"* ]]; then
    echo "refused: this machine's cards are $card, not $REQUIRE_GPU (records are combined from one kind of card only)"
    exit 2
  fi
  gpus="$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)"
  memory_gib="$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print $1 / 1024}')"
  copy="$out/$(basename "$jobs")"  # the card's own memory for tune's pruning
  "$python" - "$jobs" "$copy" "$memory_gib" <<'PY'
import sys, yaml
doc = yaml.safe_load(open(sys.argv[1]))
doc.setdefault("slurm", {}).pop("gpu_name", None)
doc["slurm"]["gpu_memory_gib"] = round(float(sys.argv[3]), 1)
yaml.safe_dump(doc, open(sys.argv[2], "w"), sort_keys=False)
PY
  jobs="$copy"
fi
read -r name per_cell < <("$python" -c 'import sys; from hpcfsdp.sweep.define.matrix import load_sweep
s = load_sweep(sys.argv[1]); print(s.name, max(c.spec.world_size for c in s.cells))' "$jobs")
streams="${STREAMS:-$(( gpus >= 2 * per_cell ? 2 : 1 ))}"
deadline=$(( $(date +%s) + ${STREAM_S:-999999} ))
left() { echo $(( deadline - $(date +%s) )); }
log() { echo "[tune_vs_grid] $(date -u +%T) $*"; }
tune_done() { [[ -f "$out/tune/$name/tune.json" ]]; }
[[ "${FRESH_TUNE:-0}" == 1 ]] && rm -rf "$out/tune/$name"

run_tune() {  # run_tune STREAM: tune on that stream's GPUs until done or the deadline
  log "stream $1: tune $name"
  # shellcheck disable=SC2086
  timeout --kill-after=30 "$(left)" "$python" -m hpcfsdp tune "$jobs" --executor local \
    --results-dir "$out/tune" ${TUNE_ARGS:-} >> "$out/tune.log" 2>&1
}

run_grid() {  # run_grid STREAM: that stream's share of the grid's cells (split below)
  local part="$out/grid_part$1.yaml" folder="$out/grid"
  (( $1 > 0 )) && folder="$out/grid$1"
  [[ -f $part ]] || return 0
  log "stream $1: grid cells of $part"
  timeout --kill-after=30 "$(left)" "$python" -m hpcfsdp submit "$part" --executor local \
    --results-dir "$folder" >> "$out/grid$1.log" 2>&1
}

stream() {  # stream K: on its own GPUs (CUDA_VISIBLE_DEVICES), tune first on stream 0
  if (( gpus > 0 )); then
    CUDA_VISIBLE_DEVICES="$(seq -s, $(( $1 * per_cell )) $(( ($1 + 1) * per_cell - 1 )))"
    # nvidia-smi's indexes (the local executor asks it whether a cell's GPUs are free) are in PCI order.
    export CUDA_VISIBLE_DEVICES CUDA_DEVICE_ORDER=PCI_BUS_ID
  fi
  if (( $1 == 0 )) && [[ "${SKIP_TUNE:-0}" != 1 ]] && ! tune_done; then run_tune 0; fi
  (( $(left) > 0 )) && run_grid "$1"
}

mkdir -p "$out/grid"
# The split is made once, before either stream starts: stream 0 starts its cells behind by what
# tune is expected to take (TUNE_HEAD_START_S) while tune still has to run.
head_start=0
if [[ "${SKIP_TUNE:-0}" != 1 ]] && ! tune_done; then head_start="${TUNE_HEAD_START_S:-850}"; fi
shopt -s nullglob
"$python" bench/tune_vs_grid_split.py "$jobs" "$out/grid_part" --streams "$streams" --head-start-s "$head_start" \
  --grid "$out"/grid*/"$name" | tee -a "$out/split.log" || exit 1
pids=()
for (( k = 0; k < streams; k++ )); do
  stream "$k" &
  pids+=("$!")
done
for pid in "${pids[@]}"; do wait "$pid"; done
log "both streams ended; $(left) s of STREAM_S left"
grids=("$out"/grid "$out"/grid[0-9]*)
if tune_done; then
  "$python" bench/tune_vs_grid_table.py --tune "$out/tune/$name" --jobs "$jobs" \
    $(for g in "${grids[@]}"; do [[ -d $g/$name ]] && echo "--grid $g/$name"; done) | tee "$out/tune_vs_grid.md"
else
  echo "tune has not finished: run the same command again"
fi
tar -czf "$out/$name.tar.gz" -C "$out" --exclude='*.tar.gz' . 2>/dev/null
