"""Step-1 gradients per parameter of an odd reshard pair's source (``tests/odd_reshard.py``) vs the one-process run.

Each side trains one step (dropout off) and saves; the checkpoint's ``exp_avg`` after step 1 is (1 - beta1) times
the step's (clipped) gradient, stored layout-independently, so each parameter's relative L2 difference is its
gradient's. A wrong gradient shows here in the parameters it touches; rounding stays ~1e-7 to 1e-6 everywhere.

    python scripts/step1_grads.py any:1          # the source layout vs the one-process run
    python scripts/step1_grads.py any:1 --mb1    # the one-process run with one sample per micro-batch instead
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel3d.checkpoint_io.compat import STATE_DIR  # noqa: E402
from parallel3d.checkpoint_io.state import read_metadata, read_tensors  # noqa: E402
from odd_pair_runs import parse_pair, train_both  # noqa: E402
from tests import reshard_matrix as rm  # noqa: E402


def _one_step(values: dict) -> str:
    values["train"].update(steps=1, save_every=1, keep_last=1, async_save=False)
    return os.path.join(rm.checkpoint_of(values["train"]["out_dir"], 1), STATE_DIR)


def main() -> int:
    pair, args = parse_pair(__doc__)
    with tempfile.TemporaryDirectory(prefix="p3d-grad1-") as work:
        other, one = train_both(pair, args, work, _one_step)
        keys = sorted(k for k, v in read_metadata(one).state_dict_metadata.items()
                      if k.startswith("optim.exp_avg.") and hasattr(v, "size"))
        a, b = read_tensors(other, keys), read_tensors(one, keys)
        rows = sorted(((a[k].float() - b[k].float()).norm().item() / b[k].float().norm().item(), k) for k in keys)
    print(pair.name, "--mb1" if args.mb1 else "layout")
    print(f"{len(keys)} parameters, step-1 gradient relative L2 difference: median {rows[len(rows) // 2][0]:.1e}")
    for r, key in rows[-4:]:
        print(f"  {r:.1e} {key.removeprefix('optim.exp_avg.')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
