"""An odd reshard pair's MoE source vs the one-process run: per step, the grad norm gap, the tokens whose top-k
expert set flips between the two runs with each flip's margin, and the rounding the other tokens' scores show
(``tests/routing_flips.py``). ``--float64`` trains both in float64, where a near tie should no longer flip.

    python scripts/routing_probe.py any:3              # the pair once listed in SINGLE_PROCESS_MISSES
    python scripts/routing_probe.py any:3 --float64
    python scripts/routing_probe.py any:3 --eps 1e-12    # Adam's eps changed alone in both runs
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import odd_reshard as odd  # noqa: E402
from tests import reshard_matrix as rm  # noqa: E402
from tests import routing_flips as rf  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pair", metavar="LABEL:K")
    parser.add_argument("--float64", action="store_true")
    parser.add_argument("--eps", type=float, default=None, help="optimizer.eps of both runs (Adam's)")
    parser.add_argument("--cache-dir", default=".cache/parallel3d")
    args = parser.parse_args()
    label, k = args.pair.rsplit(":", 1)
    pair = odd.odd_pair(label, int(k))
    with tempfile.TemporaryDirectory(prefix="p3d-route-") as work:
        values = rm.job_values(pair, pair.source, os.path.join(work, "layout"), args.cache_dir)
        if args.eps is not None:
            values["optimizer"]["eps"] = args.eps
        layout = rf.merged(rm.run(rf.record_on_rank, pair.source.world_size, values, args.float64, timeout=1500))
        values = rm.single_process_values(pair, os.path.join(work, "one"), args.cache_dir)
        if args.eps is not None:
            values["optimizer"]["eps"] = args.eps
        one = rf.merged(rm.run(rf.record_on_rank, 1, values, args.float64))
    print(pair.name, "float64" if args.float64 else "fp32")
    for (step, *got), (_, *ref), routing in zip(layout[0], one[0], rf.compare(layout[1], one[1], layout[2], one[2])):
        gaps = [abs(a - b) / abs(b) for a, b in zip(got, ref) if b is not None]
        print(f"step {step}: loss/grad-norm/eval rel gaps {' '.join(f'{g:.1e}' for g in gaps)}; {routing.tokens} routed tokens, "
              f"{len(routing.flips)} flips, score rounding {routing.rounding:.1e}")
        for f in routing.flips:
            print(f"  flip {f.key}: experts {f.experts[0]} vs {f.experts[1]}, margin {f.margin:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
