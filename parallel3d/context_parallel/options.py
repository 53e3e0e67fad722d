"""``ContextParallelOptions``: how a cp group moves keys and values (``parallel.cp_comm``,
``parallel.cp_a2a_size``), and the rules between cp, the sequence and the heads.

Invariant: a constructed options object holds an allowed ``cp_comm`` and an a2a size that
is set exactly when ``cp_comm == "a2a+p2p"``; ``check_layout`` refuses (one ``ConfigError``
line naming the key) a sequence that does not split into ``2 * cp`` chunks and heads that an
all-to-all cannot split, before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from parallel3d.context_parallel.attention import CP_COMM_VARIANTS
from parallel3d.context_parallel.ulysses import HeadSplitError, kv_repeats
from parallel3d.option_checks import ConfigError, check_choice, check_int


@dataclass(frozen=True)
class ContextParallelOptions:
    cp_comm: str = "p2p"  # p2p (ring) | allgather | a2a (Ulysses) | a2a+p2p (a2a inside groups, ring across)
    cp_a2a_size: int | None = None  # a2a+p2p: ranks per all-to-all group (must divide parallel.cp)

    def __post_init__(self) -> None:
        check_choice("parallel.cp_comm", self.cp_comm, CP_COMM_VARIANTS)
        if self.cp_a2a_size is not None:
            check_int("parallel.cp_a2a_size", self.cp_a2a_size, 1)
            if self.cp_comm != "a2a+p2p":
                raise ConfigError(f"parallel.cp_a2a_size={self.cp_a2a_size}: only used with parallel.cp_comm=a2a+p2p "
                                  f"(got cp_comm={self.cp_comm})")
        elif self.cp_comm == "a2a+p2p":
            raise ConfigError("parallel.cp_a2a_size=null: parallel.cp_comm=a2a+p2p needs the all-to-all group size "
                              "(a divisor of parallel.cp)")

    def a2a_size(self, cp: int) -> int:
        """Ranks of one all-to-all group: cp for a2a, cp_a2a_size for a2a+p2p, 1 otherwise."""
        return {"a2a": cp, "a2a+p2p": self.cp_a2a_size or 1}.get(self.cp_comm, 1)

    def check_layout(self, *, cp: int, tp: int, seq_len: int, num_heads: int, num_kv_heads: int,
                     sequence_parallel: bool) -> None:
        """The sequence splits into 2*cp load-balanced chunks (each then over tp with sequence
        parallel), and each tp rank's heads split over the all-to-all group."""
        if cp == 1:
            return
        if self.cp_a2a_size is not None and cp % self.cp_a2a_size:
            raise ConfigError(f"parallel.cp_a2a_size={self.cp_a2a_size}: must divide parallel.cp={cp}")
        split = 2 * cp * (tp if sequence_parallel else 1)
        if seq_len % split:
            also = f", each split over parallel.tp={tp} (sequence parallel)" if sequence_parallel else ""
            raise ConfigError(f"train.seq_len={seq_len}: context parallelism splits the sequence into 2 * parallel.cp "
                              f"= {2 * cp} load-balanced chunks{also}: it must be divisible by {split}")
        a2a = self.a2a_size(cp)
        if a2a > 1:
            try:
                kv_repeats(num_heads // tp, max(num_kv_heads // tp, 1), a2a)
            except HeadSplitError as exc:
                key = "parallel.cp_a2a_size" if self.cp_comm == "a2a+p2p" else "parallel.cp"
                raise ConfigError(f"{key}={self.cp_a2a_size if self.cp_comm == 'a2a+p2p' else cp}: "
                                  f"parallel.cp_comm={self.cp_comm} cannot split the heads "
                                  f"(model.num_heads={num_heads}, kv heads={num_kv_heads}, tp={tp}): {exc}") from None
