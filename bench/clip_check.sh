#!/usr/bin/env bash
# max_grad_norm under each wrapper family: the tiny model in fp32, clipped so hard that the clip
# shows in the loss (lr 1e-2, max_grad_norm 1e-6: the gradients fall below AdamW's eps), trained
# by ddp, fsdp2_zero3 and (on a GPU: FSDP1 needs one) fsdp1_full_shard on NPROC ranks; the losses
# must agree within 1e-5 (tests/test_equivalence.py checks ddp against fsdp2 on the CPU). Logs
# and the records under $OUT.
#
#   OUT=/tmp/clip bash bench/clip_check.sh           # GPU: ddp, fsdp2_zero3, fsdp1_full_shard
#   OUT=/tmp/clip CPU=1 bash bench/clip_check.sh     # CPU: ddp, fsdp2_zero3 (a smoke run)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:?set OUT to a folder for the logs}  # before gpu_env.sh, which makes $OUT (or bench-out)
source bench/gpu_env.sh
NPROC=${NPROC:-1}
write_machine_info "$OUT/machine.txt"
device=cuda strategies=(ddp fsdp2_zero3 fsdp1_full_shard)
if [[ ${CPU:-0} == 1 ]]; then device=cpu strategies=(ddp fsdp2_zero3); NPROC=2; export OMP_NUM_THREADS=1; fi
for strategy in "${strategies[@]}"; do
  python3 -m torch.distributed.run --standalone --nproc-per-node="$NPROC" -m hpcfsdp run \
    --results-dir "$OUT/results" --sweep clip model=tiny device=$device precision=fp32 strategy=$strategy \
    lr=1e-2 max_grad_norm=1e-6 steps=6 warmup_steps=1 comm_profile_steps=0 > "$OUT/$strategy.log" 2>&1 || true
  tail -1 "$OUT/$strategy.log"
done
python3 - "$OUT/results/clip" <<'PY' | tee "$OUT/clip_check.txt"
import json, sys
from pathlib import Path
records = {r["spec"]["strategy"]: r for r in (json.loads(p.read_text()) for p in Path(sys.argv[1]).glob("cells/*/result.json"))}
for name, record in sorted(records.items()):
    print(f"{name:18} {record['status']:6} {[round(x, 6) for x in record.get('losses') or []]}")
losses = [r["losses"] for r in records.values() if r["status"] == "ok"]
worst = max(abs(a - b) for other in losses[1:] for a, b in zip(losses[0], other)) if len(losses) > 1 else float("nan")
print(f"{len(losses)} of {len(records)} ok; largest difference in loss between them: {worst:.2e} (agree: {worst < 1e-5})")
PY
