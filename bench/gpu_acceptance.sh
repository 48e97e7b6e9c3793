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
# The one-GPU form (issue 52): a lone rank's faults (SIGKILL, SIGSTOP, a hang, a real OOM, an error)
# under the local executor, then under Slurm on a one-node local cluster whose gres is the GPU
# (bench/lone_acceptance.py; .debs/ as for bench/gpu_slurm_acceptance.sh where Slurm is not
# installed), one table (lone_acceptance.md) and the raw logs, in one call of 10 minutes on 1 GPU:
#   BENCH_COMMIT=<commit> ACCEPTANCE_ONE_GPU=1 bash bench/gpu_acceptance.sh      # carry .whl .debs
#   ACCEPTANCE_ONE_GPU=1 MODEL=tiny DEVICE=cpu bash bench/gpu_acceptance.sh     # CPU smoke run
#   LONE_EXECUTORS="local" / LONE_FAULTS="sigkill sigstop": a part of it
# Output in $OUT (or ./bench-out).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/gpu_env.sh  # root, out (made) and python
work="$(mktemp -d)"
if [[ ${ACCEPTANCE_ONE_GPU:-0} == 1 ]]; then
  write_machine_info "$out/machine.txt"
  cat "$out/machine.txt"
  export GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo CUDA_DEVICE_ORDER=PCI_BUS_ID
  for executor in ${LONE_EXECUTORS:-local slurm}; do
    echo "== $executor ($SECONDS s)"
    if [[ $executor == slurm ]]; then
      export HPCFSDP_SLURM_DIR=${HPCFSDP_SLURM_DIR:-/tmp/hpcfsdp-slurm-gpu} HPCFSDP_SLURM_NODES=1
      if [[ ${DEVICE:-cuda} == cpu ]]; then export HPCFSDP_SLURM_GPUS=1 HPCFSDP_SLURM_ACCOUNTING=0
      else
        export HPCFSDP_SLURM_GPUS=host HPCFSDP_SLURM_HOST_GPUS=${ACCEPTANCE_GPUS:-0} ACCEPTANCE_GPUS=${ACCEPTANCE_GPUS:-0}
        export HPCFSDP_SLURM_CPUS=${HPCFSDP_SLURM_CPUS:-8} HPCFSDP_SLURM_MEM_MB=${HPCFSDP_SLURM_MEM_MB:-100000}
        command -v sbatch >/dev/null || export HPCFSDP_SLURM_DEBS="$root/.debs"
      fi
      start=$(bash slurm/local/start.sh 2>"$out/start.log" | tail -1) || { cat "$out/start.log"; break; }
      eval "$start"
      # shellcheck disable=SC1091
      [[ -f $HPCFSDP_SLURM_DIR/conf/env.sh ]] && source "$HPCFSDP_SLURM_DIR/conf/env.sh"
    fi
    (cd bench && $python lone_acceptance.py "$executor" --work "$work" --out "$out") 2>&1 | tee "$out/lone_$executor.log"
    [[ $executor == slurm ]] && bash slurm/local/stop.sh 2>&1 | tail -1
  done
  (cd bench && $python lone_acceptance.py table --work "$work" --out "$out") | tee -a "$out/lone.log"
  cp "$out"/*.log "$out"/*.txt "$work"/ 2>/dev/null
  tar -czf "$out/lone_logs.tar.gz" -C "$work" --exclude='*.pt' --exclude='*.pickle' . 2>/dev/null
  find "$out" -maxdepth 1 -type f ! -name lone_acceptance.md ! -name machine.txt ! -name lone.jsonl \
    ! -name lone_logs.tar.gz -delete
  echo "== done in $SECONDS s"
  exit 0
fi
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
