"""Resume a checkpoint at another layout (tp, pp, dp, cp, ZeRO stage, schedule, virtual stages,
pp_layers; for mixtures of experts ep, etp and the experts' own ZeRO stage): exact state, the
same continued loss curve (``tests/reshard_matrix.py``).

CI runs ``reshard_matrix.ci_pairs()``: the issue's pairs, generated ones (covering an
interleaved schedule and explicit ``pp_layers``) and MoE pairs (``MOE_PAIR_MUST_COVER``: etp !=
tp on one side, another ep); ``--layout-matrix=all`` draws ``GENERATED_ALL`` generated dense
pairs and ``MOE_GENERATED_ALL`` MoE pairs.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from parallel3d.checkpoint_io.compat import STATE_DIR
from parallel3d.checkpoint_io.state import read_metadata, read_tensors
from tests import layout_matrix as lm
from tests import layout_run as lr
from tests import odd_reshard as odd
from tests import reshard_matrix as rm

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")]
GENERATED_ALL = 12
MOE_GENERATED_ALL = 6


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "pair" in metafunc.fixturenames:
        every = metafunc.config.getoption("--layout-matrix") == "all"
        pairs = rm.ci_pairs(GENERATED_ALL if every else rm.GENERATED, MOE_GENERATED_ALL if every else rm.MOE_GENERATED)
        pairs += odd.ci_pairs()
        extended = [p for p in odd.extended_pairs() if p not in pairs] if metafunc.config.getoption("--extended") else []
        metafunc.parametrize("pair", [*pairs, *(pytest.param(p, marks=pytest.mark.extended) for p in extended)],
                             ids=[p.name for p in (*pairs, *extended)])


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("reshard_corpus"))


@pytest.fixture(scope="module")
def sources(tmp_path_factory, cache_dir) -> dict:
    """Uninterrupted source runs, shared by the pairs that start from the same layout."""
    runs: dict = {}

    def get(pair: rm.Pair) -> tuple[str, list]:
        key = (pair.model, pair.source.label(), repr(pair.source))
        if key not in runs:
            out = str(tmp_path_factory.mktemp("source") / "run")
            values = rm.job_values(pair, pair.source, out, cache_dir)
            curve = next(c for c in rm.run(lr.train_case_on_rank, pair.source.world_size, values, True) if c)
            runs[key] = (out, curve)
        return runs[key]

    return get


def _assert_same_state(saved: str, copy: str) -> None:
    keys = sorted(k for k, v in read_metadata(saved).state_dict_metadata.items() if hasattr(v, "size"))
    assert keys == sorted(k for k, v in read_metadata(copy).state_dict_metadata.items() if hasattr(v, "size"))
    assert any(k.startswith("optim.exp_avg_sq.") for k in keys)
    a, b = read_tensors(saved, keys), read_tensors(copy, keys)
    for key in keys:
        assert torch.equal(a[key], b[key]), key


def test_resume_at_another_layout(pair, tmp_path, cache_dir, sources):
    source_dir, uninterrupted = sources(pair)
    checkpoint = rm.checkpoint_of(source_dir, rm.SAVE_STEP)
    copy = str(tmp_path / "written_back")
    values = rm.job_values(pair, pair.target, str(tmp_path / "target"), cache_dir, resume=checkpoint)
    per_rank = rm.run(rm.resume_on_rank, pair.target.world_size, values, checkpoint, copy)
    assert all(not differing for _, differing in per_rank), [d for _, d in per_rank if d][0]
    _assert_same_state(os.path.join(checkpoint, STATE_DIR), copy)
    resumed = next(curve for curve, _ in per_rank if curve)
    expected = [row for row in uninterrupted if row[0] > rm.SAVE_STEP]
    assert [r[0] for r in resumed] == [r[0] for r in expected] == list(range(rm.SAVE_STEP + 1, rm.STEPS + 1))
    for (step, loss, gnorm, eval_loss), (_, ref_loss, ref_gnorm, ref_eval) in zip(resumed, expected):
        assert abs(loss - ref_loss) <= rm.RTOL * abs(ref_loss), (step, loss, ref_loss)
        assert abs(gnorm - ref_gnorm) <= lm.RTOL * abs(ref_gnorm), (step, gnorm, ref_gnorm)  # as the layout matrix
        assert (eval_loss is None) == (ref_eval is None), (step, eval_loss, ref_eval)
        if ref_eval is not None:
            assert abs(eval_loss - ref_eval) <= rm.RTOL * abs(ref_eval), (step, eval_loss, ref_eval)
    if pair.case is not None:  # odd shape: the one-process run's too
        full = lr.train_reference(rm.single_process_values(pair, str(tmp_path / "single"), cache_dir), True)
        single = [row for row in full if row[0] > rm.SAVE_STEP]
        assert [r[0] for r in single] == [r[0] for r in resumed]

        def close(rtol: dict) -> bool:
            return all((a is None) == (b is None) and (a is None or abs(a - b) <= rtol[got[0]] * abs(b))
                       for got, ref in zip(resumed, single) for a, b in zip(got[1:], ref[1:]))

        if not close(dict.fromkeys([r[0] for r in single], lm.RTOL)):  # layout matrix RTOL, else the shape's floor
            rtol = odd.single_process_tolerances(pair, full, str(tmp_path / "single-mb1"), cache_dir)
            if not close(rtol):  # amplified rounding or a wrong term: float64 decides (odd.float64_gaps)
                gaps = odd.float64_gaps(pair, str(tmp_path / "float64"), cache_dir)
                print(f"{pair.name}: misses the one-process run in fp32 beyond its noise floor; float64 gaps {gaps}")
                assert max(gaps.values()) <= lm.RTOL, (resumed, single, rtol, gaps)

def test_odd_pairs_meet_their_properties():
    """Each odd pair is what its property promises: one drawn shape on both sides (validator-accepted),
    the source and target conditions, and CI's within its world budget with a degree-3 tp or pp source."""
    from tests import shape_fuzz as sf

    ci = odd.ci_pairs()
    for pair in ci:
        assert max(pair.source.world_size, pair.target.world_size) <= odd.CI_MAX_WORLD, pair.name
        assert 3 in (pair.source.parallel["tp"], pair.source.parallel["pp"]), pair.name
    for label, n in odd.EXTENDED_PAIRS.items():
        source_ok, target_ok = odd.PAIR_PROPERTIES[label]
        for pair in [odd.odd_pair(label, k) for k in range(n)] + [p for lb, p in zip(odd.CI_PROPERTIES, ci)
                                                                    if lb == label]:
            src, tgt = (sf.ShapeCase(0, pair.case.model, s.parallel, s.train, shape=pair.case.shape,
                                     seq=pair.case.seq, document_mask=pair.case.document_mask)
                        for s in (pair.source, pair.target))
            assert src == dataclasses.replace(pair.case, case_id=0, emulate_nccl=False), pair.name
            assert source_ok(src) and target_ok(src, tgt), (label, pair.name)
            assert sf.judge(src).error is None and sf.judge(tgt).error is None, pair.name
            assert pair.source.label() != pair.target.label(), pair.name
