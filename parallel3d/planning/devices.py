"""The device catalogue: one YAML file per accelerator in ``conf/cluster/devices/``.

Each file holds datasheet facts (dense bf16/fp16 and fp8 peak, HBM size and
bandwidth, per-GPU NVLink/Infinity Fabric and NIC bandwidth, GPUs per node, SMs or CUs) and
the sources they came from; a new device is a new file, named after its ``name``
key. ``DeviceSpec`` also carries the cost model's achievable fractions
(``matmul_efficiency`` with its shape knee ``gemm_knee``, ``attention_efficiency``,
``link_efficiency``), the fixed ``layer_overhead_us`` and the offload throughputs, which are
modelling assumptions rather than datasheet facts (the compute ones fitted by
``python -m parallel3d.planning.fit`` on calibration rows only): files may set them, and the
defaults below apply otherwise.

Invariant: every value is validated when the file is read; an unknown or missing
key, or a bad value, is one error naming the file, the key and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping

import yaml

from parallel3d.option_checks import check_positive
from parallel3d.planning.sizes import GiB, parse_bytes

DEVICE_DIR = Path(__file__).resolve().parents[2] / "conf" / "cluster" / "devices"


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    memory_bytes: float
    peak_flops: float  # dense bf16/fp16 tensor-core FLOP/s
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float  # per GPU, one direction (NVLink / Infinity Fabric)
    inter_node_bytes_per_s: float  # per GPU, one direction (its own NIC)
    # Fraction of peak that the model's large matmuls reach on average. 0.65
    # reproduces the per-GPU throughput Megatron-LM reports on A100 (Narayanan
    # et al. 2021, Table 1) once memory-bound ops, communication and the
    # pipeline bubble are charged separately; see tests/test_planning_published.py.
    matmul_efficiency: float = 0.65
    # Shape size x = 1/(1/m + 1/n + 1/k) of a per-rank GEMM at which it reaches half of
    # ``matmul_efficiency`` (``parallel3d.planning.gemm``); 0 keeps one constant efficiency.
    gemm_knee: float = 0.0
    # What fused (flash) attention kernels reach on the same shape curve, instead of
    # ``matmul_efficiency`` (their softmax and rescaling share the SMs with the GEMMs); None: the
    # GEMMs' own. Fitted on the calibration rows (``python -m parallel3d.planning.fit``).
    attention_efficiency: float | None = None
    # Fixed time of one transformer layer's forward (its backward: twice), whatever its size: the
    # launch gaps and host work between its ~tens of kernels, which a small layer cannot hide behind
    # its GEMMs. Fitted on the calibration rows; 0 adds nothing.
    layer_overhead_s: float = 0.0
    # Fraction of link bandwidth NCCL collectives and P2P reach.
    link_efficiency: float = 0.8
    # Optimizer offload (parallel.offload), per GPU: its share of the host link (PCIe Gen4 x16
    # ~25 GB/s achieved on A100 nodes, Gen5 ~50 GB/s on H100/H200), of the host's AdamW
    # throughput (a fused CPU AdamW streams ~28 bytes per element; ~1e9 elements/s per GPU is a
    # node's memory bandwidth shared by 8 GPUs) and of local NVMe (~2 GB/s per GPU).
    host_link_bytes_per_s: float = 25e9
    host_adam_elements_per_s: float = 1e9
    disk_bytes_per_s: float = 2e9
    peak_fp8_flops: float | None = None  # dense fp8 tensor-core FLOP/s; None: no fp8 units
    gpus_per_node: int = 8  # GPUs sharing the fast intra-node fabric (the NVLink domain)
    # Streaming multiprocessors (NVIDIA) / compute units (AMD): what a communication kernel's share of
    # the GPU is counted in (``planning.tp_overlap``); None only for a spec built in code without it.
    compute_units: int | None = None
    vendor: str = ""
    sources: tuple[str, ...] = ()


# YAML key -> (DeviceSpec field, scale to SI units); None scale means "parse as a size".
_NUMBER_KEYS: dict[str, tuple[str, float | None]] = {
    "memory": ("memory_bytes", None),
    "peak_tflops": ("peak_flops", 1e12),
    "hbm_gbps": ("hbm_bytes_per_s", 1e9),
    "intra_node_gbps": ("intra_node_bytes_per_s", 1e9),
    "inter_node_gbps": ("inter_node_bytes_per_s", 1e9),
    "host_link_gbps": ("host_link_bytes_per_s", 1e9),
    "disk_gbps": ("disk_bytes_per_s", 1e9),
    "host_adam_elements_per_s": ("host_adam_elements_per_s", 1.0),
    "matmul_efficiency": ("matmul_efficiency", 1.0),
    "gemm_knee": ("gemm_knee", 1.0),
    "attention_efficiency": ("attention_efficiency", 1.0),
    "layer_overhead_us": ("layer_overhead_s", 1e-6),
    "link_efficiency": ("link_efficiency", 1.0),
    "peak_fp8_tflops": ("peak_fp8_flops", 1e12),
}
_REQUIRED = ("name", "vendor", "memory", "peak_tflops", "hbm_gbps", "intra_node_gbps", "inter_node_gbps",
             "gpus_per_node", "compute_units", "sources")
_FRACTIONS = ("matmul_efficiency", "attention_efficiency", "link_efficiency")
_ALLOWED = set(_NUMBER_KEYS) | set(_REQUIRED)


def device_from_dict(data: Mapping[str, Any], where: str = "device") -> DeviceSpec:
    """A ``DeviceSpec`` from one catalogue entry (the YAML mapping), validated."""
    if not isinstance(data, Mapping):
        raise ValueError(f"{where}: expected a mapping of device keys, got {type(data).__name__}")
    unknown = sorted(set(data) - _ALLOWED)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(_ALLOWED)}")
    missing = [key for key in _REQUIRED if key not in data]
    if missing:
        raise ValueError(f"{where}: missing key(s) {missing}")
    name = data["name"]
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: name={name!r} must be a non-empty string")
    sources = data["sources"]
    if not isinstance(sources, list) or not sources or not all(isinstance(s, str) and s for s in sources):
        raise ValueError(f"{where}: sources must be a non-empty list of strings (where the numbers come from)")
    node = data["gpus_per_node"]
    if isinstance(node, bool) or not isinstance(node, int) or node < 1:
        raise ValueError(f"{where}: gpus_per_node={node!r} must be an integer >= 1")
    units = data["compute_units"]
    if isinstance(units, bool) or not isinstance(units, int) or units < 1:
        raise ValueError(f"{where}: compute_units={units!r} must be an integer >= 1 (SMs or CUs per GPU)")
    values: dict[str, Any] = {"name": name, "vendor": str(data["vendor"]), "gpus_per_node": node,
                              "compute_units": units, "sources": tuple(sources)}
    for key, (field, scale) in _NUMBER_KEYS.items():
        if key not in data or (key == "peak_fp8_tflops" and data[key] is None):
            continue
        if scale is None:
            values[field] = parse_bytes(data[key], f"{where}: {key}")
        else:
            values[field] = check_positive(f"{where}: {key}", data[key], error=ValueError) * scale  # .nan, .inf
        if key in _FRACTIONS and values[field] > 1:
            raise ValueError(f"{where}: {key}={data[key]!r} must be a fraction in (0, 1]")
    return DeviceSpec(**values)


def load_device_file(path: Path | str) -> DeviceSpec:
    """One device YAML file; its ``name`` must equal the file's stem."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ValueError(f"device file {path}: cannot be read ({exc})") from exc
    spec = device_from_dict(data, where=f"device file {path}")
    if spec.name != path.stem:
        raise ValueError(f"device file {path}: name={spec.name!r} must equal the file name {path.stem!r}")
    return spec


def load_device_catalogue(directory: Path | str = DEVICE_DIR) -> Mapping[str, DeviceSpec]:
    """Every ``*.yaml`` in ``directory`` by name (read-only)."""
    paths = sorted(Path(directory).glob("*.yaml"))
    if not paths:
        raise ValueError(f"device catalogue {directory}: no *.yaml device files")
    return MappingProxyType({path.stem: load_device_file(path) for path in paths})


DEVICES: Mapping[str, DeviceSpec] = load_device_catalogue()


def get_device(name: str) -> DeviceSpec:
    """A catalogue device by name, or a device YAML file given by path (``*.yaml``)."""
    if name.endswith((".yaml", ".yml")):
        return load_device_file(name)
    if name not in DEVICES:
        raise ValueError(f"cluster.device={name!r} is not one of {sorted(DEVICES)} (or a path to a device .yaml)")
    return DEVICES[name]


__all__ = ["DEVICES", "DEVICE_DIR", "DeviceSpec", "GiB", "device_from_dict", "get_device", "load_device_catalogue",
           "load_device_file"]
