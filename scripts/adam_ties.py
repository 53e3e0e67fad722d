"""Where do an odd reshard pair's source and the one-process run part? Per step, per parameter, from both runs'
checkpoints (saved every step, dropout off): the weights' relative L2 difference; for the worst tensor after
step 1, its gradient's spread and the elements that moved apart most, with their gradients in both runs.

Adam's update of an element is ``lr * m / (sqrt(v) + eps)``: about ``lr * sign(g)`` on its first steps, whatever
``|g|``. An element whose true gradient is ~0 gets its sign from rounding, so two runs that agree to 1e-7 may
move it by ``+lr`` and ``-lr``: an "Adam tie", not a wrong term. A wrong term moves many elements with a gradient
well above the runs' rounding.

    python scripts/adam_ties.py any:3          # the source layout vs the one-process run
    python scripts/adam_ties.py any:3 --mb1    # the one-process run with one sample per micro-batch instead
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel3d.checkpoint_io.compat import STATE_DIR  # noqa: E402
from parallel3d.checkpoint_io.state import read_metadata, read_tensors  # noqa: E402
from odd_pair_runs import parse_pair, train_both  # noqa: E402
from tests import reshard_matrix as rm  # noqa: E402


def _every_step(values: dict) -> str:
    values["train"].update(save_every=1, keep_last=rm.STEPS, async_save=False)
    return values["train"]["out_dir"]


def _state(out_dir: str, step: int, prefix: str) -> dict:
    state = os.path.join(rm.checkpoint_of(out_dir, step), STATE_DIR)
    keys = sorted(k for k, v in read_metadata(state).state_dict_metadata.items()
                  if k.startswith(prefix) and hasattr(v, "size"))
    return {k.removeprefix(prefix): v.double() for k, v in read_tensors(state, keys).items()}


def _first_update(w: dict, m: dict, name: str) -> None:
    """The worst tensor's elements with the largest step-1 weight gap: their gradient in both runs."""
    ga, gb = m["layout"][name] / 0.1, m["one"][name] / 0.1
    gap = (w["layout"][name] - w["one"][name]).abs().flatten()
    q = gb.abs().flatten().quantile(torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64)).tolist()
    print(f"  {name}: |g| quantiles 1%/50%/99% " + " ".join(f"{x:.1e}" for x in q)
          + f"; gradient rel L2 gap {((ga - gb).norm() / gb.norm()).item():.1e}")
    for i in gap.topk(5).indices.tolist():
        print(f"    element {i}: weight gap {gap[i].item():.1e}, g {ga.flatten()[i].item():.3e} vs {gb.flatten()[i].item():.3e}")


def main() -> int:
    pair, args = parse_pair(__doc__)
    with tempfile.TemporaryDirectory(prefix="p3d-adam-") as work:
        layout, one = train_both(pair, args, work, _every_step, timeout=1500)
        print(pair.name, "one process re-batched" if args.mb1 else "layout", "vs one process")
        for step in range(1, rm.STEPS + 1):
            w = {"layout": _state(layout, step, "model."), "one": _state(one, step, "model.")}
            m = {"layout": _state(layout, step, "optim.exp_avg."), "one": _state(one, step, "optim.exp_avg.")}
            rows = sorted((((w["layout"][n] - w["one"][n]).norm() / w["one"][n].norm()).item(), n) for n in w["one"])
            print(f"step {step}: weights rel L2 median {rows[len(rows) // 2][0]:.1e}; worst "
                  + ", ".join(f"{n} {r:.1e}" for r, n in rows[-3:]))
            if step == 1:  # the first update: exp_avg = (1 - beta1) g; the move lr * g / (|g| + eps)
                _first_update(w, m, rows[-1][1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
