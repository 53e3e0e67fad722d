"""The planner's activation estimate against the dry run where positions and norms keep small tensors.

Per microbatch and chunk: the rotary tables (``planning.position_bytes``: the fused kernel keeps the fp32 tables
once, the torch reference its 16-bit casts in every layer), with ``data.document_mask`` one row of them (and of
GPT's learned positions) per sequence, and the torch RMSNorm's fp32 weight copies of a 16-bit model. Tiny shapes,
where these are percents of a peak (fuzz case 3029: -6.1% before), drawn over the model, precision, kernels,
recompute and the document mask; the dry run (meta tensors, the engine's saved-tensor count) is the reference.
And ``scripts/plan.py``'s search reads ``data.document_mask``: a masked job's plan counts what the dry run of it holds.
"""

from __future__ import annotations

import itertools
import random

import pytest

from parallel3d.config import resolve
from parallel3d.dryrun import dry_run_rank
from parallel3d.train import compose_job
from tests.test_dryrun_estimator import TOLERANCE

pytestmark = [pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")]


def _draws(seed: int = 51) -> list[tuple[int, list[str]]]:
    """(world, overrides): each (model, precision, kernels) once (``train.device=cpu``: torch ops; ``auto``: the
    fused kernels), recompute, pp, cp and the mask drawn."""
    rng = random.Random(seed)
    out = []
    for model, precision, device in itertools.product(("llama_tiny", "gpt_tiny"), ("bf16", "fp32"), ("cpu", "auto")):
        pp, cp = rng.choice([1, 2]), rng.choice([1, 2])
        out.append((pp * cp, [f"model={model}", f"train.precision={precision}", f"train.device={device}",
                              f"train.recompute={rng.choice(['none', 'selective', 'full'])}", f"parallel.pp={pp}",
                              f"parallel.cp={cp}", f"data.document_mask={rng.choice(['true', 'false'])}",
                              "train.micro_batch_size=2", "train.seq_len=32", "model.max_seq_len=32",
                              "train.global_batch_size=8"]))
    return out


def _reports(overrides: list[str], world: int) -> list:
    rj = resolve(compose_job(overrides)[0], world_size=world)
    reports = [dry_run_rank(rj, rank) for rank in range(world)]
    assert all(r.error is None for r in reports), [r.error for r in reports]
    return reports


@pytest.mark.parametrize("world, overrides", _draws(),
                         ids=lambda v: "-".join(o.split("=")[1] for o in v[:7]) if isinstance(v, list) else str(v))
def test_estimator_counts_rotary_tables_norm_weight_copies_and_position_rows(world, overrides):
    """Every rank: the estimate equals the dry run's peak to the byte (these small models keep nothing else the
    estimate does not name: the loss's divisor and cp's reweighting factor included, ``loss_bytes.loss_count_bytes``);
    fuzz case 3029's shape below."""
    for r in _reports(overrides, world):
        assert r.activation_bytes_planner == r.activation_bytes, (r.rank, r.activation_bytes_planner, r.activation_bytes)


def test_fuzz_case_3029s_shape_is_exact():
    """Case 3029's model (llama, h 80, 3 heads of width 10, seq 30, 3 layers, bf16, a CPU job) at pp 1 on one
    rank: the planner was 5,840 B below the dry run, (2L + 1) x h x 4 B of fp32 norm weights and L x seq x
    head width x 4 B of rotary casts."""
    overrides = ["model=llama_tiny", "model.num_layers=3", "model.hidden_size=80", "model.num_heads=3",
                 "model.num_kv_heads=3", "model.kv_channels=10", "model.ffn_hidden_size=72", "model.vocab_size=385",
                 "model.max_seq_len=30", "train.seq_len=30", "train.device=cpu", "train.precision=bf16",
                 "train.recompute=selective", "train.micro_batch_size=1", "train.global_batch_size=2"]
    (r,) = _reports(overrides, 1)
    assert r.activation_bytes_planner == r.activation_bytes


def _plan_job(overrides: list[str]):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from parallel3d.planning import cli
    from tests.test_planning_cli import CONF

    cli.register_planning_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return OmegaConf.to_object(compose(config_name="plan", overrides=overrides))


def test_a_plan_of_a_document_masked_job_counts_what_its_dry_run_holds():
    """``scripts/plan.py`` reads ``data.document_mask`` (the data options' key, ``cli.search``): the plan of a masked
    job grows on every stage by what the dry run of its best layout grows by (the document ids, per-sequence rotary
    tables), to the byte, and stays within ``TOLERANCE`` of that dry run. Before, the plan ignored the key."""
    from parallel3d.planning import cli

    base = ["model=llama_tiny", "train.seq_len=64", "train.global_batch_size=16", "train.precision=bf16"]
    search = ["cluster.gpus=2", "plan.top_k=1", "plan.micro_batch_sizes=[2]", "plan.schedules=[1f1b]"]
    plans = {mask: cli.search(_plan_job([*base, *search, f"data.document_mask={mask}"])).ranked[0]
             for mask in ("false", "true")}
    assert plans["false"].layout == plans["true"].layout
    layout = plans["true"].layout
    dry = {mask: _reports([*base, "model.max_seq_len=64", *layout.overrides().split(), f"data.document_mask={mask}"],
                          layout.pp * layout.tp * layout.dp) for mask in ("false", "true")}
    for stage in range(layout.pp):
        planned = {m: plans[m].memory.stages[stage].activations for m in plans}
        measured = {m: max(r.activation_bytes for r in dry[m] if r.coords.get("pp", 0) == stage) for m in dry}
        assert planned["true"] - planned["false"] == measured["true"] - measured["false"] > 0, (stage, planned, measured)
        assert abs(planned["true"] - measured["true"]) <= TOLERANCE * measured["true"], (stage, planned, measured)
