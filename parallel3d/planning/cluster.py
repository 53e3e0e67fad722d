"""Hardware descriptions for the planner: devices, nodes, links.

Devices come from the catalogue (``parallel3d.planning.devices``: one YAML file per
device in ``conf/cluster/devices/``) and hold datasheet figures (dense bf16 peak,
HBM and link bandwidth) plus *achievable fractions* that say how much of a peak real
kernels and NCCL reach; the fractions are the cost model's only tuning knobs. Nodes
hold consecutive ranks (``rank // gpus_per_node``), which is how torchrun/srun number
them; the cluster's ``gpus_per_node`` decides placement (a device's own
``gpus_per_node`` is its typical node, for reference). Which ranks form a group is
still asked of ``Topology``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from parallel3d.option_checks import check_positive
from parallel3d.planning.devices import DEVICES, DeviceSpec, get_device
from parallel3d.planning.sizes import GiB, parse_bytes


@dataclass(frozen=True)
class ClusterSpec:
    """A homogeneous cluster: ``gpus`` devices, ``gpus_per_node`` per node."""

    gpus: int = 1024
    gpus_per_node: int = 8
    device: DeviceSpec = DEVICES["a100_80gb"]

    def __post_init__(self) -> None:
        for key in ("gpus", "gpus_per_node"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cluster.{key}={value!r} must be an integer >= 1")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(
                f"cluster.gpus={self.gpus} is not a multiple of cluster.gpus_per_node={self.gpus_per_node}"
            )

    @classmethod
    def build(
        cls,
        gpus: int = 1024,
        gpus_per_node: int = 8,
        device: str = "a100_80gb",
        *,
        device_mem: str | float | None = None,
        peak_tflops: float | None = None,
        intra_node_gbps: float | None = None,
        inter_node_gbps: float | None = None,
    ) -> "ClusterSpec":
        """A cluster from a named device, with optional overrides (bandwidths in GB/s per GPU)."""
        spec = get_device(device)
        changes: dict = {}
        if device_mem is not None:
            changes["memory_bytes"] = parse_bytes(device_mem, "cluster.device_mem")
        for key, value, field, scale in (
            ("peak_tflops", peak_tflops, "peak_flops", 1e12),
            ("intra_node_gbps", intra_node_gbps, "intra_node_bytes_per_s", 1e9),
            ("inter_node_gbps", inter_node_gbps, "inter_node_bytes_per_s", 1e9),
        ):
            if value is not None:
                changes[field] = check_positive(f"cluster.{key}", value, error=ValueError) * scale
        return cls(gpus=gpus, gpus_per_node=gpus_per_node, device=replace(spec, **changes) if changes else spec)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def nodes_spanned(self, ranks: list[int]) -> tuple[int, int]:
        """(nodes the group touches, most members on one node)."""
        per_node: dict[int, int] = {}
        for r in ranks:
            per_node[self.node_of(r)] = per_node.get(self.node_of(r), 0) + 1
        return len(per_node), max(per_node.values())


__all__ = ["DEVICES", "ClusterSpec", "DeviceSpec", "GiB", "get_device", "parse_bytes"]
