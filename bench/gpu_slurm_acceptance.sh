#!/usr/bin/env bash
# GPU cells under real Slurm (issue 42): a local cluster of two nodes on this machine's GPUs
# (slurm/local/start.sh, HPCFSDP_SLURM_GPUS=host: 2 x 2 on 4 GPUs, the reduced form 2 x 1 on 2),
# from Debian 12's Slurm packages carried in .debs/ where Slurm is not installed, then the parts of
# bench/slurm_acceptance.py, one table (slurm_acceptance.md) and the raw logs (slurm_logs.tar.gz).
# Each part fits one device call of 10 minutes; run them in separate calls if need be:
#   BENCH_COMMIT=<commit> SLURM_ACCEPTANCE_PARTS="seed multinode" bash bench/gpu_slurm_acceptance.sh   # carry .whl .debs
#   BENCH_COMMIT=<commit> SLURM_ACCEPTANCE_PARTS="faults daytoday" bash bench/gpu_slurm_acceptance.sh
#   SLURM_ACCEPTANCE_SMOKE=1 bash bench/gpu_slurm_acceptance.sh    # CPU, tiny model, stand-in GPUs
#   SLURM_ACCEPTANCE_HOST_GPUS=2,3: the cluster takes only these GPUs (the others stay free)
# Needs: root, the wheels of docs/levers.md in .whl/ (submitit, orjson, duckdb, tabulate, cloudpickle)
# and, where Slurm is not installed, .debs/ filled by:
#   (cd .debs && apt-get download slurmd slurmctld slurm-client slurm-wlm-basic-plugins libslurm38 munge \
#      libmunge2 libhwloc15 liblz4-1 libnuma1 libjson-c5 liblua5.1-0 libyaml-0-2 libreadline8 libdbus-1-3)
# Output in $OUT (or ./bench-out).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/gpu_env.sh  # root, out (made) and python
work="$(mktemp -d)"
export HPCFSDP_SLURM_DIR=${HPCFSDP_SLURM_DIR:-/tmp/hpcfsdp-slurm-gpu} HPCFSDP_SLURM_PREEMPT=1
export HPCFSDP_SLURM_CPUS=${HPCFSDP_SLURM_CPUS:-16} HPCFSDP_SLURM_MEM_MB=${HPCFSDP_SLURM_MEM_MB:-100000}
export GLOO_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo
if [[ ${SLURM_ACCEPTANCE_SMOKE:-0} == 1 ]]; then
  export HPCFSDP_SLURM_GPUS=2 HPCFSDP_SLURM_ACCOUNTING=0 SLURM_ACCEPTANCE_GPUS_PER_NODE=2 OMP_NUM_THREADS=1
else
  export HPCFSDP_SLURM_GPUS=host HPCFSDP_SLURM_HOST_GPUS=${SLURM_ACCEPTANCE_HOST_GPUS:-}
  export ACCEPTANCE_GPUS=${SLURM_ACCEPTANCE_HOST_GPUS:-} CUDA_DEVICE_ORDER=PCI_BUS_ID   # processes left: on these GPUs
  gpus=${SLURM_ACCEPTANCE_HOST_GPUS:-$(nvidia-smi -L | wc -l)}
  [[ $gpus == *,* ]] && gpus=$(tr ',' '\n' <<<"$gpus" | wc -l)
  export SLURM_ACCEPTANCE_GPUS_PER_NODE=$((gpus / 2))
  command -v sbatch >/dev/null || export HPCFSDP_SLURM_DEBS="$root/.debs"
fi
write_machine_info "$out/machine.txt"
cat "$out/machine.txt"
start=$(bash slurm/local/start.sh 2>"$out/start.log" | tail -1) || { cat "$out/start.log"; exit 1; }
eval "$start"
# shellcheck disable=SC1091
[[ -f $HPCFSDP_SLURM_DIR/conf/env.sh ]] && source "$HPCFSDP_SLURM_DIR/conf/env.sh"
tail -4 "$out/start.log"
for part in ${SLURM_ACCEPTANCE_PARTS:-seed multinode faults daytoday}; do
  echo "== $part ($SECONDS s)"
  $python bench/slurm_acceptance.py "$part" --work "$work/$part" --out "$out" 2>&1 | tee "$out/$part.run.log"
done
$python bench/slurm_acceptance.py table --work "$work" --out "$out"
squeue 2>&1 | head -5
bash slurm/local/stop.sh 2>&1 | tail -2
# Raw logs and every record in one archive; beside it only the table, machine.txt and the rows.
cp "$out"/*.log "$out"/*.txt "$out"/*.json "$out"/*.md "$HPCFSDP_SLURM_DIR"/log/*.log "$work"/ 2>/dev/null
tar -czf "$out/slurm_logs.tar.gz" -C "$work" --exclude='*.pt' --exclude='*.pickle' . 2>/dev/null
find "$out" -maxdepth 1 -type f ! -name slurm_acceptance.md ! -name machine.txt ! -name seed_summary.md ! -name scaling_section.md ! -name scaling.png \
  ! -name slurm_logs.tar.gz -delete
echo "== done in $SECONDS s"
