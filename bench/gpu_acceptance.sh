#!/usr/bin/env bash
# The GPU path works (issue 32, item 6): one command, on a machine of two GPUs, in under 9 minutes.
#   (a) each fault (oom, error, hang, timeout) on rank 1 under ddp, fsdp1_full_shard, fsdp2_zero2,
#       fsdp2_zero3 and fsdp2_hsdp, tiny model: status, time from the fault to the cell's end, and
#       the processes left alive or on a GPU; rank 1 killed (SIGKILL) or stopped (SIGSTOP) under
#       ddp and fsdp2_zero3, recorded as rank 1's with its signal; and batch_size: auto cells where rank 1 alone runs out
#       of memory above batch 2 (auto_oom, auto_cuda_oom), which must measure batch 2;
#   (b) a real sweep of Qwen2.5-1.5B (seq 4096) through `hpcfsdp submit --executor local --wait`
#       and collect: 4 strategies x (batch 2, the smallest batch plan --memory says will not fit
#       this card) plus one batch_size: auto cell;
#   (c) one table (acceptance.md), and the raw logs in acceptance_logs.tar.gz; both go under
#       bench/results/<date>-<machine>-acceptance/, the table into docs/benchmarks.md.
# Run it on the commit that lands whenever a change touches cell/ or how cells are launched (the
# device's .git is a stale copy: name the commit as this machine's `git rev-parse HEAD` gives it):
#   BENCH_COMMIT=<commit> bash bench/gpu_acceptance.sh          # carry .whl
#   ACCEPTANCE_SMOKE=1 bash bench/gpu_acceptance.sh    # 2 CPU processes, tiny model, no FSDP1
#   ACCEPTANCE_PARTS="faults" / "sweep": one part only (the table covers what ran)
#   ACCEPTANCE_FAULTS="sigkill sigstop": only these faults (oom error hang timeout auto_oom auto_cuda_oom
#     sigkill sigstop)
# Output in $OUT (or ./bench-out).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/gpu_env.sh  # root, out (made) and python
work="$(mktemp -d)"
write_machine_info "$out/machine.txt"
cat "$out/machine.txt"
for part in ${ACCEPTANCE_PARTS:-faults sweep}; do
  echo "== $part ($SECONDS s)"
  $python bench/acceptance.py "$part" --work "$work" --out "$out" 2>&1 | tee "$out/$part.log"
done
$python bench/acceptance.py table --work "$work" --out "$out" | tee -a "$out/acceptance.log"
# Raw logs and records of every cell, and this run's own logs, in one archive; beside it only the
# table, machine.txt and the rows (the device gives back a few files per call).
cp "$out"/*.log "$out"/*.txt "$out"/*.yaml "$work"/ 2>/dev/null
tar -czf "$out/acceptance_logs.tar.gz" -C "$work" --exclude='*.pt' --exclude='*.pickle' . 2>/dev/null
find "$out" -maxdepth 1 -type f ! -name acceptance.md ! -name machine.txt ! -name faults.jsonl ! -name sweep.json ! -name run.log \
  ! -name acceptance_logs.tar.gz -delete
echo "== done in $SECONDS s"
