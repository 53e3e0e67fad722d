#!/bin/bash
# scratch driver: in-process pairing, then the benchmark alternating base (main be35eba) / new (zb45)
P=/work/main/.venv/bin/python
cd /work/wt/zb45
{ date -u; uptime; } > /tmp/zb45/out/profile_w_lag.txt
PYTHONPATH=$PWD nice -n 5 $P scripts/profile_w_lag.py --rounds 60 --lags 0 2 --base /tmp/zb45/base >> /tmp/zb45/out/profile_w_lag.txt 2>&1
{ date -u; uptime; } >> /tmp/zb45/out/profile_w_lag.txt
for r in 1 2 3; do
  for tree in base new; do
    if [ $tree = base ]; then root=/tmp/zb45/base; else root=/work/wt/zb45; fi
    log=/tmp/zb45/out/${tree}_r$r.txt
    { date -u; uptime; } > $log
    (cd $root && PYTHONPATH=$root nice -n 5 $P scripts/bench_pipeline.py --stages 4 --hidden 128 --rounds 4 --steps 5 \
       --no-install --peers --no-small-mb-case --schedules 1f1b zb_h1 --out /tmp/zb45/out/${tree}_r$r.json) >> $log 2>&1
    { date -u; uptime; } >> $log
  done
done
echo done > /tmp/zb45/out/DONE
