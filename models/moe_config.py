"""The ``model.moe`` section: which layers are mixtures of experts and their ``MoEOptions``.

``num_experts = 0`` is a dense model (the default). Otherwise global layer ``i`` is an MoE layer
unless it is dense: ``i < dense_first`` (DeepSeek's first-k dense layers), or, with
``dense_every = n > 0``, ``(i + 1) % n == 0`` (every n-th layer, counted from 1), or ``i`` is
listed in ``dense_layers`` (Qwen2/3-MoE's ``mlp_only_layers``: any set of indices). An MoE layer's
MLP is ``parallel3d.moe.MoELayer`` with ``options(model ffn width)``; dense layers keep the
model's MLP. Every value is checked by ``MoEOptions.validate`` (one line naming ``moe.<key>``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parallel3d.moe.options import MoEOptionError, MoEOptions
from parallel3d.option_checks import check_positive

# MoEOptions fields whose config key under model.moe has another name.
OPTION_KEYS = {"ffn_hidden": "ffn_hidden_size", "shared_ffn_hidden": "shared_ffn_hidden_size"}


@dataclass(frozen=True)
class MoEConfig:
    """The config keys under ``model.moe`` (``parallel3d.moe.options`` documents each option)."""

    num_experts: int = 0  # routed experts; 0: a dense model
    top_k: int = 2
    ffn_hidden_size: int | None = None  # each routed expert's width; None: model.ffn_hidden_size
    num_shared_experts: int = 0
    shared_ffn_hidden_size: int | None = None  # each shared expert's width; None: the routed width
    shared_expert_gate: bool = False  # scale the shared experts' output by sigmoid(x @ gate) per token (Qwen2-MoE)
    dense_first: int = 0  # the first k layers are dense
    dense_every: int = 0  # n > 0: layers n, 2n, ... (1-based) are dense
    dense_layers: tuple[int, ...] = ()  # these global layer indices are dense too
    score_function: str = "softmax"  # softmax | sigmoid
    normalize_topk: bool = True
    scaling_factor: float = 1.0  # the routing weights' factor (DeepSeek-V3's routed_scaling_factor 2.5)
    num_groups: int = 1  # group-limited routing (DeepSeek-V3): groups of experts ...
    topk_groups: int = 1  # ... of which a token may use this many
    bias_update_rate: float = 0.0  # > 0: aux-loss-free expert bias (updated once per optimizer step)
    aux_loss_coeff: float = 0.0
    aux_loss_scope: str = "micro_batch"  # micro_batch | sequence | global (global depends on the layout)
    z_loss_coeff: float = 0.0
    capacity_factor: float | None = None  # None: dropless
    drop_policy: str = "probs"  # probs | position
    dispatcher: str = "alltoall"  # alltoall | allgather
    pad_to_capacity: bool = False  # every all-to-all a fixed size (needs capacity_factor and dispatcher alltoall)

    def __post_init__(self) -> None:
        if isinstance(self.dense_layers, (list, tuple)):  # a YAML list: hashable and comparable
            object.__setattr__(self, "dense_layers", tuple(self.dense_layers))

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, index: int) -> bool:
        """Global layer ``index`` is an MoE layer (module docstring)."""
        if not self.enabled or index < self.dense_first or index in self.dense_layers:
            return False
        return not (self.dense_every > 0 and (index + 1) % self.dense_every == 0)

    def options(self, ffn_size: int) -> MoEOptions:
        """The layers' ``MoEOptions`` (``ffn_size``: the model's dense width, the default expert width)."""
        return MoEOptions(
            num_experts=self.num_experts, top_k=self.top_k,
            ffn_hidden=ffn_size if self.ffn_hidden_size is None else self.ffn_hidden_size,
            score_function=self.score_function, normalize_topk=self.normalize_topk,
            scaling_factor=self.scaling_factor, num_groups=self.num_groups,
            topk_groups=self.topk_groups, bias_update_rate=self.bias_update_rate,
            capacity_factor=self.capacity_factor, drop_policy=self.drop_policy, aux_loss_coeff=self.aux_loss_coeff,
            aux_loss_scope=self.aux_loss_scope, z_loss_coeff=self.z_loss_coeff,
            num_shared_experts=self.num_shared_experts, shared_ffn_hidden=self.shared_ffn_hidden_size,
            shared_expert_gate=self.shared_expert_gate, dispatcher=self.dispatcher,
            pad_to_capacity=self.pad_to_capacity)

    def validate(self, num_layers: int, ffn_size: int) -> None:
        """Raise ValueError naming the key (``moe.<key>``) and what is allowed."""
        for key in ("num_experts", "dense_first", "dense_every"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"model.moe.{key}={value!r}: allowed an integer >= 0")
        layers = self.dense_layers
        if not isinstance(layers, tuple) or any(
                isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in layers):
            shown = list(layers) if isinstance(layers, tuple) else repr(layers)
            raise ValueError(f"model.moe.dense_layers={shown}: allowed a list of layer indices in [0, {num_layers})")
        check_positive("model.moe.scaling_factor", self.scaling_factor, error=ValueError)
        # The other keys are checked on a dense model too (with a stand-in expert count): a typo is an error.
        checked = self if self.enabled else replace(self, num_experts=max(1, self.top_k, self.num_groups))
        try:
            checked.options(ffn_size)
        except MoEOptionError as exc:  # "moe.<option>=...": name the config key instead
            message = str(exc)
            for option, key in OPTION_KEYS.items():
                message = message.replace(f"moe.{option}=", f"moe.{key}=")
            raise ValueError(f"model.{message}") from None
        if not self.enabled:
            return
        if not any(self.is_moe_layer(i) for i in range(num_layers)):
            raise ValueError(f"model.moe.dense_first={self.dense_first}, dense_every={self.dense_every}, "
                             f"dense_layers={list(self.dense_layers)}: "
                             f"every one of the {num_layers} layers is dense; allowed: at least one MoE layer")
