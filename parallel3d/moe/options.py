"""The options of one MoE layer: every allowed value and default in one place.

``MoEOptions`` is what ``parallel3d.moe`` reads; the integrator builds it from the
``model.moe`` config keys (expert count, top-k, expert width, shared experts, score
function, normalisation, group-limited routing, capacity, losses, bias) and the kernel
backend. ``validate`` fails on the first bad value with one line naming the option,
the value and what is allowed, before any process group or parameter is created.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from parallel3d.option_checks import check_positive, check_range

SCORE_FUNCTIONS = ("softmax", "sigmoid")
DROP_POLICIES = ("probs", "position")
AUX_LOSS_SCOPES = ("micro_batch", "sequence", "global")
DISPATCHERS = ("alltoall", "allgather")
GEMM_BACKENDS = ("auto", "grouped_mm", "triton", "loop")


class MoEOptionError(ValueError):
    """An MoE option has a value outside its allowed set (the message names both)."""


@dataclass(frozen=True)
class MoEOptions:
    """One MoE layer's routing, experts and load balancing (see ``parallel3d.moe``).

    Routing: ``num_experts`` routed experts, ``top_k`` per token; scores from
    ``score_function``; the top-k weights divided by their sum if ``normalize_topk``,
    then multiplied by ``scaling_factor``. ``num_groups`` > 1 with ``topk_groups``:
    group-limited routing (experts in ``num_groups`` equal groups; a token picks its
    ``topk_groups`` best groups, then top-k inside them). ``bias_update_rate`` > 0
    turns on DeepSeek-V3's aux-loss-free expert bias.
    Capacity: ``capacity_factor`` None is dropless; otherwise each expert keeps at most
    ``ceil(capacity_factor * tokens * top_k / num_experts)`` of a micro-batch's tokens,
    chosen by ``drop_policy``; ``pad_to_capacity`` makes every exchange a fixed size.
    Losses: ``aux_loss_coeff`` (over ``aux_loss_scope``) and ``z_loss_coeff``.
    Experts: SwiGLU FFNs of width ``ffn_hidden``; ``num_shared_experts`` dense SwiGLU FFNs
    of width ``shared_ffn_hidden`` (default ``ffn_hidden`` each) added to every token,
    scaled by a sigmoid gate if ``shared_expert_gate`` (Qwen2-MoE).
    """

    num_experts: int
    top_k: int
    ffn_hidden: int
    score_function: str = "softmax"
    normalize_topk: bool = True
    scaling_factor: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    bias_update_rate: float = 0.0
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    pad_to_capacity: bool = False
    aux_loss_coeff: float = 0.0
    aux_loss_scope: str = "micro_batch"
    z_loss_coeff: float = 0.0
    num_shared_experts: int = 0
    shared_ffn_hidden: int | None = None
    shared_expert_gate: bool = False
    dispatcher: str = "alltoall"
    gemm_backend: str = "auto"

    def __post_init__(self) -> None:
        self.validate()

    @property
    def uses_expert_bias(self) -> bool:
        return self.bias_update_rate > 0

    @property
    def shared_width(self) -> int:
        return self.ffn_hidden if self.shared_ffn_hidden is None else self.shared_ffn_hidden

    def validate(self) -> None:
        _one_of("score_function", self.score_function, SCORE_FUNCTIONS)
        _one_of("drop_policy", self.drop_policy, DROP_POLICIES)
        _one_of("aux_loss_scope", self.aux_loss_scope, AUX_LOSS_SCOPES)
        _one_of("dispatcher", self.dispatcher, DISPATCHERS)
        _one_of("gemm_backend", self.gemm_backend, GEMM_BACKENDS)
        _at_least("num_experts", self.num_experts, 1)
        _at_least("ffn_hidden", self.ffn_hidden, 1)
        _at_least("num_shared_experts", self.num_shared_experts, 0)
        if not 1 <= self.top_k <= self.num_experts:
            raise MoEOptionError(f"moe.top_k={self.top_k}: allowed 1..num_experts ({self.num_experts})")
        _at_least("num_groups", self.num_groups, 1)
        if self.num_experts % self.num_groups:
            raise MoEOptionError(
                f"moe.num_groups={self.num_groups}: must divide num_experts={self.num_experts}")
        if not 1 <= self.topk_groups <= self.num_groups:
            raise MoEOptionError(f"moe.topk_groups={self.topk_groups}: allowed 1..num_groups ({self.num_groups})")
        if self.num_groups > 1 and self.topk_groups * self.num_experts // self.num_groups < self.top_k:
            raise MoEOptionError(
                f"moe.topk_groups={self.topk_groups}: the chosen groups hold "
                f"{self.topk_groups * self.num_experts // self.num_groups} experts, fewer than top_k={self.top_k}")
        # Finite only: an infinite capacity overflows ceil() in the router (dropless is None).
        if self.capacity_factor is not None:
            check_positive("moe.capacity_factor", self.capacity_factor, error=MoEOptionError,
                           also=", or None (dropless)")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise MoEOptionError("moe.pad_to_capacity=True: needs a capacity_factor (dropless has no capacity)")
        for name in ("aux_loss_coeff", "z_loss_coeff", "bias_update_rate"):
            check_range(f"moe.{name}", getattr(self, name), 0, error=MoEOptionError)
        if self.shared_ffn_hidden is not None:
            _at_least("shared_ffn_hidden", self.shared_ffn_hidden, 1)
        if self.shared_expert_gate and self.num_shared_experts == 0:
            raise MoEOptionError("moe.shared_expert_gate=True: needs num_shared_experts >= 1")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise MoEOptionError(f"moe.{name}={value!r}: allowed {', '.join(allowed)}")


def _at_least(name: str, value: int, low: int) -> None:
    if not isinstance(value, int) or value < low:
        raise MoEOptionError(f"moe.{name}={value!r}: allowed an integer >= {low}")
