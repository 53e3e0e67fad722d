"""scratch: per run, zb_h1's (B+W)/B worst [stages], F/F, paired wall & CPU vs 1f1b plain, and 1f1b plain's B CPU per action"""
import json, sys, glob, statistics
for f in sys.argv[1:]:
    d = json.load(open(f))
    rows = {r["system"]: r for r in d["rows"]}
    z, pl = rows.get("ours zb_h1"), rows.get("ours 1f1b plain")
    bw = z.get("backward_ratio_per_stage") or {}
    ff = z.get("forward_ratio_per_stage") or {}
    cc = {k: v for k, v in pl.items() if "compute_cpu" in k}
    print(f.split('/')[-1], d.get("date"), "load", d.get("load_average"),
          "B+W/B", f"{max(bw.values()):.3f}", "[" + " ".join(f"{v:.3f}" for _, v in sorted(bw.items())) + "]",
          "F/F", " ".join(f"{v:.3f}" for _, v in sorted(ff.items())),
          "zb/1f1b_default paired wall", z.get("paired_vs_ours_1f1b"), "cpu", z.get("paired_cpu_vs_ours_1f1b"),
          "| plain paired", pl.get("paired_vs_ours_1f1b"), pl.get("paired_cpu_vs_ours_1f1b"))
