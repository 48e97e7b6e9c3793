# Sourced by the bench scripts (from the repository root) before they start any run:
#   - keeps NVLink multicast off in every process they start (never use it on shared machines);
#   - installs the wheels carried in .whl/ into /tmp/site (the GPU machine has no network;
#     docs/levers.md says which), and puts /tmp/site and src/ on PYTHONPATH;
#   - defines write_machine_info FILE: the GPUs, package versions, commit, tree state and date,
#     the header of every raw log in bench/results/.
# shellcheck shell=bash
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# Inductor starts one compile worker per core in every process that compiles. On the lent machines
# host memory is handed out as it is used, and two processes compiling at once on a 32-core
# machine (64 workers importing torch) preceded a machine that stopped answering (2026-11-23):
# fewer workers per process.
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-8}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH="/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

write_machine_info() {  # write_machine_info FILE
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    python3 bench/versions.py
    git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -20; date -u
  } > "$1"
}
