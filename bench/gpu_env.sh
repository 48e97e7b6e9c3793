# Sourced by the bench scripts (from the repository root) before they start any run:
#   - keeps NVLink multicast off in every process they start (never use it on shared machines);
#   - installs the wheels carried in .whl/ into /tmp/site (the GPU machine has no network;
#     docs/levers.md says which; not again where BENCH_WHEELS_INSTALLED is set, so that scripts
#     run side by side never replace files the other imports), and puts /tmp/site and src/ on PYTHONPATH;
#   - sets root (the repository root), out (the output folder: $OUT, or bench-out; made here) and
#     python ($PYTHON, or python3);
#   - defines gpu_memory_gib: the first GPU's memory in GiB, one decimal (the jobs' slurm.gpu_memory_gib);
#   - defines write_machine_info FILE: the GPUs, package versions, commit (BENCH_COMMIT where the
#     caller names it), tree state and date,
#     the header of every raw log in bench/results/.
# shellcheck shell=bash
root=$PWD
out="${OUT:-$root/bench-out}"
mkdir -p "$out"
python="${PYTHON:-python3}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# Inductor starts one compile worker per core in every process that compiles. On the lent machines
# host memory is handed out as it is used, and two processes compiling at once on a 32-core
# machine (64 workers importing torch) preceded a machine that stopped answering (2026-11-23):
# fewer workers per process.
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-8}
# Only the wheels this Python can install (a cp312 wheel carried for the GPU image is skipped by a
# CPU smoke run on another Python, which pip would otherwise refuse as a whole).
mapfile -t wheels < <(python3 - <<'EOF'
import glob, os
from pip._vendor.packaging.tags import sys_tags
from pip._vendor.packaging.utils import parse_wheel_filename
supported = set(sys_tags())
for wheel in sorted(glob.glob(".whl/*.whl")):
    if supported & set(parse_wheel_filename(os.path.basename(wheel))[3]):
        print(wheel)
EOF
)
if (( ${#wheels[@]} )) && [[ -z ${BENCH_WHEELS_INSTALLED:-} ]]; then  # set by a caller that installed them
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "${wheels[@]}" 2>&1 | tail -2
fi
export PYTHONPATH="/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

write_machine_info() {  # write_machine_info FILE
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
    python3 bench/versions.py
    # The device gets a copy of the working tree whose .git may be stale: the caller names the commit.
    if [[ -n ${BENCH_COMMIT:-} ]]; then echo "commit (given by the caller): $BENCH_COMMIT"
    else git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -20; fi
    date -u
  } > "$1"
}

gpu_memory_gib() {  # the first GPU's memory, GiB, one decimal
  nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{printf "%.1f", $1 / 1024}'
}
