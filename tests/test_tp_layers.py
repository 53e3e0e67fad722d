"""Tensor-parallel layers against their plain single-process torch counterparts, forward and
backward, in float64, at tp = 1, 2 and 4 (with and without sequence parallel).

Each layer initialises its own shard from (seed, name); the reference uses the gathered full
weights with plain ``F.linear`` / ``F.embedding`` / ``F.cross_entropy``. Every rank checks its
own shards and returns the worst relative error of each check.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parallel3d.parallel_state import ParallelState
from parallel3d.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from parallel3d.tensor_parallel.sharding import gather_full
from parallel3d.topology import Topology
from tests.harness import run_on_ranks
from tests.saved_bytes import saved_bytes

B, S, IN, OUT, VOCAB = 2, 8, 12, 16, 10  # VOCAB=10 is padded to 12 at tp=4
F64 = torch.float64


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-300))


def _chunk(t: torch.Tensor, dim: int, pstate: ParallelState) -> torch.Tensor:
    return t.chunk(pstate.size("tp"), dim=dim)[pstate.coord("tp")]


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def check_column(pstate: ParallelState, *, gather_output: bool, sp: bool) -> float:
    layer = ColumnParallelLinear(IN, OUT, pstate, global_name="col", seed=3, gather_output=gather_output,
                                 sequence_parallel=sp, dtype=F64)
    w, b = gather_full(layer.weight, pstate), gather_full(layer.bias, pstate)
    x_full, r_full = _rand(B, S, IN, seed=1), _rand(B, S, OUT, seed=2)
    x = _leaf(_chunk(x_full, 1, pstate) if sp else x_full)
    y = layer(x)
    r = r_full if gather_output else _chunk(r_full, -1, pstate)
    (y * r).sum().backward()
    xr, wr, br = _leaf(x_full), _leaf(w), _leaf(b)
    yr = F.linear(xr, wr, br)
    (yr * r_full).sum().backward()
    yr_local = yr if gather_output else _chunk(yr, -1, pstate)
    x_grad_ref = _chunk(xr.grad, 1, pstate) if sp else xr.grad
    return max(_rel(y, yr_local), _rel(x.grad, x_grad_ref),
               _rel(gather_full(layer.weight, pstate, layer.weight.grad), wr.grad),
               _rel(gather_full(layer.bias, pstate, layer.bias.grad), br.grad))


def check_row(pstate: ParallelState, *, input_is_parallel: bool, sp: bool) -> float:
    layer = RowParallelLinear(IN, OUT, pstate, global_name="row", seed=4, input_is_parallel=input_is_parallel,
                              sequence_parallel=sp, dtype=F64)
    with torch.no_grad():  # a non-zero bias so its (sequence-parallel) gradient path is exercised
        layer.bias.copy_(_rand(OUT, seed=9))
    w, b = gather_full(layer.weight, pstate), gather_full(layer.bias, pstate)
    x_full, r_full = _rand(B, S, IN, seed=5), _rand(B, S, OUT, seed=6)
    x = _leaf(_chunk(x_full, -1, pstate) if input_is_parallel else x_full)
    pstate.comm_stats.reset()
    y = layer(x)
    forward_calls = dict(pstate.comm_stats.calls)
    r = _chunk(r_full, 1, pstate) if sp else r_full
    (y * r).sum().backward()
    xr, wr, br = _leaf(x_full), _leaf(w), _leaf(b)
    yr = F.linear(xr, wr, br)
    (yr * r_full).sum().backward()
    x_grad_ref = _chunk(xr.grad, -1, pstate) if input_is_parallel else xr.grad
    if pstate.size("tp") > 1:  # exactly one collective of the output in forward
        assert forward_calls == {("tp", "reduce_scatter" if sp else "all_reduce"): 1}, forward_calls
    return max(_rel(y, _chunk(yr, 1, pstate) if sp else yr), _rel(x.grad, x_grad_ref),
               _rel(gather_full(layer.weight, pstate, layer.weight.grad), wr.grad),
               _rel(layer.bias.grad, br.grad))


def check_embedding(pstate: ParallelState, *, sp: bool) -> float:
    layer = VocabParallelEmbedding(VOCAB, IN, pstate, global_name="emb", seed=5, sequence_parallel=sp, dtype=F64)
    w = gather_full(layer.weight, pstate)
    assert w.shape == (VOCAB, IN)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(7))
    ids[0, 0], ids[1, -1] = 0, VOCAB - 1  # both ends of the vocabulary
    r_full = _rand(B, S, IN, seed=8)
    y = layer(ids)
    (y * (_chunk(r_full, 1, pstate) if sp else r_full)).sum().backward()
    wr = _leaf(w)
    yr = F.embedding(ids, wr)
    (yr * r_full).sum().backward()
    grad = gather_full(layer.weight, pstate, layer.weight.grad)
    padding_rows = layer.weight.grad[layer.weight.shape[0] - (layer.padded_vocab_size - VOCAB):] \
        if pstate.coord("tp") == pstate.size("tp") - 1 else layer.weight.grad[:0]
    assert not padding_rows.any(), "padding rows must get no gradient"
    return max(_rel(y, _chunk(yr, 1, pstate) if sp else yr), _rel(grad, wr.grad))


def check_cross_entropy(pstate: ParallelState, dtype: torch.dtype) -> float:
    padded = -(-VOCAB // pstate.size("tp")) * pstate.size("tp")
    logits_full = torch.cat([_rand(B, S, VOCAB, seed=11) * 3, _rand(B, S, padded - VOCAB, seed=12)], -1)
    logits_full = logits_full.to(dtype)  # padding columns hold junk: they must be ignored
    targets = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(13))
    targets[1, :3] = -100
    logits = _leaf(_chunk(logits_full, -1, pstate))
    loss = vocab_parallel_cross_entropy(logits, targets, pstate, vocab_size=VOCAB)
    (loss * 2.5).backward()
    ref_logits = _leaf(logits_full[..., :VOCAB].to(F64))
    ref = F.cross_entropy(ref_logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100)
    (ref * 2.5).backward()
    ref_grad = torch.cat([ref_logits.grad, torch.zeros(B, S, padded - VOCAB, dtype=F64)], -1)
    per_token = vocab_parallel_cross_entropy(logits.detach(), targets, pstate, vocab_size=VOCAB, reduction="none")
    ref_tok = F.cross_entropy(ref_logits.detach().reshape(-1, VOCAB), targets.reshape(-1), reduction="none")
    return max(_rel(loss, ref), _rel(logits.grad, _chunk(ref_grad, -1, pstate)),
               _rel(per_token.reshape(-1), ref_tok))


def all_checks(pstate: ParallelState) -> dict[str, float]:
    out = {}
    for sp in (False, True):
        for gather in (False, True):
            if not (sp and gather):
                out[f"column gather={gather} sp={sp}"] = check_column(pstate, gather_output=gather, sp=sp)
        out[f"row sp={sp}"] = check_row(pstate, input_is_parallel=True, sp=sp)
        out[f"embedding sp={sp}"] = check_embedding(pstate, sp=sp)
    out["row split-input"] = check_row(pstate, input_is_parallel=False, sp=False)
    out["cross_entropy f64"] = check_cross_entropy(pstate, F64)
    out["cross_entropy f32"] = check_cross_entropy(pstate, torch.float32)
    return out


def column_saved_bytes(pstate: ParallelState) -> dict[bool, int]:
    """Activation bytes one column-parallel layer keeps for backward, without / with sequence parallel."""
    out = {}
    for sp in (False, True):
        layer = ColumnParallelLinear(IN, OUT, pstate, global_name="col", seed=3, sequence_parallel=sp, dtype=F64)
        x_full = _rand(B, S, IN, seed=1)
        x = _leaf(_chunk(x_full, 1, pstate) if sp else x_full)
        out[sp], y = saved_bytes(lambda: layer(x), exclude=layer.parameters())
        y.sum().backward()  # the saved tensors must serve a backward (and free the graph)
    return out


def _on_ranks(rank: int, world: int, tp: int) -> tuple[dict[str, float], dict[bool, int]]:
    pstate = ParallelState(Topology(tp=tp, pp=1, dp=world // tp))
    return all_checks(pstate), column_saved_bytes(pstate)


def _assert_small(errors: dict[str, float], tp: int) -> None:
    tolerance = {"cross_entropy f32": 1e-6}  # float32 math; everything else is float64
    bad = {k: v for k, v in errors.items() if not v < tolerance.get(k, 1e-10)}
    assert not bad, f"tp={tp}: {bad}"


def test_layers_tp1():
    _assert_small(all_checks(ParallelState.single_process()), 1)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_layers_tp(tp):
    for errors, saved in run_on_ranks(_on_ranks, tp, tp, timeout=180):
        _assert_small(errors, tp)
        # Korthikanti et al.: with sequence parallel the layer keeps its 1/tp input shard and
        # all-gathers it again in backward, instead of keeping the gathered input.
        assert saved[False] == B * S * IN * 8, saved
        assert saved[True] * tp == saved[False], saved


def test_uneven_split_is_a_clear_error():
    pstate = ParallelState.without_groups(Topology(tp=4, pp=1, dp=1), 0)
    with pytest.raises(ValueError, match=r"col: output features=10 is not divisible by tp=4"):
        ColumnParallelLinear(8, 10, pstate, global_name="col", device="meta")
    with pytest.raises(ValueError, match=r"row: input features=6 is not divisible by tp=4"):
        RowParallelLinear(6, 8, pstate, global_name="row", device="meta")
    with pytest.raises(ValueError, match="reduction='avg'"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long),
                                     ParallelState.single_process(), reduction="avg")
