"""scripts/estimate_memory.py and scripts/plan.py: Hydra composition, output, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from models import get_config
from parallel3d.config import ConfigError
from parallel3d.planning.cli import register_planning_schema, run_estimate, run_plan, split_device_mem_flag
from parallel3d.planning.layout import Layout
from parallel3d.planning.memory import estimate_memory

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"


def _job(config_name: str, overrides: list[str]):
    register_planning_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name=config_name, overrides=overrides)
    return OmegaConf.to_object(cfg)


def _groups(path: Path) -> list[str]:
    entries = yaml.safe_load(path.read_text())["defaults"]
    return sorted(next(iter(e)) for e in entries if isinstance(e, dict) and not next(iter(e)).startswith("override"))


@pytest.mark.parametrize("name", ["plan.yaml", "estimate.yaml"])
def test_planning_configs_compose_every_training_group(name):
    assert set(_groups(CONF / "config.yaml")) <= set(_groups(CONF / name))


def test_estimate_output_is_the_estimators_worst_rank():
    job = _job("estimate", ["model=llama3_70b", "parallel.tp=8", "parallel.pp=4", "cluster.gpus=256",
                            "train.seq_len=4096", "train.recompute=full", "parallel.zero_stage=2",
                            "cluster.device_mem=40GB"])
    text = run_estimate(job)
    layout = Layout(tp=8, pp=4, dp=8, zero_stage=2, sequence_parallel=True, micro_batch_size=1, seq_len=4096,
                    global_batch_size=1536, recompute="full", precision="bf16")
    expected = estimate_memory(get_config("llama3_70b"), layout).worst
    assert f"pipeline stage {expected.stage}" in text
    assert f"{expected.total / 2**30:.2f} GiB of 37.25 GiB" in text
    assert ("DOES NOT FIT" in text) == (expected.total > 40e9)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.tp=5"], "parallel.tp"),
    (["model=llama3_70b", "parallel.tp=16", "parallel.pp=1"], "num_kv_heads"),
    (["train.seq_len=4096"], "max_seq_len"),
    (["train.global_batch_size=100"], "train.global_batch_size"),
])
def test_estimate_rejects_bad_values_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_estimate(_job("estimate", overrides))


def test_unknown_cluster_key_is_rejected_while_composing():
    with pytest.raises(ConfigCompositionException):
        _job("plan", ["cluster.gpu_count=8"])


def test_plan_prints_ranked_layouts_and_writes_json(tmp_path):
    out = tmp_path / "plan.json"
    job = _job("plan", ["model=llama3_8b", "cluster.gpus=16", "train.global_batch_size=64",
                        "train.seq_len=4096", "plan.top_k=3", f"plan.json={out}"])
    text = run_plan(job)
    assert "best as overrides: parallel.tp=" in text
    ranked = json.loads(out.read_text())["layouts"]
    assert 1 <= len(ranked) <= 3
    assert [r["step_time_s"] for r in ranked] == sorted(r["step_time_s"] for r in ranked)
    assert all(r["tp"] * r["cp"] * r["pp"] * r["dp"] == 16 for r in ranked)
    # Issue 26: stage layer counts, memory by category and a why-it-loses line per layout.
    assert all(sum(r["stage_layers"]) == 32 and len(r["stage_layers"]) == r["pp"] for r in ranked)
    assert all(sum(r["memory_bytes"].values()) <= r["peak_bytes"] for r in ranked)
    assert all(r["tokens_per_s"] == pytest.approx(64 * 4096 / r["step_time_s"]) for r in ranked)
    assert text.count("next loses: +") == len(ranked) - 1


def test_device_mem_flag_becomes_an_override():
    assert split_device_mem_flag(["model=x", "--device-mem", "80GB"]) == ["model=x", "cluster.device_mem=80GB"]
    assert split_device_mem_flag(["--device-mem=141GB"]) == ["cluster.device_mem=141GB"]


@pytest.mark.slow
def test_estimate_memory_script_runs_from_the_readme_example():
    cmd = [sys.executable, str(REPO / "scripts" / "estimate_memory.py"), "model=gpt3_175b", "parallel.tp=8",
           "parallel.pp=16", "--device-mem", "80GB"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "FITS: peak" in out.stdout and "optimizer_moments" in out.stdout
