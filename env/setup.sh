#!/usr/bin/env bash
# Create .venv and install hpcfsdp into it (editable, from this checkout).
#   bash env/setup.sh          # the project and its runtime dependencies; GPU or CPU build of torch
#                              # by whether nvidia-smi answers on THIS machine
#   bash env/setup.sh --gpu    # for GPU compute nodes, wherever it runs (a GPU-less login node too):
#                              # pip's default CUDA build of torch and the `gpu` extra (torchao,
#                              # liger-kernel, cut-cross-entropy: docs/levers.md)
#   bash env/setup.sh --cpu    # the CPU build (torch==2.13.0), no `gpu` extra
#   bash env/setup.sh --dev    # plus test tools: pytest, build, ruff, mypy, and (as root on Debian)
#                              # Chromium for the HTML report test; the tests install Slurm themselves
# Air-gapped clusters (docs/install.md):
#   bash env/setup.sh --download-wheels DIR [--gpu|--cpu] [--dev] [--python-version 3.11]
#        [--platform manylinux_2_28_x86_64]   # where a package index answers: every wheel into DIR
#   bash env/setup.sh --wheelhouse DIR        # installs from DIR only (pip --no-index)
#   --dry-run: print the pip commands instead of running them (no venv is made)
# Torch: TORCH_SPEC overrides the requirement (e.g. TORCH_SPEC='torch==2.11.0'); --torch-index URL
# takes torch from that index, e.g. https://download.pytorch.org/whl/cpu for a CPU build of a
# release whose PyPI build is CUDA's. HPCFSDP_VENV: another venv than .venv.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${HPCFSDP_VENV:-$root/.venv}"
usage() { sed -n '2,${/^#/!q;p}' "$0"; }
die() { echo "setup.sh: $*" >&2; exit 2; }

build="" dev="" dry="" download="" wheelhouse="" python_version="" platform="" torch_index=""
while (($#)); do
  case "$1" in
    --dev) dev=1 ;;
    --dry-run) dry=1 ;;
    --gpu | --cpu) [[ -z "$build" || "$build" == "${1#--}" ]] || die "--gpu and --cpu exclude each other"; build="${1#--}" ;;
    --download-wheels | --wheelhouse | --python-version | --platform | --torch-index)
      (($# > 1)) || die "$1 needs a value"
      case "$1" in
        --download-wheels) download="$2" ;;
        --wheelhouse) wheelhouse="$2" ;;
        --python-version) python_version="$2" ;;
        --platform) platform="$2" ;;
        --torch-index) torch_index="$2" ;;
      esac
      shift ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown option '$1' (expected --gpu, --cpu, --dev, --dry-run, --download-wheels DIR, --wheelhouse DIR, --python-version X.Y, --platform TAG, --torch-index URL; --help)" ;;
  esac
  shift
done
[[ -z "$download" || -z "$wheelhouse" ]] || die "--download-wheels and --wheelhouse exclude each other"
[[ -n "$download" || (-z "$python_version" && -z "$platform") ]] || die "--python-version and --platform go with --download-wheels"
if [[ -n "$wheelhouse" ]]; then
  [[ -d "$wheelhouse" ]] || die "--wheelhouse $wheelhouse: no such folder"
  wheelhouse="$(cd "$wheelhouse" && pwd)"
  # What --download-wheels filled it for, unless the command line says otherwise.
  if [[ -f "$wheelhouse/setup-flags" ]]; then
    read -r saved_build saved_dev <"$wheelhouse/setup-flags" || true
    build="${build:-$saved_build}" dev="${dev:-${saved_dev#nodev}}"
  fi
fi
if [[ -z "$build" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1; then build=gpu; else build=cpu; fi
  echo "[setup] $build build (nvidia-smi $([[ $build == gpu ]] && echo answers || echo is absent) here; --gpu or --cpu chooses)" >&2
fi

extra_names=()
[[ -z "$dev" ]] || extra_names+=(dev)
if [[ "$build" == gpu ]]; then
  torch_spec="${TORCH_SPEC:-torch>=2.11,<2.14}"
  extra_names+=(gpu)
else
  torch_spec="${TORCH_SPEC:-torch==2.13.0}"
fi
extras=""
if ((${#extra_names[@]})); then extras="[$(IFS=,; echo "${extra_names[*]}")]"; fi

# Runs a command, or prints it with --dry-run.
run() { if [[ -n "$dry" ]]; then echo "+ $*"; else "$@"; fi; }

make_venv() {
  [[ -z "$dry" && ! -x "$venv/bin/python" ]] || return 0
  echo "[setup] creating $venv" >&2
  if ! python3 -m venv "$venv" 2>/dev/null; then
    # Debian ships venv separately; as root we can add it.
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    python3 -m venv "$venv"
  fi
}

# pip's --platform takes one tag per flag: a manylinux_2_N tag admits every older glibc's wheels.
platform_flags() {
  if [[ "$1" =~ ^manylinux_2_([0-9]+)_(.+)$ ]]; then
    local minor="${BASH_REMATCH[1]}" arch="${BASH_REMATCH[2]}"
    for ((m = minor; m >= 5; m--)); do echo "--platform=manylinux_2_${m}_$arch"; done
    printf -- '--platform=%s\n' "manylinux2014_$arch" "manylinux2010_$arch" "manylinux1_$arch"
  else
    echo "--platform=$1"
  fi
}

if [[ -n "$download" ]]; then
  run mkdir -p "$download"
  download="$(cd "$(dirname "$download")" && pwd)/$(basename "$download")"
  make_venv
  pip=("$venv/bin/python" -m pip --disable-pip-version-check)
  target=(--only-binary=:all:)  # wheels only: the air-gapped side needs no compiler
  [[ -z "$python_version" ]] || target+=(--implementation=cp "--python-version=$python_version")
  if [[ -n "$platform" ]]; then mapfile -t -O "${#target[@]}" target < <(platform_flags "$platform"); fi
  echo "[setup] building the hpcfsdp wheel into $download" >&2
  run "${pip[@]}" wheel --quiet --no-deps -w "$download" "$root"
  wheel="$( (ls -t "$download"/hpcfsdp-*.whl 2>/dev/null || echo "$download/hpcfsdp-VERSION-py3-none-any.whl") | head -n 1)"
  if [[ -n "$torch_index" ]]; then
    echo "[setup] downloading $torch_spec from $torch_index" >&2
    run "${pip[@]}" download --quiet --no-deps -d "$download" "${target[@]}" --index-url "$torch_index" "$torch_spec"
  fi
  echo "[setup] downloading $torch_spec, hpcfsdp$extras's dependencies and setuptools into $download" >&2
  run "${pip[@]}" download --quiet -d "$download" "${target[@]}" --find-links "$download" \
    "$torch_spec" "setuptools>=77" "$wheel$extras"
  [[ -n "$dry" ]] && exit 0
  echo "$build ${dev:-nodev}" >"$download/setup-flags"
  echo "[setup] done: $(ls "$download" | wc -l) files, $(du -sh "$download" | cut -f1); install with" \
    "bash env/setup.sh --wheelhouse $download" >&2
  exit 0
fi

make_venv
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
if [[ -n "$wheelhouse" ]]; then
  pip+=(--no-index --find-links "$wheelhouse")
  torch_pip=("${pip[@]}")
elif [[ -n "$torch_index" ]]; then
  torch_pip=("${pip[@]}" --index-url "$torch_index")
else
  torch_pip=("${pip[@]}")
fi
echo "[setup] installing $torch_spec${wheelhouse:+ from $wheelhouse}" >&2
run "${torch_pip[@]}" "$torch_spec"
echo "[setup] installing hpcfsdp$extras (editable)${wheelhouse:+ from $wheelhouse}" >&2
run "${pip[@]}" -e "$root$extras"
[[ -z "$dry" ]] || exit 0
# The tests' tools a minbase Debian lacks: g++ and Python's headers (torch.compile builds C++ on
# the CPU: the compiled loss, cut-cross-entropy's CPU path in tests/test_levers.py), and git (the
# provenance and export tests make checkouts; a container of a checkout bound in has none).
if [[ -n "$dev" ]] && { ! command -v g++ >/dev/null 2>&1 || ! command -v git >/dev/null 2>&1 \
    || [[ ! -e "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')/Python.h" ]]; } \
    && [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
  echo "[setup] installing Debian's g++, python3-dev and git (the tests compile C++ and make checkouts)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ python3-dev git >/dev/null
fi
if [[ -n "$dev" ]] && ! command -v chromium >/dev/null 2>&1 && [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null; then
  echo "[setup] installing Debian's chromium (headless rendering test of the HTML report)" >&2
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium fonts-dejavu-core >/dev/null
fi
echo "[setup] done: source $venv/bin/activate" >&2
