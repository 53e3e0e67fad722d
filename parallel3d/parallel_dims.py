"""``ParallelDims``: the parallel degrees of a job (``parallel.tp/pp/dp/cp/ep/etp``), its rank
order and sequence parallelism, validated; the one place that builds the job's ``Topology``.

The dense grid is tp x cp x dp x pp = the world (``dp = "auto"`` is what is left of the
world: world / (tp * cp * pp)); routed experts use etp x ep x edp x pp over the same ranks
(``ep`` x ``etp`` fold over tp x cp x dp; the topology refuses a fold that does not divide).
How a cp group communicates is ``context_parallel.options.ContextParallelOptions``.
Invariant: a constructed ``ParallelDims`` holds valid values; one whose ``dp`` is an integer
(``with_world``) uses exactly its world; errors are ``ConfigError`` naming ``parallel.<key>``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parallel3d.option_checks import ConfigError, check_bool, check_int
from parallel3d.topology import DEFAULT_ORDER, LayoutError, Topology

AUTO = "auto"


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1  # tensor-parallel degree (splits heads / MLP columns)
    pp: int = 1  # pipeline stages
    dp: int | str = AUTO  # data-parallel replicas, or "auto" = world_size / (tp * cp * pp)
    cp: int = 1  # context-parallel degree (splits the sequence; parallel.cp_comm says how)
    ep: int = 1  # expert-parallel degree (splits the routed experts; folds over tp x cp x dp)
    etp: int | None = None  # tensor-parallel degree inside experts; null = tp
    sequence_parallel: bool = False  # shard norm/dropout activations over tp (needs tp > 1)
    order: str = DEFAULT_ORDER  # rank order, fastest-varying first

    def __post_init__(self) -> None:
        for key in ("tp", "pp", "cp", "ep"):
            check_int(f"parallel.{key}", getattr(self, key), 1)
        dp = self.dp
        if isinstance(dp, str) and dp.strip().isdigit():
            object.__setattr__(self, "dp", int(dp))
        if self.dp != AUTO and (isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1):
            raise ConfigError(f"parallel.dp={dp!r}: must be an integer >= 1 or 'auto'")
        if self.etp is not None:
            check_int("parallel.etp", self.etp, 1)
        check_bool("parallel.sequence_parallel", self.sequence_parallel)
        if self.sequence_parallel and self.tp == 1:
            raise ConfigError("parallel.sequence_parallel=true: needs parallel.tp > 1 (with tp=1 it would do nothing)")
        if not isinstance(self.order, str):
            raise ConfigError(f"parallel.order={self.order!r}: must be a string such as {DEFAULT_ORDER!r}")

    # ---- sizes ---------------------------------------------------------------------------
    @property
    def expert_tp(self) -> int:
        """The tensor-parallel degree inside experts (``etp``; null means tp)."""
        return self.tp if self.etp is None else self.etp

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks of one dense model replica: tp * cp * pp."""
        return self.tp * self.cp * self.pp

    @property
    def world_size(self) -> int:
        return self.non_data_parallel_size * self._concrete_dp()

    def with_world(self, world_size: int) -> "ParallelDims":
        """These dims for a job of ``world_size`` ranks: ``dp`` resolved, the product checked."""
        model = self.non_data_parallel_size
        names = "*".join(f"parallel.{k}" for k in self._model_dims())
        values = "*".join(str(getattr(self, k)) for k in self._model_dims())
        if self.dp == AUTO:
            if world_size % model:
                raise ConfigError(f"parallel.dp=auto: world_size={world_size} is not divisible by "
                                  f"{names} = {values} = {model}")
            return replace(self, dp=world_size // model)
        if model * self.dp != world_size:
            short = "*".join([*self._model_dims(), "dp"])
            raise ConfigError(f"parallel.{short} = {values}*{self.dp} = {model * self.dp} but the job has "
                              f"world_size={world_size} processes (use parallel.dp=auto to derive dp)")
        return self

    def _model_dims(self) -> list[str]:
        """The non-dp dense dimensions, as errors name them (cp only once it can be > 1)."""
        return ["tp", *(["cp"] if self.cp > 1 else []), "pp"]

    def _concrete_dp(self) -> int:
        if self.dp == AUTO:
            raise ConfigError("parallel.dp=auto: needs the world size (ParallelDims.with_world)")
        return int(self.dp)

    # ---- which dimensions are in use (torchtitan's style: keeps conditionals readable) ----
    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def dp_enabled(self) -> bool:
        return self._concrete_dp() > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def etp_enabled(self) -> bool:
        return self.expert_tp > 1

    # ---- the topology --------------------------------------------------------------------
    def build_topology(self) -> Topology:
        """The job's rank grid (``with_world`` first: dp must be an integer)."""
        try:
            return Topology(tp=self.tp, cp=self.cp, ep=self.ep, dp=self._concrete_dp(), pp=self.pp, etp=self.etp,
                            order=self.order)
        except LayoutError as exc:
            raise ConfigError(f"parallel.order={self.order!r}: {exc}") from None
