"""One rank's messages per training step, by group kind and op: count and bytes.

Measured from the dry run's step (``dryrun.step``): every call through ``comm`` (collectives
and p2p sends) counted by ``CommStats`` in ``comm``'s byte convention (bytes this rank sends
under the ring algorithm: all-reduce 2N(n-1)/n, reduce-scatter and all-gather N(n-1)/n, a send
N), so a real run's ``pstate.comm_stats`` over one step is the reference.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Messages:
    """Collectives (or p2p sends) and their bytes, per step, on one group kind and op."""

    kind: str  # "<group kind> <op>", e.g. "dp_cp reduce_scatter", "pp send"
    count: int
    bytes: int
    how: str  # where the numbers come from: "step"
