"""A resume that changes how the model computes but no parameter's shape warns once, naming each setting (gaps47).

``compat.check_same_model`` compares parameter shapes only, so ``model.moe.top_k``, router settings, ``rope_base``,
``norm_eps`` or MLA settings changed on resume were accepted silently. Changing them is legitimate (a run may lower
top_k), so the resume goes on, and rank 0 prints one line naming each differing setting (there vs here). Reference:
the real CLI composition and trainer, resuming a real checkpoint.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from models import get_config
from parallel3d.checkpoint_io.compat import NOT_COMPUTATION, computation_changes
from tests.test_resume_cli import _args, _train_in_process

pytestmark = [pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")]
TINY_MOE = ["model=mixtral_tiny", "train.steps=2"]


def _warnings_of(args: list[str]) -> tuple[list[str], list[dict]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        records, _ = _train_in_process(args)
    return [str(w.message) for w in caught if "change what the model computes" in str(w.message)], records


def test_changed_top_k_and_rope_base_warn_once_and_the_run_resumes(tmp_path):
    out, cache = str(tmp_path / "run"), str(tmp_path / "cache")
    _train_in_process(_args(out, cache, *TINY_MOE))
    said, records = _warnings_of(_args(out, cache, "model=mixtral_tiny", "train.steps=3", "model.moe.top_k=1",
                                       "model.rope_base=500000", "kernels.backend=torch"))
    assert [r["step"] for r in records] == [3]  # it resumed at step 2 and trained on
    assert len(said) == 1 and "\n" not in said[0], said
    assert "model.moe.top_k=2 there, 1 here" in said[0] and "model.rope_base=10000.0 there, 500000.0 here" in said[0]
    assert "kernel" not in said[0]  # the same function, another kernel: not a change of computation


def test_every_model_field_is_compared_but_those_that_do_not_change_the_computation():
    """Derived from ``ModelConfig``: a field added later is compared without a list to update."""
    base = get_config("deepseek_tiny")
    meta = {"model": dataclasses.asdict(base)}
    assert computation_changes("d", meta, base) is None  # the same model: no line
    changed = {"norm_eps": 1e-6, "dropout": 0.1, "moe": dataclasses.replace(base.moe, top_k=base.moe.top_k - 1),
               "mla": dataclasses.replace(base.mla, qk_rope_head_dim=base.mla.qk_rope_head_dim)}
    line = computation_changes("d", meta, dataclasses.replace(base, **changed))
    assert "model.norm_eps=" in line and "model.dropout=" in line and "model.moe.top_k=" in line
    assert "model.mla." not in line  # an equal value is no change
    for name in NOT_COMPUTATION:
        assert name in {f.name for f in dataclasses.fields(base)}  # each exclusion names a real field
