#!/usr/bin/env bash
# An out-of-memory cell leaves its CUDA memory snapshot (issue 12 item 5): Qwen2.5-1.5B under DDP
# at a batch that cannot fit, with memory_snapshot: true, on one GPU. Writes under $OUT (default
# ./bench-out): oom_snapshot.json (the record) and oom_snapshot.txt (what the record names, the
# pickle's size, and the snapshot's largest live blocks at the failure). Prints the summary last.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source bench/gpu_env.sh  # root, out (made) and python
work="$(mktemp -d)"
write_machine_info "$out/oom_snapshot.machine.txt"
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
  -m hpcfsdp run --results-dir "$work" --sweep oom model=qwen2.5-1.5b seq_len=8192 batch_size=64 strategy=ddp \
  device=cuda memory_snapshot=true comm_profile_steps=0 nvml=false steps=3 warmup_steps=1 > "$work/run.log" 2>&1
record="$(ls "$work"/oom/cells/*/result.json)"
cp "$record" "$out/oom_snapshot.json"
python3 - "$record" > "$out/oom_snapshot.txt" <<'PY'
import json, os, pickle, sys
record = json.load(open(sys.argv[1]))
path = record.get("memory_snapshot")
print(f"status {record['status']} at stage {record.get('stage')}: {record.get('error', '')[:200]}")
print(f"memory_snapshot: {path} ({os.path.getsize(path) / 2**20:.1f} MiB)" if path and os.path.exists(path) else f"memory_snapshot: {path!r} (missing)")
if path and os.path.exists(path):
    snapshot = pickle.load(open(path, "rb"))
    blocks = [(b["size"], b.get("state")) for seg in snapshot["segments"] for b in seg["blocks"]]
    live = sorted((size for size, state in blocks if state == "active_allocated"), reverse=True)
    print(f"segments {len(snapshot['segments'])}, live blocks {len(live)}, live GiB {sum(live) / 2**30:.1f}, "
          f"largest live blocks GiB {[round(s / 2**30, 2) for s in live[:5]]}, "
          f"trace entries {sum(len(t) for t in snapshot.get('device_traces', []))}")
PY
tail -3 "$work/run.log" >> "$out/oom_snapshot.txt"
cat "$out/oom_snapshot.txt"
