#!/bin/bash
P=/work/main/.venv/bin/python
for tree in base new; do
  if [ $tree = base ]; then root=/tmp/zb45/base; else root=/work/wt/zb45; fi
  log=/tmp/zb45/out/${tree}_r3.txt
  { date -u; uptime; } > $log
  (cd $root && PYTHONPATH=$root nice -n 5 $P scripts/bench_pipeline.py --stages 4 --hidden 128 --rounds 4 --steps 5 \
     --no-install --peers --no-small-mb-case --schedules 1f1b zb_h1 --out /tmp/zb45/out/${tree}_r3.json) >> $log 2>&1
  { date -u; uptime; } >> $log
done
