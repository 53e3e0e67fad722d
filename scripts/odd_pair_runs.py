"""An odd reshard pair's two runs, for the scripts that compare them (``adam_ties.py``, ``step1_grads.py``).

Invariant: both runs train the pair's own model and data (``tests/reshard_matrix``'s values for the pair drawn by
``tests/odd_reshard.odd_pair``); the "other" run is the pair's source layout on its ranks, or with ``--mb1`` the
one-process run re-batched to one sample per micro-batch; the "one" run is always the one-process run. Each run's
values pass through the caller's ``prepare`` (what to save; it returns where to read it) before that run trains.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable

from tests import layout_run as lr
from tests import odd_reshard as odd
from tests import reshard_matrix as rm


def parse_pair(description: str) -> tuple[rm.Pair, argparse.Namespace]:
    """The command line both scripts take (``LABEL:K [--mb1] [--cache-dir DIR]``) and the pair it names."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("pair", metavar="LABEL:K", help="odd_reshard.odd_pair's property label and pair index")
    parser.add_argument("--mb1", action="store_true",
                        help="compare the one-process run re-batched (one sample per micro-batch), not the layout")
    parser.add_argument("--cache-dir", default=".cache/parallel3d")
    args = parser.parse_args()
    label, k = args.pair.rsplit(":", 1)
    return odd.odd_pair(label, int(k)), args


def train_both(pair: rm.Pair, args: argparse.Namespace, work: str, prepare: Callable[[dict], str],
               timeout: float = 300.0) -> tuple[str, str]:
    """Train the "other" run then the "one" run under ``work``; ``prepare``'s result for each, in that order.
    ``timeout``: the source layout's ranks' (``reshard_matrix.run``)."""
    if args.mb1:
        values = rm.single_process_values(pair, os.path.join(work, "other"), args.cache_dir)
        values["train"]["micro_batch_size"] = 1
        other = prepare(values)
        lr.train_reference(values, True)
    else:
        values = rm.job_values(pair, pair.source, os.path.join(work, "other"), args.cache_dir)
        other = prepare(values)
        rm.run(lr.train_case_on_rank, pair.source.world_size, values, True, timeout=timeout)
    values = rm.single_process_values(pair, os.path.join(work, "one"), args.cache_dir)
    one = prepare(values)
    lr.train_reference(values, True)
    return other, one
