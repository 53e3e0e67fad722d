#!/bin/bash
# usage: ab.sh tag stages label1:dir1 label2:dir2 ...   (sequential, alternating)
tag=$1; shift; stages=$1; shift
for spec in "$@"; do
  label=${spec%%:*}; dir=${spec#*:}
  cd $dir
  echo "=== $label pp$stages start $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)" >> /tmp/lead41/runs/$tag.log
  PYTHONPATH=$dir /work/main/.venv/bin/python scripts/bench_pipeline.py --stages $stages --hidden 128 --rounds 4 --steps 5 \
     --no-install --no-small-mb-case --schedules 1f1b --out /tmp/lead41/runs/${tag}_${label}_pp${stages}.json \
     > /tmp/lead41/runs/${tag}_${label}_pp${stages}.txt 2>&1
  echo "=== $label pp$stages end $(date -u +%H:%M:%S) rc $? load $(cut -d' ' -f1 /proc/loadavg)" >> /tmp/lead41/runs/$tag.log
done
