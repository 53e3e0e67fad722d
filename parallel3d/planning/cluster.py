"""Hardware descriptions for the planner: devices, nodes, links.

Numbers are vendor datasheet figures (dense bf16 peak, HBM and link
bandwidth) plus *achievable fractions* that say how much of a peak real
kernels and NCCL reach; the fractions are the cost model's only tuning knobs
and are documented where they are set. Nodes hold consecutive ranks
(``rank // gpus_per_node``), which is how torchrun/srun number them; which
ranks form a group is still asked of ``Topology``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

GiB = 2**30


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: float
    peak_flops: float  # dense bf16/fp16 tensor-core FLOP/s
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float  # per GPU, one direction (NVLink)
    inter_node_bytes_per_s: float  # per GPU, one direction (its own NIC)
    # Fraction of peak that the model's large matmuls reach on average. 0.65
    # reproduces the per-GPU throughput Megatron-LM reports on A100 (Narayanan
    # et al. 2021, Table 1) once memory-bound ops, communication and the
    # pipeline bubble are charged separately; see tests/test_planning_published.py.
    matmul_efficiency: float = 0.65
    # Fraction of link bandwidth NCCL collectives and P2P reach.
    link_efficiency: float = 0.8
    # Optimizer offload (parallel.offload), per GPU: its share of the host link (PCIe Gen4 x16
    # ~25 GB/s achieved on A100 nodes, Gen5 ~50 GB/s on H100/H200), of the host's AdamW
    # throughput (a fused CPU AdamW streams ~28 bytes per element; ~1e9 elements/s per GPU is a
    # node's memory bandwidth shared by 8 GPUs) and of local NVMe (~2 GB/s per GPU).
    host_link_bytes_per_s: float = 25e9
    host_adam_elements_per_s: float = 1e9
    disk_bytes_per_s: float = 2e9


DEVICES: dict[str, DeviceSpec] = {
    # DGX A100 (Selene): NVLink3 600 GB/s bidirectional, 8x HDR 200 Gb/s NICs per node.
    "a100_80gb": DeviceSpec("a100_80gb", 80 * GiB, 312e12, 2.039e12, 300e9, 25e9),
    "a100_40gb": DeviceSpec("a100_40gb", 40 * GiB, 312e12, 1.555e12, 300e9, 25e9),
    # DGX H100 / H200: NVLink4 900 GB/s bidirectional, 8x NDR 400 Gb/s NICs per node.
    "h100_80gb": DeviceSpec("h100_80gb", 80 * GiB, 989e12, 3.35e12, 450e9, 50e9, host_link_bytes_per_s=50e9),
    "h200_141gb": DeviceSpec("h200_141gb", 140 * GiB, 989e12, 4.8e12, 450e9, 50e9, host_link_bytes_per_s=50e9),
}


def get_device(name: str) -> DeviceSpec:
    if name not in DEVICES:
        raise ValueError(f"cluster.device={name!r} is not one of {sorted(DEVICES)}")
    return DEVICES[name]


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": GiB, "tib": 2**40}


def parse_bytes(text: str | int | float, key: str = "device_mem") -> float:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, 1e9 -> 1e9. SI units are decimal, *iB binary."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"{key}={text!r} must be > 0")
        return float(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"{key}={text!r} is not a size like '80GB', '80GiB' or a number of bytes")
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value <= 0:
        raise ValueError(f"{key}={text!r} must be > 0")
    return value


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
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise ValueError(f"cluster.{key}={value!r} must be a number > 0")
                changes[field] = float(value) * scale
        return cls(gpus=gpus, gpus_per_node=gpus_per_node, device=replace(spec, **changes) if changes else spec)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def nodes_spanned(self, ranks: list[int]) -> tuple[int, int]:
        """(nodes the group touches, most members on one node)."""
        per_node: dict[int, int] = {}
        for r in ranks:
            per_node[self.node_of(r)] = per_node.get(self.node_of(r), 0) + 1
        return len(per_node), max(per_node.values())
