"""Layout-free state (``parallel3d.checkpoint_io``) without processes: boxes, ownership, round trips.

Every rank of a tp x pp layout is built in this process (``ParallelState`` coordinates
without groups; dp = 1 here, dp is covered on real gloo ranks by
``test_checkpoint_reshard.py``). The reference for "the global tensor" is the
single-process model of the same seed (init is layout-independent).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from models import build_model, get_config
from models.state import full_state_dict
from parallel3d.checkpoint_io.boxes import flat_range_boxes, global_shape, to_global
from parallel3d.checkpoint_io.pieces import key_of, pieces_to_read, pieces_to_write, zero_owned_state
from parallel3d.checkpoint_io.planners import CheckpointMismatch
from parallel3d.checkpoint_io.state import read_state, read_tensors, write_state
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.partition import partition_layers, stage_layer_ranges
from parallel3d.topology import Topology
from parallel3d.zero import ZeroOptimizer
from parallel3d.zero.precision import precision_dtype


# ---- boxes -----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(4, 6), (7,), (2, 3, 4), (3, 1, 5, 2), ()])
def test_flat_ranges_are_exact_unions_of_contiguous_boxes(shape):
    n = math.prod(shape)
    t = torch.arange(n).reshape(shape)
    for a, b in itertools.combinations_with_replacement(range(n + 1), 2):
        boxes = flat_range_boxes(shape, a, b)
        assert len(boxes) <= max(1, 2 * len(shape) - 1)
        covered = []
        for box in boxes:
            region = t[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))].flatten()
            # The box's data is the next prod(sizes) elements of the range: views, no copies.
            assert torch.equal(region, t.flatten()[a + box.flat_start : a + box.flat_start + box.numel])
            covered += region.tolist()
        assert covered == list(range(a, b))
    with pytest.raises(ValueError, match="outside a tensor"):
        flat_range_boxes(shape, 0, n + 1)


def test_global_boxes_of_a_row_parallel_shard_and_of_vocabulary_padding():
    # A row-parallel weight [out=3, in=8] split over tp=2 along dim 1: rank 1 holds columns 4..7.
    local = flat_range_boxes((3, 4), 2, 9)  # row 0 cols 2-3, row 1, row 2 col 0
    glob = [to_global(b, (3, 4), 1, 1, None) for b in local]
    assert [(g.offsets, g.sizes) for g in glob] == [((0, 6), (1, 2)), ((1, 4), (1, 4)), ((2, 4), (1, 1))]
    # Vocabulary 510 padded to 512 at tp=4: rank 3's rows 384..511; rows 510, 511 are padding.
    (padding,) = flat_range_boxes((128, 2), 252, 256)  # local rows 126, 127 = global 510, 511
    assert to_global(padding, (128, 2), 0, 3, 510) is None
    (straddling,) = flat_range_boxes((128, 2), 250, 256)  # global rows 509..511: row 509 is kept
    kept = to_global(straddling, (128, 2), 0, 3, 510)
    assert (kept.offsets, kept.sizes, kept.flat_start) == ((509, 0), (1, 2), 0)
    partial = to_global(flat_range_boxes((128, 2), 0, 256)[0], (128, 2), 0, 3, 510)
    assert (partial.offsets, partial.sizes) == ((384, 0), (126, 2))
    assert global_shape((128, 2), 0, 4, 510) == (510, 2)


# ---- every rank of a layout in one process ---------------------------------------------
MODEL = get_config("llama_tiny", vocab_size=510, num_heads=8, num_kv_heads=4)  # GQA, untied head, padded at tp=4
GPT = get_config("gpt_tiny", vocab_size=510)  # tied embedding: a copy on the last stage when pp > 1


def _rank_optimizers(cfg, tp: int, pp: int, zero_stage: int, precision: str, seed: int = 3):
    """(pstate, optimizer) of every rank of tp x pp (dp = 1), built here without process groups."""
    topo = Topology(tp=tp, pp=pp, dp=1)
    ranges = partition_layers(cfg, pp, 1, None)
    out = []
    for rank in range(topo.world_size):
        ps = ParallelState(topo, rank=rank, distributed=False, backend="gloo", device="cpu")
        chunks = [build_model(cfg, ps, seed=seed, layer_range=r, pre_process=r[0] == 0,
                              post_process=r[1] == cfg.num_layers, dtype=precision_dtype(precision))
                  for r in stage_layer_ranges(ranges, pp, ps.coord("pp"))]
        opt = ZeroOptimizer(chunks, ps, zero_stage=zero_stage, lr=1e-3, precision=precision, bucket_size_mb=0.002)
        out.append((ps, opt))
    return out


def _fill_moments(ranks, full_shapes):
    """Give the moments layout-independent values: a function of the global element index."""
    for ps, opt in ranks:
        for piece in pieces_to_read(opt, ps):
            if piece.key.startswith("optim."):
                n = math.prod(full_shapes[piece.key.split(".", 2)[2]])
                idx = torch.arange(n, dtype=torch.float64).reshape(full_shapes[piece.key.split(".", 2)[2]])
                region = idx[tuple(slice(o, o + s) for o, s in zip(piece.box.offsets, piece.box.sizes))]
                scale = 1.0 if "exp_avg_sq" in piece.key else -1.0
                piece.data.copy_(scale * (region + 1) / n)


def _layouts():
    rng = random.Random(7)
    cases = [(2, 2, 1, "fp32"), (4, 1, 0, "bf16"), (1, 4, 2, "fp32")]
    for _ in range(4):
        cases.append((rng.choice((1, 2, 4)), rng.choice((1, 2, 4)), rng.choice((0, 1, 2)), rng.choice(("fp32", "bf16"))))
    return cases


@pytest.mark.parametrize("cfg", [MODEL, GPT], ids=["llama", "gpt"])
@pytest.mark.parametrize("tp,pp,zero_stage,precision", _layouts())
def test_written_pieces_tile_every_tensor_once_with_its_global_values(cfg, tp, pp, zero_stage, precision):
    reference = full_state_dict(build_model(cfg, ParallelState.single_process(), seed=3))
    shapes = {name: tuple(t.shape) for name, t in reference.items()}
    ranks = _rank_optimizers(cfg, tp, pp, zero_stage, precision)
    _fill_moments(ranks, shapes)
    count = {key_of(k, n): torch.zeros(s, dtype=torch.int32) for n, s in shapes.items()
             for k in ("master", "exp_avg", "exp_avg_sq")}
    for ps, opt in ranks:
        for piece in pieces_to_write(opt, ps):
            region = tuple(slice(o, o + s) for o, s in zip(piece.box.offsets, piece.box.sizes))
            count[piece.key][region] += 1
            if piece.key.startswith("model."):
                want = reference[piece.key[len("model."):]][region]
                # bf16 parameters' fp32 masters start as the bf16 values
                assert torch.equal(piece.data, want.to(precision_dtype(precision)).float()), piece.key
    for key, c in count.items():
        assert bool((c == 1).all()), f"{key}: elements written {c.min().item()}..{c.max().item()} times"


def _save_all(ranks, directory):
    """A checkpoint holding every rank's pieces, written from this process (one DCP "rank")."""
    pieces = [p for ps, opt in ranks for p in pieces_to_write(opt, ps)]
    write_state(directory, pieces, {"trainer": {"step": 5}}, None)


@pytest.mark.parametrize("cfg", [MODEL, GPT], ids=["llama", "gpt"])
def test_state_moves_between_layouts_and_precisions_exactly(cfg, tmp_path):
    rng = random.Random(11)
    source = _rank_optimizers(cfg, 2, 2, 1, "bf16")
    reference = full_state_dict(build_model(cfg, ParallelState.single_process(), seed=3))
    shapes = {name: tuple(t.shape) for name, t in reference.items()}
    _fill_moments(source, shapes)
    with torch.no_grad():  # fp32 masters that bf16 cannot hold: they must survive exactly
        for ps, opt in source:
            for seg in opt.owned_segments():
                seg.master.add_(1e-5)
    _save_all(source, str(tmp_path / "a"))
    saved = read_tensors(str(tmp_path / "a"), sorted(key_of(k, n) for n in shapes for k in ("master", "exp_avg")))
    targets = [(4, 1, 0, "fp32"), (1, 4, 2, "bf16"), (rng.choice((1, 2)), 2, 1, "fp32")]
    for i, (tp, pp, stage, precision) in enumerate(targets):
        target = _rank_optimizers(cfg, tp, pp, stage, precision, seed=99)  # other weights: all must be loaded
        for ps, opt in target:
            zero_owned_state(opt)
            objects = read_state(str(tmp_path / "a"), pieces_to_read(opt, ps), ("trainer",), None)
            assert objects["trainer"] == {"step": 5}
            opt.params_from_master()
            for piece in pieces_to_read(opt, ps):
                if piece.key in saved:
                    region = tuple(slice(o, o + s) for o, s in zip(piece.box.offsets, piece.box.sizes))
                    assert torch.equal(piece.data, saved[piece.key][region]), piece.key
            for chunk in opt.modules:  # parameters are the masters' rounding, vocabulary padding zero
                for p in chunk.parameters():
                    from parallel3d.tensor_parallel.sharding import shard_of

                    want = shard_of(saved[f"model.{p.global_name}"], p, ps).to(p.dtype)
                    assert torch.equal(p.detach(), want), p.global_name
        _save_all(target, str(tmp_path / f"b{i}"))
        again = read_tensors(str(tmp_path / f"b{i}"), sorted(saved))
        assert all(torch.equal(again[k], saved[k]) for k in saved)


def test_a_checkpoint_of_another_model_is_one_clear_line(tmp_path):
    _save_all(_rank_optimizers(MODEL, 1, 1, 1, "fp32"), str(tmp_path / "a"))
    other = _rank_optimizers(MODEL.replace(hidden_size=128, ffn_hidden_size=256), 2, 1, 1, "fp32")
    ps, opt = other[0]
    with pytest.raises(CheckpointMismatch) as caught:
        read_state(str(tmp_path / "a"), pieces_to_read(opt, ps), (), None)
    message = str(caught.value)
    assert "\n" not in message
    assert "has shape [510, 64] in the checkpoint but [510, 128] in this model" in message
    deeper = _rank_optimizers(MODEL.replace(num_layers=6), 1, 1, 1, "fp32")[0]
    with pytest.raises(CheckpointMismatch, match=r"the checkpoint has no model.layers.4"):
        read_state(str(tmp_path / "a"), pieces_to_read(deeper[1], deeper[0]), (), None)
