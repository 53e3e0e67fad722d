"""Is a shape-fuzz case's miss the layout or rounding? Per-step deviation from the single-process reference of
the layout run and of the reference itself with one sample per micro-batch (its noise), with variants.

    python scripts/noise_probe.py 0                                    # case 0, its 4 steps
    python scripts/noise_probe.py 0 --steps 10                         # does the gap grow (a bug compounds)?
    python scripts/noise_probe.py 0 --set '{"cp": 1}'                  # one parallel dimension changed
    python scripts/noise_probe.py 0 --set '{"model": {"num_kv_heads": 3}}'   # the model (merged; "moe": null: dense)
    python scripts/noise_probe.py --odd any:1 --set '{"model": {"dropout": 0.0}}'  # an odd reshard pair's source

Each row: the largest relative deviation (loss, grad norm; eval loss where evaluated) at each step, not
cumulative. A layout bug shows at step 1 (no update yet) or grows; rounding tracks the ``1p-mb1`` row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import layout_matrix as lm  # noqa: E402
from tests import layout_run as lr  # noqa: E402
from tests import shape_fuzz as sf  # noqa: E402


def _variant(case: sf.ShapeCase, changes: dict) -> sf.ShapeCase:
    changes = dict(changes)
    model = dict(changes.pop("model", {}))
    shape = dict(case.shape, **{k: v for k, v in model.items() if k != "moe"})
    if "moe" in model:
        if model["moe"] is None:
            shape.pop("moe", None)
        else:
            shape["moe"] = dict(case.shape.get("moe", {}), **model["moe"])
    return dataclasses.replace(case, shape=shape, parallel=dict(case.parallel, **changes))


def _per_step(curve: list, reference: list) -> list[float]:
    return [max(abs(a - b) / abs(b) for a, b in zip(got[1:], ref[1:]) if b is not None)
            for got, ref in zip(curve, reference)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case_id", type=int, nargs="?", default=0)
    parser.add_argument("--odd", default=None, metavar="LABEL:K",
                        help="probe odd reshard pair K of property LABEL's source instead (tests/odd_reshard.py)")
    parser.add_argument("--steps", type=int, default=lm.STEPS)
    parser.add_argument("--set", default="{}", help="JSON: parallel values, and model values under 'model'")
    parser.add_argument("--cache-dir", default=".cache/parallel3d")
    args = parser.parse_args()
    lm.STEPS = args.steps  # the jobs below are built from it (the tests' fixed value otherwise)
    if args.odd is None:
        base = sf.case_by_id(args.case_id)
    else:
        from tests import odd_reshard as odd

        label, k = args.odd.rsplit(":", 1)
        base = odd.odd_pair(label, int(k)).case
    case = _variant(base, json.loads(args.set))
    print(case.name, f"world {case.world_size}, {args.steps} steps", flush=True)
    g = case.train["global_batch_size"]
    with tempfile.TemporaryDirectory(prefix="p3d-probe-") as work:
        ref = lr.train_reference(lm.reference_values(case, os.path.join(work, "ref"), args.cache_dir), True)
        mb1 = lr.train_reference(case.job({}, {"global_batch_size": g, "micro_batch_size": 1},
                                          os.path.join(work, "mb1"), args.cache_dir), True)
        result = lr.run_case(case, work, args.cache_dir, {case.reference_key(): ref}, quiet=True, timeout=1500)
    if result.error:
        print("layout run failed:", result.error)
        return 1
    for label, curve in (("layout", result.curve), ("1p-mb1", mb1)):
        print(f"{label:7s}", " ".join(f"{x:.1e}" for x in _per_step(curve, ref)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
