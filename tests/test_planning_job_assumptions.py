"""``scripts/estimate_memory.py`` (``planning.cli.run_estimate``) prices the job's activations with the planner's own
``planner.job_assumptions`` (session 46 review, item 3: it restated them), for each ``plan.kernels`` profile and
``data.document_mask``. Reference: ``ActivationAssumptions.for_model`` (the activation profile itself) with the
mask's tensors, through ``estimate_memory``."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from parallel3d.planning.activations import ActivationAssumptions
from parallel3d.planning.cli import (cluster_from, format_memory, job_estimate, layout_from_job, register_planning_schema,
                                     run_estimate)
from parallel3d.planning.memory import estimate_memory
from parallel3d.planning.planner import job_assumptions
from tests.test_planning_cli import CONF

CASES = list(itertools.product(("fused", "torch"), (False, True)))


def _job(kernels: str, document_mask: bool):
    register_planning_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        cfg = compose(config_name="estimate", overrides=[
            "model=llama3_8b", "cluster.gpus=8", "parallel.tp=2", "parallel.pp=2", "train.seq_len=4096",
            "train.global_batch_size=64", "train.recompute=none", f"plan.kernels={kernels}", f"data.document_mask={str(document_mask).lower()}",
            "data.tokenizer_file=null"])
    return OmegaConf.to_object(cfg)


@pytest.fixture(scope="module")
def jobs() -> dict:
    """Each case's composed job, once (Hydra's compose is the cost here)."""
    return {case: _job(*case) for case in CASES}


@pytest.mark.parametrize("kernels,document_mask", CASES, ids=[f"{k}-mask{int(m)}" for k, m in CASES])
def test_the_estimate_prices_the_planners_assumptions(jobs, kernels, document_mask):
    job = jobs[kernels, document_mask]
    model, layout, stage_layers = layout_from_job(job, cluster_from(job.cluster))
    profile = dataclasses.replace(ActivationAssumptions.for_model(model, layout.precision, kernels=kernels),
                                  document_ids=document_mask)
    assert job_assumptions(model, layout.precision, document_mask, kernels) == profile
    expected = estimate_memory(model, layout, profile, stage_layers=stage_layers)
    assert job_estimate(job) == expected
    assert run_estimate(job) == format_memory(expected, cluster_from(job.cluster).device.memory_bytes)


def test_the_profiles_differ_so_the_cases_above_can_tell_them_apart(jobs):
    """The four cases' worst ranks all differ (the mask's tensors are a few KiB: below the printed GiB)."""
    totals = {case: job_estimate(job).worst.total for case, job in jobs.items()}
    assert len(set(totals.values())) == len(CASES), totals
