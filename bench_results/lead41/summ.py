import json, sys
for f in sys.argv[1:]:
    d = json.load(open(f))
    rows = {r["system"]: r for r in d["rows"] if r.get("case") == "main"}
    o = rows.get("ours 1f1b"); t = rows.get("torch.pipelining 1f1b")
    print(f.split("/")[-1], "load", d.get("load_average"), "| ours median %.4f torch median %.4f | torch/ours paired %.3f cpu %.3f | exec cpu us/action %.1f exec wall us/action %.1f" % (
        o["median_s"], t["median_s"], t["paired_vs_ours_1f1b"], t["paired_cpu_vs_ours_1f1b"], o["executor_cpu_us_per_action"], o["executor_us_per_action"]))
