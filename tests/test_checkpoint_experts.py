"""Checkpoints of routed experts at any expert layout (ep, etp, edp, expert ZeRO stage) on real gloo ranks.

Each case saves the state of a freshly built MoE model (``mixtral_tiny`` / ``deepseek_tiny``) at a
generated layout whose expert tensor parallelism differs from tp, through the same DCP save the
trainer uses, then loads it at another generated layout of the same world. Checked against
independent references:

- every element of every key is written exactly once over all ranks (counted from the pieces
  themselves: DCP deduplicates chunks that two ranks write at the same offsets, so its own
  fill check cannot see every double write), and DCP logs no warning;
- the saved tensors equal the single-process model of the same seed (init is layout-free and
  experts are keyed by global expert index), buffers included;
- every box the loading layout holds equals the saved tensor's region.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from models import build_model, get_config
from models.state import full_state_dict
from parallel3d.parallel_state import ParallelState
from parallel3d.topology import LayoutError, Topology
from tests.harness import run_on_ranks

pytestmark = pytest.mark.slow  # four gloo ranks per case

MODELS = ("mixtral_tiny", "deepseek_tiny")
SEED = 3
WORLD = 4


def _layout(rng: random.Random, *, etp_differs: bool) -> dict | None:
    """A random layout of ``WORLD`` ranks (None when the draw is not a valid topology)."""
    tp, pp = rng.choice((1, 2)), rng.choice((1, 2))  # tp <= kv heads (2)
    if WORLD % (tp * pp):
        return None
    lay = {"tp": tp, "pp": pp, "dp": WORLD // (tp * pp), "ep": rng.choice((1, 2, 4)), "etp": rng.choice((1, 2, 4)),
           "zero_stage": rng.choice((0, 1, 2, 3)), "expert_zero_stage": rng.choice((0, 1, 2, 3))}
    if etp_differs and lay["etp"] == tp:
        return None
    try:
        Topology(**{k: lay[k] for k in ("tp", "pp", "dp", "ep", "etp")})
    except LayoutError:
        return None
    return lay


# What the drawn pairs must include between them (drawn further until each holds for some pair).
MUST_COVER = {
    "pp > 1": lambda save, load: max(save["pp"], load["pp"]) > 1,
    "ep = 4": lambda save, load: 4 in (save["ep"], load["ep"]),
    "another ep": lambda save, load: save["ep"] != load["ep"],
    "another etp": lambda save, load: save["etp"] != load["etp"],
    "experts at ZeRO-3, dense at another stage": lambda save, load: any(
        s["expert_zero_stage"] == 3 != s["zero_stage"] for s in (save, load)),
    "experts at ZeRO-0 with edp > 1": lambda save, load: any(
        s["expert_zero_stage"] == 0 and WORLD // (s["etp"] * s["ep"] * s["pp"]) > 1 for s in (save, load)),
}
MAX_DRAWS = 2000


def cases() -> list[tuple[str, dict, dict]]:
    """Generated (model, save, load) cases: a draw is kept when it covers a property no kept one does."""
    rng = random.Random(25)
    out: list[tuple[str, dict, dict]] = []
    for _ in range(MAX_DRAWS):
        uncovered = [p for p in MUST_COVER.values() if not any(p(s, l) for _, s, l in out)]
        if not uncovered:
            return out
        save, load = _layout(rng, etp_differs=True), _layout(rng, etp_differs=False)
        if save is not None and load is not None and load != save and any(p(save, load) for p in uncovered):
            out.append((MODELS[len(out) % len(MODELS)], save, load))
    raise RuntimeError(f"no draws cover {list(MUST_COVER)} in {MAX_DRAWS} draws")


def _optimizer(model: str, lay: dict):
    from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
    from parallel3d.zero import ZeroOptimizer

    cfg = get_config(model)
    ps = ParallelState(Topology(**{k: lay[k] for k in ("tp", "pp", "dp", "ep", "etp")}))
    ranges = partition_layers(cfg, lay["pp"], 1, None)
    chunks = [build_model(cfg, ps, seed=SEED, layer_range=r, pre_process=r[0] == 0,
                          post_process=r[1] == cfg.num_layers, sequence_parallel=lay["tp"] > 1)
              for r in stage_layer_ranges(ranges, lay["pp"], ps.coord("pp"))]
    opt = ZeroOptimizer(chunks, ps, zero_stage=lay["zero_stage"], expert_zero_stage=lay["expert_zero_stage"],
                        lr=1e-3, precision="fp32", bucket_size_mb=0.002)
    return ps, opt


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _save_then_load(rank: int, world: int, model: str, save: dict, load: dict, directory: str):
    """Save at ``save`` (returns what was written and DCP's warnings), then load at ``load``
    (returns every box read)."""
    import torch.distributed as dist

    from parallel3d.checkpoint_io.pieces import pieces_to_read, pieces_to_write, zero_owned_state
    from parallel3d.checkpoint_io.state import read_state, write_state

    def boxes(pieces):
        return [(p.key, tuple(p.global_shape), p.box.offsets, p.box.sizes, p.data.detach().clone()) for p in pieces]

    ps, opt = _optimizer(model, save)
    pieces = pieces_to_write(opt, ps)
    logger, records = logging.getLogger("torch.distributed.checkpoint"), _Records()
    logger.addHandler(records)
    try:
        write_state(directory, pieces, {}, dist.group.WORLD)
    finally:
        logger.removeHandler(records)
    written = boxes(pieces)
    ps, opt = _optimizer(model, load)
    zero_owned_state(opt)
    read = pieces_to_read(opt, ps)
    read_state(directory, read, (), dist.group.WORLD)
    return written, records.messages, boxes(read)


def _reference(model: str) -> dict[str, torch.Tensor]:
    """``key -> global tensor`` of the single-process model (weights, zero moments, buffers)."""
    one = build_model(get_config(model), ParallelState.single_process(), seed=SEED)
    out = {}
    for name, value in full_state_dict(one).items():
        out[f"model.{name}"] = value
        out[f"optim.exp_avg.{name}"] = out[f"optim.exp_avg_sq.{name}"] = torch.zeros_like(value)
    out.update({f"buffer.{name}": b for name, b in one.named_buffers()})  # module paths = global names here
    return out


def _region(offsets, sizes):
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


def _case_id(value: str | dict) -> str:
    if isinstance(value, str):
        return value
    dims = "-".join(f"{k}{value[k]}" for k in ("tp", "pp", "dp", "ep", "etp"))
    return f"{dims}-z{value['zero_stage']}e{value['expert_zero_stage']}"


@pytest.mark.parametrize("model,save,load", cases(), ids=_case_id)
def test_expert_checkpoint_is_complete_and_loads_at_another_layout(model, save, load, tmp_path):
    per_rank = run_on_ranks(_save_then_load, WORLD, model, save, load, str(tmp_path / "ckpt"))
    reference = _reference(model)
    assert any(".experts." in k for k in reference)
    count = {key: torch.zeros(value.shape, dtype=torch.int32) for key, value in reference.items()}
    for written, warnings, _ in per_rank:
        assert not warnings, warnings[0]
        for key, shape, offsets, sizes, data in written:
            assert key in reference, key
            assert shape == tuple(reference[key].shape), (key, shape)
            count[key][_region(offsets, sizes)] += 1
            assert torch.equal(data, reference[key][_region(offsets, sizes)]), key
    for key, c in count.items():
        assert bool((c == 1).all()), f"{key}: elements written {c.min().item()}..{c.max().item()} times"
    for _, _, read in per_rank:
        assert any(".experts." in key for key, *_ in read)
        for key, shape, offsets, sizes, data in read:
            assert torch.equal(data, reference[key][_region(offsets, sizes)]), key
