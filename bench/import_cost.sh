#!/usr/bin/env bash
# issue 52: why the first cell's imports take 5-12 s on a GPU node. What the interpreter reads
# (bytecode cached or compiled each time, the file system under site-packages), then the rank's
# imports timed in new interpreters, three times each way: as the image is, and with a
# PYTHONPYCACHEPREFIX the first run fills. Then `python -X importtime` of the rank's path, its
# 25 slowest modules and the time by top-level package. One device call of about a minute.
#   bash bench/import_cost.sh            # logs to $OUT (./bench-out)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/gpu_env.sh  # root, out (made) and python
log="$out/import_cost.log"
rank_imports='from hpcfsdp.cell import run'
{
  echo "[import_cost] $(date -u +%FT%T) $(nproc) CPUs, load: $(cut -d' ' -f1-3 /proc/loadavg)"
  "$python" - <<'EOF'
import os, sys, sysconfig, importlib.util
print("python", sys.version.split()[0], "dont_write_bytecode", sys.flags.dont_write_bytecode,
      "pycache_prefix", sys.pycache_prefix, "PYTHONDONTWRITEBYTECODE", os.environ.get("PYTHONDONTWRITEBYTECODE"))
for name in ("torch", "transformers", "sympy", "hpcfsdp", "pydantic"):
    spec = importlib.util.find_spec(name)
    folder = os.path.dirname(spec.origin)
    sources = cached = valid = 0
    for here, _dirs, files in os.walk(folder):
        for file in files:
            if file.endswith(".py"):
                sources += 1
                source = os.path.join(here, file)
                try:
                    with open(importlib.util.cache_from_source(source), "rb") as pyc:
                        header = pyc.read(16)
                except OSError:
                    continue
                cached += 1
                # a timestamp pyc is used only while its source's mtime and size match (PEP 552)
                stat = os.stat(source)
                flags, mtime, size = (int.from_bytes(header[i:i + 4], "little") for i in (4, 8, 12))
                valid += header[:4] == importlib.util.MAGIC_NUMBER and (
                    flags != 0 or (mtime == int(stat.st_mtime) & 0xFFFFFFFF and size == stat.st_size & 0xFFFFFFFF))
    print(f"{name}: {folder} .py {sources}, bytecode {cached}, of which current {valid}; "
          f"writable {os.access(folder, os.W_OK)}")
EOF
  df -T "$("$python" -c 'import torch, os; print(os.path.dirname(torch.__file__))')" /tmp | cat
  for label in image prefix; do
    if [[ $label == prefix ]]; then  # a cache the first run writes, whatever the image holds
      export PYTHONPYCACHEPREFIX=/tmp/pycache-import-cost; rm -rf "$PYTHONPYCACHEPREFIX"; unset PYTHONDONTWRITEBYTECODE
    fi
    for i in 1 2 3; do
      start=$(date +%s.%N)
      "$python" -c "$rank_imports"
      echo "[import_cost] $label run $i: $(python3 -c "print(round($(date +%s.%N) - $start, 2))") s for '$rank_imports'"
    done
  done
  unset PYTHONPYCACHEPREFIX
  "$python" -X importtime -c "$rank_imports" 2> "$out/importtime.txt"
  "$python" - "$out/importtime.txt" <<'EOF'
import collections, sys
rows = []
for line in open(sys.argv[1]):
    if not line.startswith("import time:") or "self [us]" in line:
        continue
    self_us, cumulative_us, name = (part.strip() for part in line[len("import time:"):].split("|"))
    rows.append((int(self_us), int(cumulative_us), name))
print("slowest modules by cumulative time (s):")
for self_us, cumulative_us, name in sorted(rows, key=lambda r: -r[1])[:25]:
    print(f"  {cumulative_us / 1e6:6.2f} {self_us / 1e6:6.2f} {name}")
by_package = collections.Counter()
for self_us, _, name in rows:
    by_package[name.strip().split(".")[0]] += self_us
print("self time by top-level package (s), total", round(sum(by_package.values()) / 1e6, 2))
for package, us in by_package.most_common(15):
    print(f"  {us / 1e6:6.2f} {package}")
EOF
} 2>&1 | tee "$log"
