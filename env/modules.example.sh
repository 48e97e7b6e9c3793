# Example module loads for a cluster; copy into the `setup:` section of a jobs YAML, e.g.
#   setup:
#     - module purge
#     - module load cuda/12.4 nccl
#     - source $HOME/hpcfsdp/.venv/bin/activate
# Module names differ per site: `module avail cuda` lists yours.
module purge
module load cuda/12.4
module load nccl
source "$HOME/hpcfsdp/.venv/bin/activate"
export HPCFSDP_CACHE=/scratch/$USER/hpcfsdp-cache   # where download_models.py put the models
export NCCL_DEBUG=WARN
