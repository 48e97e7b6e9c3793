#!/usr/bin/env bash
# Create .venv and install hpcfsdp into it.
#   bash env/setup.sh          # the project and its runtime dependencies
#   bash env/setup.sh --dev    # plus test tools: pytest, and (as root on Debian) Chromium for the
#                              # HTML report test; the tests install Slurm themselves (slurm/local/)
# Torch: on a machine without an NVIDIA GPU the CPU build (torch==2.13.0) is installed; on a GPU
# node pip's default CUDA build is used, with the `gpu` extra (torchao, cut-cross-entropy,
# liger-kernel: docs/levers.md). Override with TORCH_SPEC, e.g. TORCH_SPEC='torch==2.11.0'.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${HPCFSDP_VENV:-$root/.venv}"
extra_names=()
for arg in "$@"; do
  case "$arg" in
    --dev) extra_names+=(dev) ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown option '$arg' (expected --dev)" >&2; exit 2 ;;
  esac
done

if [[ ! -x "$venv/bin/python" ]]; then
  echo "[setup] creating $venv" >&2
  if ! python3 -m venv "$venv" 2>/dev/null; then
    # Debian ships venv separately; as root we can add it.
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    python3 -m venv "$venv"
  fi
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)

if command -v nvidia-smi >/dev/null 2>&1; then
  torch_spec="${TORCH_SPEC:-torch>=2.11,<2.14}"
  extra_names+=(gpu)
else
  torch_spec="${TORCH_SPEC:-torch==2.13.0}"
fi
extras=""
if (( ${#extra_names[@]} )); then extras="[$(IFS=,; echo "${extra_names[*]}")]"; fi
echo "[setup] installing $torch_spec" >&2
"${pip[@]}" "$torch_spec"
echo "[setup] installing hpcfsdp$extras (editable)" >&2
"${pip[@]}" -e "$root$extras"
if [[ " ${extra_names[*]} " == *" dev "* ]] && ! command -v chromium >/dev/null 2>&1 && [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
  echo "[setup] installing Debian's chromium (headless rendering test of the HTML report)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
fi
echo "[setup] done: source $venv/bin/activate" >&2
