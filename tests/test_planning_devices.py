"""The device catalogue (conf/cluster/devices/*.yaml) that the planner's ClusterSpec is built from."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from parallel3d.planning.cli import ClusterConfig, cluster_from
from parallel3d.planning.cluster import DEVICES, ClusterSpec, get_device
from parallel3d.planning.devices import (
    DEVICE_DIR,
    DeviceSpec,
    device_from_dict,
    load_device_catalogue,
    load_device_file,
)

GiB = 2**30
DEVICE_FILES = sorted(DEVICE_DIR.glob("*.yaml"))
CLUSTER_FILES = sorted((DEVICE_DIR.parent).glob("*.yaml"))

# What parallel3d/planning/cluster.py served from its Python table before the catalogue
# (commit c176aec): name -> (memory bytes, peak FLOP/s, HBM B/s, NVLink B/s, NIC B/s, host link B/s).
# The cost model's fractions were the DeviceSpec defaults for all of them.
PREVIOUS_TABLE = {
    "a100_80gb": (80 * GiB, 312e12, 2.039e12, 300e9, 25e9, 25e9),
    "a100_40gb": (40 * GiB, 312e12, 1.555e12, 300e9, 25e9, 25e9),
    "h100_80gb": (80 * GiB, 989e12, 3.35e12, 450e9, 50e9, 50e9),
    "h200_141gb": (140 * GiB, 989e12, 4.8e12, 450e9, 50e9, 50e9),
}


@pytest.mark.parametrize("name", sorted(PREVIOUS_TABLE))
def test_catalogue_serves_what_the_python_table_served(name):
    spec = get_device(name)
    served = (spec.memory_bytes, spec.peak_flops, spec.hbm_bytes_per_s, spec.intra_node_bytes_per_s,
              spec.inter_node_bytes_per_s, spec.host_link_bytes_per_s)
    assert served == PREVIOUS_TABLE[name]
    defaults = DeviceSpec("x", 1, 1, 1, 1, 1)
    # matmul_efficiency and gemm_knee are now set per device (the GEMM-shape curve, calibrated on the
    # calibration rows of published_runs.yaml); the other modelling knobs are still the defaults.
    for knob in ("link_efficiency", "host_adam_elements_per_s", "disk_bytes_per_s"):
        assert getattr(spec, knob) == getattr(defaults, knob), knob


def test_catalogue_covers_the_issue_devices():
    for prefix in ("a100_40gb", "a100_80gb", "h100", "h200", "b200", "mi300x"):
        assert any(name.startswith(prefix) for name in DEVICES), prefix


@pytest.mark.parametrize("path", DEVICE_FILES, ids=[p.stem for p in DEVICE_FILES])
def test_every_device_file_is_a_plausible_accelerator(path):
    spec = load_device_file(path)
    assert spec.name == path.stem and DEVICES[spec.name] == spec
    assert spec.sources and all(len(s) > 20 for s in spec.sources)
    assert 16 * GiB <= spec.memory_bytes <= 512 * GiB
    assert 100e12 <= spec.peak_flops <= 10e15
    if spec.peak_fp8_flops is not None:  # fp8 tensor cores run at twice the 16-bit rate on every such part
        assert spec.peak_fp8_flops == pytest.approx(2 * spec.peak_flops, rel=0.01)
    # The node's fabric is faster than its NIC, and HBM faster than both.
    assert spec.hbm_bytes_per_s > spec.intra_node_bytes_per_s > spec.inter_node_bytes_per_s > 0
    # A roofline sanity check: every listed accelerator needs 50-600 FLOPs per HBM byte to be compute bound.
    assert 50 <= spec.peak_flops / spec.hbm_bytes_per_s <= 600


def _valid_entry() -> dict:
    return yaml.safe_load((DEVICE_DIR / "h100_80gb.yaml").read_text())


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d.update(peak_tflopz=989), ["peak_tflopz", "unknown"]),
    (lambda d: d.pop("hbm_gbps"), ["hbm_gbps", "missing"]),
    (lambda d: d.update(peak_tflops=-1), ["peak_tflops", "> 0"]),
    (lambda d: d.update(memory="80 gigs"), ["memory"]),
    (lambda d: d.update(gpus_per_node=0), ["gpus_per_node"]),
    (lambda d: d.pop("compute_units"), ["compute_units", "missing"]),
    (lambda d: d.update(compute_units=13.5), ["compute_units", "integer"]),
    (lambda d: d.update(sources=[]), ["sources"]),
    (lambda d: d.update(link_efficiency=1.5), ["link_efficiency", "fraction"]),
    (lambda d: d.update(name=""), ["name"]),
])
def test_a_bad_entry_is_one_error_naming_file_and_key(mutate, words):
    entry = _valid_entry()
    mutate(entry)
    with pytest.raises(ValueError) as err:
        device_from_dict(entry, where="device file x.yaml")
    assert "x.yaml" in str(err.value) and all(w in str(err.value) for w in words)


def test_file_name_must_match_device_name(tmp_path):
    entry = _valid_entry()
    path = tmp_path / "h100_renamed.yaml"
    path.write_text(yaml.safe_dump(entry))
    with pytest.raises(ValueError, match="h100_renamed"):
        load_device_file(path)


def test_a_new_device_is_one_yaml_file(tmp_path):
    entry = dict(_valid_entry(), name="h100_derated", peak_tflops=700, memory="64GiB", matmul_efficiency=0.5)
    path = tmp_path / "h100_derated.yaml"
    path.write_text(yaml.safe_dump(entry))
    cluster = ClusterSpec.build(16, 8, str(path))
    assert cluster.device.peak_flops == 700e12 and cluster.device.memory_bytes == 64 * GiB
    assert cluster.device.matmul_efficiency == 0.5
    catalogue = load_device_catalogue(tmp_path)
    assert list(catalogue) == ["h100_derated"] and catalogue["h100_derated"] == cluster.device
    # The planning CLI takes it through the same key.
    assert cluster_from(ClusterConfig(gpus=16, device=str(path))).device == cluster.device


def test_unknown_device_names_the_catalogue():
    with pytest.raises(ValueError, match="mi300x_192gb"):
        get_device("tpu_v9")


@pytest.mark.parametrize("path", CLUSTER_FILES, ids=[p.stem for p in CLUSTER_FILES])
def test_existing_cluster_yamls_still_build(path):
    cfg = yaml.safe_load(path.read_text())
    cluster = cluster_from(ClusterConfig(**cfg))
    assert cluster.device == DEVICES[cfg["device"]]


def test_overrides_still_apply_on_catalogue_devices():
    cluster = ClusterSpec.build(64, 8, "b200_180gb", device_mem="96GB", inter_node_gbps=100)
    assert cluster.device == replace(DEVICES["b200_180gb"], memory_bytes=96e9, inter_node_bytes_per_s=100e9)
