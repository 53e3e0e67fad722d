"""The dry run on layouts no other test names: drawn odd layouts on real gloo ranks, and drawn large jobs.

Small (``tests/dryrun_fuzz.py`` draws them on ``shape_fuzz``'s odd shapes and degrees, worlds 3-6: tp, cp with
every ``cp_comm``, ep / etp, every schedule, virtual stages, uneven stages and empty end chunks, ZeRO 0-3 and
the experts' own stage, host offload, fp32 / bf16): every rank's bytes read from the real ``Trainer``'s
optimizer tensors (parameters, gradients, device masters and moments, host-offloaded state) and every message
of one real step (calls and bytes per group kind and op) must equal the dry run's, rank by rank, exactly, but
for the token all-to-all of MoE's alltoall dispatcher (its sizes are the routing's: ``test_dryrun_gloo``'s
rule); the measured activation peaks as ``test_dryrun_gloo`` bounds them; the planner's activation estimate
against the dry run's within ``test_dryrun_estimator.TOLERANCE`` where the planner has one. CI runs
``dryrun_fuzz.ci_sample()``; ``--extended`` the whole fuzz.

Large (``big_jobs``: MoE with ep / etp, cp, ZB-V, interleaving with uneven stages, 1,024-16,384 ranks): the
first, a middle and the last rank dry-run without error, report bytes and messages, and the planner's
activation estimate holds as above. CI runs ``CI_BIG``; ``--extended`` every job. Where the planner is known
to be off (``KNOWN_PLANNER_GAPS``, ``KNOWN_BIG_GAPS``), or the dry run's activation peak off a real rank's
(``KNOWN_ACTIVATION_GAPS``): findings not fixed yet, the gap is pinned instead.
"""

from __future__ import annotations

import pytest

from parallel3d.config import job_from_dict, resolve
from parallel3d.dryrun import dry_run_rank
from parallel3d.moe.options import DISPATCHERS
from parallel3d.pipeline.options import SPLIT_DRAIN_SCHEDULES, SPLIT_DRAIN_VALUES
from parallel3d.train import compose_job
from tests import dryrun_fuzz as df
from tests.dryrun_big_jobs import CI_BIG, BigJob, big_jobs
from tests.harness import run_on_ranks
from tests.test_dryrun_estimator import TOLERANCE
from tests.test_dryrun_gloo import ACTIVATION_BOUND, ROUTED_KINDS, ROUTED_TOLERANCE

pytestmark = [pytest.mark.filterwarnings("ignore:no peak TFLOP/s known")]

# Where the planner's activation estimate is known to miss the dry run's measured peak by more than TOLERANCE on drawn
# layouts (measured 2026-12-07; docs/dryrun.md, "Drawn layouts no other test names", findings). Pinned, not skipped (a
# skip or xfail fails this suite: conftest's NoSilentSkips): on these the test requires the gap to still be
# there, so a fixed estimator fails it with a message saying which entry to remove. Bytes and messages are
# checked exactly first, on every case.
KNOWN_PLANNER_GAPS: dict[int, str] = {
    # (session 44: 2044, a sent output freed by its batch's wait, fixed by gap44)
    # (session 45: 3029, the torch RMSNorm's fp32 weight copies and the torch RoPE's 16-bit table casts, fixed by
    # plan45: tests/test_dryrun_estimator_positions.py)
}
KNOWN_BIG_GAPS: dict[str, str] = {}  # none left (session 40: big7, big4 fixed)
# Where the dry run's activation peak is known to miss a real rank's by more than ACTIVATION_BOUND, pinned the same way
# (docs/dryrun.md, "Sent outputs on gloo and document ids").
KNOWN_ACTIVATION_GAPS: dict[int, str] = {
    # session 44: rank 0 671,328 B dry vs 708,416 B real (-5.2%; ranks 1 and 2 +0.4% / -1.9%). Not its document mask.
    # Session 45 (docs/dryrun.md, "Case 1001"): the routing. At pp 1 the peak is one microbatch's forward, and each
    # row routed to the rank's experts keeps 976 B; the dry run routes evenly (rank 0: 210 rows over 7 layers, ranks 1
    # and 2: 231), the real step's busiest microbatch sent rank 0 248 rows (+38 x 976 B = +37,088 B, the whole gap),
    # rank 1 228, rank 2 245: data, which no layout count predicts. Not a missing estimator term.
    1001: "MoE, cp 3 allgather, rank 0 -5.2%: the real step's busiest microbatch routes 38 more rows to its experts",
}


def _expect_known(bad: list[str], known: str | None, what: str = "planner") -> None:
    """No disagreement, or, on a known gap, still the gap (module comment above)."""
    if known is None:
        assert not bad, "\n".join(bad)
    else:
        assert bad, f"the known {what} gap ({known}) is gone: remove its entry from the known gaps"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    extended = metafunc.config.getoption("--extended")
    if "case" in metafunc.fixturenames:
        ci = df.ci_sample()
        rest = [c for c in df.all_cases() if c.case_id not in {k.case_id for k in ci}] if extended else []
        seeds = metafunc.config.getoption("--dryrun-seeds")
        wide = [df.generate(i) for i in df.seed_range(seeds)] if seeds else []
        metafunc.parametrize("case", [*ci, *(pytest.param(c, marks=pytest.mark.extended) for c in rest), *wide],
                             ids=[c.name for c in (*ci, *rest, *wide)])
    if "big" in metafunc.fixturenames:
        jobs = big_jobs() if extended else big_jobs(max(CI_BIG) + 1)  # a prefix of the whole draw
        params = [pytest.param(j, marks=() if i in CI_BIG else pytest.mark.extended)
                  for i, j in enumerate(jobs) if extended or i in CI_BIG]
        metafunc.parametrize("big", params, ids=lambda j: j.name)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("dryfuzz_corpus"))


def _planner_off(report) -> str | None:
    """The planner's activation estimate against the dry run's (None: agrees, or the planner has none)."""
    planned, measured = report.activation_bytes_planner, report.activation_bytes
    if planned is None or abs(planned - measured) <= TOLERANCE * measured:
        return None
    return f"rank {report.rank}: planner {planned} B, dry run {measured} B ({(planned - measured) / measured:+.1%})"


def test_dry_run_equals_a_real_gloo_run_on_drawn_layouts(case, tmp_path, cache_dir):
    values = df.values(case, str(tmp_path / "run"), cache_dir)
    real = run_on_ranks(df.real_on_rank, case.world_size, values, case.emulate_nccl, timeout=300)
    rj = resolve(job_from_dict(values), case.world_size)
    routed = rj.model.moe.enabled and rj.model.moe.dispatcher == "alltoall"
    dry_routed = real_routed = 0
    bad, planner, activations = [], [], []
    for rank in range(case.world_size):
        # The real ranks' p2p semantics: NCCL's where they emulate it on gloo, else plain gloo's (the job's own,
        # train.device=cpu); the schedule's order, its messages and when sent outputs are freed follow them.
        report = dry_run_rank(rj, rank, nccl=case.emulate_nccl)
        assert report.error is None, report.error
        held, sent = real[rank]
        real_activations = held.pop("activation_bytes")
        dry = {k: getattr(report, k) for k in held}
        if dry != held:
            bad.append(f"rank {rank}: dry run {dry} != real run {held}")
        # With document masks too: the dry run's step carries one document per sequence (dryrun.step.meta_batch)
        if abs(report.activation_bytes - real_activations) > ACTIVATION_BOUND * real_activations:
            activations.append(f"rank {rank}: dry-run activation peak {report.activation_bytes} vs real "
                               f"{real_activations}")
        dry_msgs = {m.kind: (m.count, m.bytes) for m in report.messages}
        if set(dry_msgs) != set(sent):
            bad.append(f"rank {rank}: kinds {sorted(dry_msgs)} != real {sorted(sent)}")
        for kind, (calls, nbytes) in sent.items():
            got = dry_msgs.get(kind, (0, 0))
            if routed and kind in ROUTED_KINDS:
                dry_routed, real_routed = dry_routed + got[1], real_routed + nbytes
                got = (got[0], nbytes)
            if got != (calls, nbytes):
                bad.append(f"rank {rank} {kind}: dry run {got} != real {(calls, nbytes)} (calls, bytes)")
        if (off := _planner_off(report)) is not None:
            planner.append(off)
    if routed and real_routed:
        if abs(dry_routed / real_routed - 1) > ROUTED_TOLERANCE:
            bad.append(f"token all-to-all bytes over the ranks: balanced {dry_routed}, real {real_routed}")
    assert not bad, "\n".join(bad)
    _expect_known(activations, KNOWN_ACTIVATION_GAPS.get(case.case_id), "dry-run activation")
    _expect_known(planner, KNOWN_PLANNER_GAPS.get(case.case_id))


def test_ci_sample_covers_the_properties():
    """Each property some pool case has is in the CI sample (a narrowed draw would otherwise pass silently),
    and the properties the gloo test lacks are all drawn."""
    ci = df.ci_sample()
    for label, where in df.PROPERTIES.items():
        assert any(where(c) for c in ci), label
    comms = {c.parallel["cp_comm"] for c in df.all_cases() if c.parallel["cp"] > 1}
    from parallel3d.context_parallel import CP_COMM_VARIANTS
    assert comms == set(CP_COMM_VARIANTS), comms


def test_large_drawn_jobs_dry_run(big: BigJob):
    """First, middle and last rank: built and stepped without error, every byte kind a rank of the job holds
    is counted, its messages include its pipeline sends, and the planner's activation estimate holds."""
    rj = resolve(compose_job(list(big.overrides))[0], world_size=big.world)
    bad = []
    for rank in big.chosen_ranks():
        r = dry_run_rank(rj, rank)
        assert r.error is None, r.error
        state = r.offloaded_bytes if rj.zero.offload == "cpu" else r.optimizer_state_bytes
        assert min(r.params, r.param_bytes, r.grad_bytes, state, r.activation_bytes) > 0, r
        kinds = {m.kind for m in r.messages}
        assert "pp send" in kinds and any(k.startswith("dp_cp ") for k in kinds), sorted(kinds)
        if rj.topology.cp > 1:
            assert any(k.startswith("cp") for k in kinds), sorted(kinds)
        if rj.model.moe.enabled and rj.topology.ep > 1:
            assert "ep all_to_all" in kinds or "ep all_gather" in kinds, sorted(kinds)
        if (off := _planner_off(r)) is not None:
            bad.append(off)
    _expect_known(bad, KNOWN_BIG_GAPS.get(big.name.split("-")[0]))


@pytest.mark.parametrize("schedule, v, recompute", [("zbv", 2, "full"), ("zb_h1", 1, "full"), ("zbv", 2, "none"),
                                                   ("zb_h1", 1, "none"), ("1f1b", 1, "full")])
def test_planner_agrees_on_zero_bubble_schedules(schedule, v, recompute):
    """llama_tiny on 2 stages, where the estimator once missed the split backward's W-pending state (zbv full
    -82% / -69%, zb_h1 full -70%, zbv none -15% / +9%; ``planning.split_memory``) and the dry run's reduced
    step missed its peak (``dryrun.step.in_flight_profile``): the planner within TOLERANCE on both stages."""
    ov = ["model=llama_tiny", "parallel.pp=2", f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}",
          f"train.recompute={recompute}", "train.micro_batch_size=1", "train.seq_len=128", "model.max_seq_len=128",
          "train.global_batch_size=8", "train.precision=bf16"]
    rj = resolve(compose_job(ov)[0], world_size=2)
    reports = [dry_run_rank(rj, rank) for rank in (0, 1)]
    assert all(r.error is None for r in reports)
    _expect_known([off for r in reports if (off := _planner_off(r)) is not None], None)


def test_widened_draws_reach_what_the_ids_below_do_not():
    """``--dryrun-seeds``' ids (``dryrun_fuzz.WIDE_BASE``): fp16 among the precisions, worlds above
    ``shape_fuzz.MAX_WORLD``, and MoE presets of ``conf/model`` are drawn; a bad range is refused."""
    from parallel3d import config as cfg
    from tests import shape_fuzz as sf
    wide = [df.generate(i) for i in df.seed_range("0:32")]
    assert {c.train["precision"] for c in wide} == set(cfg.PRECISIONS)
    assert max(c.world_size for c in wide) > sf.MAX_WORLD
    assert any(c.shape["name"].split("-")[0] in df.MOE_PRESETS for c in wide)
    with pytest.raises(ValueError):
        df.seed_range("5:2")


def test_option_draws_reach_every_value_of_their_options():
    """``--dryrun-seeds 1000:B`` (``dryrun_fuzz.OPTIONS_BASE``) draws every value of the options that change a
    rank's bytes or messages beyond its layout: the reduction dtype and the all-gather overlap reach the drawn jobs
    (not disk offload, which the dry run refuses); each split drain (where the option's rule allows it) and each MoE dispatcher come out of
    ``_draw_options`` on a case of each kind (MoE draws are rare among these ids). The ids below draw none of them."""
    import random
    from parallel3d import config as cfg
    from tests import shape_fuzz as sf
    cases = [df.generate(i) for i in df.seed_range("1000:1040")]
    jobs = [resolve(job_from_dict(df.values(c, "out", "cache")), c.world_size) for c in cases]
    assert {j.job.parallel.grad_reduce_dtype for j in jobs} == set(cfg.PRECISIONS)
    assert {j.job.parallel.overlap_param_gather for j in jobs} == {True, False}
    drained = next(c for c in cases if c.parallel["schedule"] in SPLIT_DRAIN_SCHEDULES
                   and c.train["recompute"] != "full")
    moe = df.generate(df.MOE_BASE)
    redrawn = [df._draw_options(random.Random(k), c) for k in range(16) for c in (drained, moe)]
    assert all(sf.judge(c).error is None for c in redrawn)
    assert {c.parallel["split_drain"] for c in redrawn[::2]} == set(SPLIT_DRAIN_VALUES)
    assert {c.shape["moe"]["dispatcher"] for c in redrawn[1::2]} == set(DISPATCHERS)
    below = df.generate(df.OPTIONS_BASE - 1).parallel
    assert not {"grad_reduce_dtype", "overlap_param_gather", "split_drain"} & set(below)
