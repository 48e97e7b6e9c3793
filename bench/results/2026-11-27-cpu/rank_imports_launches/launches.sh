#!/usr/bin/env bash
# Alternating real launches, before (a3f5631) and after (branch s49b).
export PYTHON=/work/main/.venv/bin/python
for round in ${ROUNDS:-1 2}; do
  for side in before after; do
    if [[ $side == before ]]; then tree=/tmp/s49b/base; else tree=/work/wt/s49b; fi
    echo "=== round $round $side ($tree) $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
    (cd $tree && PYTHONPATH= MODEL=tiny DEVICE=cpu STRATEGIES=ddp OUT=/tmp/s49b/launch_${side}_$round bash bench/launch_phases.sh)
  done
done
echo "=== done $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)"
