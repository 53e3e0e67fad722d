"""The zero-bubble split backward (``B`` then ``W``) against one plain backward, on the real model.

Generated model chunks (gpt/llama, tp 1 or 2, sequence parallel, recompute, tied or untied
head, biases or not, a middle or a last chunk) run the same forward twice: once with one
``backward``, once with ``backward_split.split_backward`` (``B``) and the returned work's
``run`` (``W``). Every gradient, the input's included, must be bitwise equal; every
parameter's post-accumulate hook must fire exactly once, the deferred (GEMM) ones in ``W``
only and the others in ``B`` only; ``B`` + ``W`` must run exactly the aten ops of one
backward (a ``TorchDispatchMode`` count; ``W`` adds a scalar anchor), so ``W`` is the GEMMs
and nothing more (no copies); and ``B`` must free the activations ``W`` does not read.
"""

from __future__ import annotations

import contextlib
import random
import weakref
from collections import Counter

import pytest
import torch

from models import build_model
from models.config import ModelConfig
from parallel3d.deferred_grads import WeightGradDeferral, backward_inputs
from parallel3d.param_meta import is_wgrad_deferrable, set_meta
from parallel3d.parallel_state import ParallelState
from parallel3d.pipeline.backward_split import split_backward
from parallel3d.tensor_parallel.deferrable_linear import deferrable_linear
from parallel3d.topology import Topology
from tests.harness import run_on_ranks
from tests.op_count import OpCount


_ACCUMULATE = ("aten.detach", "aten.copy_", "aten.new_empty_strided")  # AccumulateGrad: adopt or copy


def _draw(seed: int, tp: int) -> dict:
    rng = random.Random(seed)
    arch = rng.choice(("gpt", "llama"))
    heads = rng.choice((2, 4))
    return {
        "config": ModelConfig(arch=arch, num_layers=3, hidden_size=8 * heads, num_heads=heads,
                              num_kv_heads=heads // 2 if arch == "llama" and rng.random() < 0.5 else None,
                              ffn_hidden_size=None if arch == "gpt" else 24, vocab_size=rng.choice((30, 32)),
                              max_seq_len=16, tie_embeddings=arch == "gpt" and rng.random() < 0.7,
                              use_bias=arch == "gpt" and rng.random() < 0.7, fused_kernels=False),
        "layers": (1, rng.choice((2, 3))),
        "sp": tp > 1 and rng.random() < 0.5,
        "recompute": rng.choice(("none", "selective", "full")),
        "seq": 8,
    }


def _split_vs_plain(pstate: ParallelState, seed: int, direct: bool = True) -> dict:
    """``direct``: W accumulates without autograd (``leaf_grads``), else through W's one-node graph."""
    draw = _draw(seed, pstate.size("tp"))
    pstate.weight_grads.direct = direct
    cfg, (a, b) = draw["config"], draw["layers"]
    torch.manual_seed(seed)
    chunk = build_model(cfg, pstate, seed=seed, layer_range=(a, b), pre_process=False,
                        post_process=b == cfg.num_layers, sequence_parallel=draw["sp"], recompute=draw["recompute"])
    s_local = draw["seq"] // pstate.size("tp") if draw["sp"] else draw["seq"]
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, s_local, cfg.hidden_size, generator=gen)
    labels = torch.randint(0, cfg.vocab_size, (2, draw["seq"]), generator=gen)
    params = dict(chunk.named_parameters())
    where: dict[str, list[str]] = {n: [] for n in params}
    phase = ["plain"]
    for n, p in params.items():
        p.register_post_accumulate_grad_hook(lambda p, n=n: where[n].append(phase[0]))

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        inp = x.clone().requires_grad_(True)
        out = chunk(inp, labels if chunk.post_process else None)
        return inp, out * 0.5 if chunk.post_process else out

    grad = None if chunk.post_process else torch.randn(x.shape, generator=gen)
    inp, out = forward()
    with OpCount() as plain_ops:
        torch.autograd.backward(out, grad_tensors=grad)
    ref = {n: p.grad.clone() for n, p in params.items()}
    ref_in = inp.grad.clone()
    chunk.zero_grad(set_to_none=True)
    for n in where:
        where[n].clear()
    kept: list[weakref.ref] = []  # every submodule's output: B must free all that W does not hold
    for module in chunk.modules():
        module.register_forward_hook(
            lambda m, i, o: kept.append(weakref.ref(o)) if isinstance(o, torch.Tensor) else None)
    inp, out = forward()
    alive_before_b = sum(ref() is not None for ref in kept)
    phase[0] = "B"
    with OpCount() as b_ops:
        g_in, work = split_backward(out, grad, inp, pstate.weight_grads, backward_inputs(chunk.parameters()))
    del out
    held = {t.untyped_storage()._cdata for t in work.held}
    freed_in_b = all(ref() is None or ref().untyped_storage()._cdata in held for ref in kept)
    deferred_in_b = {n for n, p in params.items() if p.grad is not None and is_wgrad_deferrable(p)}
    queued = len(work)
    phase[0] = "W"
    with OpCount() as w_ops:
        work.run()
    pstate.weight_grads.direct = True
    return {
        "case": (seed, pstate.size("tp"), draw, direct),
        "equal": {n: torch.equal(p.grad, ref[n]) for n, p in params.items()},
        "input_equal": torch.equal(g_in, ref_in),
        "where": where,
        "deferrable": {n: is_wgrad_deferrable(p) for n, p in params.items()},
        "ops": (plain_ops.ops, b_ops.ops + w_ops.ops),
        "w_gemms": sum(n for op, n in w_ops.ops.items() if op in ("aten.mm", "aten.addmm", "aten.bmm")),
        "queued": queued,
        "freed_in_b": freed_in_b,
        "alive_before_b": alive_before_b,
        "deferred_in_b": deferred_in_b,
    }


def _check(result: dict) -> None:
    case = result["case"]
    assert result["input_equal"], case
    assert all(result["equal"].values()), (case, [n for n, ok in result["equal"].items() if not ok])
    for name, phases in result["where"].items():
        assert phases == (["W"] if result["deferrable"][name] else ["B"]), (case, name, phases)
    assert not result["deferred_in_b"], case
    plain, split = result["ops"]
    # W's one-node graph adds a scalar anchor and its seed gradient; W without autograd adds nothing
    # (leaf_grads runs AccumulateGrad's ops: detach to adopt, new_empty_strided + copy_ to copy).
    # AccumulateGrad adopts a new gradient (detach) or, if something else still holds it (a tp
    # collective's reference, released by gloo's worker thread at a timing-dependent moment), copies
    # it (new_empty_strided + copy_):
    # which one may differ for any gradient, but every gradient is accumulated exactly once either
    # way, and every other op runs equally often.
    def compute(ops: Counter) -> Counter:
        return Counter({k: v for k, v in ops.items() if k not in _ACCUMULATE})

    anchor = Counter() if case[3] else Counter({"aten.zeros": 1, "aten.ones_like": 1})
    assert compute(split) - compute(plain) == anchor, (case, split - plain)
    assert not compute(plain) - compute(split), (case, plain - split)
    def accumulations(ops: Counter) -> int:  # adopted + copied gradients
        return ops["aten.detach"] + ops["aten.new_empty_strided"]

    def other_copies(ops: Counter) -> int:
        return ops["aten.copy_"] - ops["aten.new_empty_strided"]

    assert accumulations(split) == accumulations(plain), (case, split - plain, plain - split)
    assert other_copies(split) == other_copies(plain), (case, split - plain, plain - split)
    assert result["queued"] > 0 and result["w_gemms"] > 0, case
    assert result["freed_in_b"], case
    assert result["alive_before_b"] or case[2]["recompute"] == "full", case


def _on_ranks(rank: int, world: int, seeds: list[int]) -> list[dict]:
    pstate = ParallelState(Topology(tp=world))
    return [_split_vs_plain(pstate, seed, direct) for seed in seeds for direct in (True, False)]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "graph"])
@pytest.mark.parametrize("seed", range(4))
def test_split_backward_is_one_backward_tp1(seed, direct):
    _check(_split_vs_plain(ParallelState(Topology()), seed, direct))


def test_split_backward_is_one_backward_tp2_and_sequence_parallel():
    seeds = list(range(10, 16))
    results = run_on_ranks(_on_ranks, 2, seeds, timeout=240)
    assert any(r["case"][2]["sp"] for r in results[0]) and any(not r["case"][2]["sp"] for r in results[0])
    for per_rank in results:
        for result in per_rank:
            _check(result)


def test_outside_a_b_layers_compute_their_weight_grads_and_mixed_marks_fail():
    deferral = WeightGradDeferral()
    w = set_meta(torch.nn.Parameter(torch.randn(3, 4)), wgrad_deferrable=True)
    b = torch.nn.Parameter(torch.randn(3))
    x = torch.randn(2, 4, requires_grad=True)
    deferrable_linear(x, w, None, deferral).sum().backward()  # no B open: computed now
    assert w.grad is not None
    with deferral.collecting() as work:
        deferrable_linear(x, w, None, deferral).sum().backward(inputs=[x])
    assert len(work) == 1 and not deferral.active
    with pytest.raises(ValueError, match="mixes"):
        with deferral.collecting():
            deferrable_linear(x, w, b, deferral).sum().backward(inputs=[x, b])
    with pytest.raises(RuntimeError, match="already open"):
        with deferral.collecting(), deferral.collecting():
            pass


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "graph"])
def test_w_graphs_kept_per_chunk_accumulate_like_plain_backwards_over_microbatches(direct):
    """Two chunks (as an interleaved stage holds), three microbatches each, B then W in a zero-bubble
    order: every gradient bitwise equal to plain backwards of the same microbatches, each deferred
    parameter's hook once per W; within ``reusing_graphs`` (one engine step) W's graph is built once
    per chunk and rerun (not rebuilt), at most ``kept_graphs`` of them are kept, none after; W without
    autograd (``direct``) builds none."""
    cfg = ModelConfig(arch="gpt", num_layers=4, hidden_size=16, num_heads=2, vocab_size=32, max_seq_len=16,
                      use_bias=True, fused_kernels=False)
    gen = torch.Generator().manual_seed(7)
    xs = [torch.randn(2, 8, 16, generator=gen) for _ in range(3)]
    grads = [torch.randn(2, 8, 16, generator=gen) for _ in range(3)]

    def chunks(pstate):
        return [build_model(cfg, pstate, seed=3, layer_range=r, pre_process=False, post_process=False)
                for r in ((0, 2), (2, 4))]

    plain = chunks(ParallelState(Topology()))
    for c in plain:
        for x, g in zip(xs, grads):
            inp = x.clone().requires_grad_(True)
            torch.autograd.backward(c(inp), grad_tensors=g)
    pstate = ParallelState(Topology())
    pstate.weight_grads.direct = direct
    split = chunks(pstate)
    fired: Counter = Counter()
    for c in split:
        for p in c.parameters():
            p.register_post_accumulate_grad_hook(lambda p: fired.update([id(p)]))
    with OpCount() as ops, pstate.weight_grads.reusing_graphs():
        pending = []
        for mb, (x, g) in enumerate(zip(xs, grads)):
            for c in split:  # both chunks' B, then the previous microbatch's W (a delayed W)
                inp = x.clone().requires_grad_(True)
                pending.append(split_backward(c(inp), g, inp, pstate.weight_grads, backward_inputs(c.parameters()))[1])
            if mb:
                pending.pop(0).run()
                pending.pop(0).run()
        for work in pending:
            work.run()
    for a, b in zip(plain, split):
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p.grad, q.grad), name
            assert fired[id(q)] == 3, name
    assert ops.ops["aten.zeros"] == (0 if direct else 2)  # one W graph per chunk, rerun for the later microbatches
    assert not pstate.weight_grads._anchors._kept  # forgotten at the step's end
    assert not pstate.weight_grads._anchors._routes
    small = WeightGradDeferral(kept_graphs=1, direct=False)
    ps = [set_meta(torch.nn.Parameter(torch.randn(3, 4)), wgrad_deferrable=True) for _ in range(3)]
    x = torch.randn(2, 4, requires_grad=True)
    with small.reusing_graphs():
        for w in ps:
            with small.collecting() as work:
                deferrable_linear(x, w, None, small).sum().backward(inputs=[x])
            work.run()
        assert len(small._anchors._kept) == 1
    assert not small._anchors._kept


def test_w_route_worked_out_once_per_step_and_again_after_a_parameter_changes():
    """Within ``reusing_graphs`` (one step) W works out once per parameter list whether ``leaf_grads``
    takes every parameter (its route) and reuses it; forgotten at the step's end, so a parameter whose
    ``.data`` became non-contiguous between steps sends the next step's W through autograd (its graph
    anchor runs). Gradients bitwise a plain backward's throughout."""
    gen = torch.Generator().manual_seed(11)
    w = set_meta(torch.nn.Parameter(torch.randn(3, 4, generator=gen)), wgrad_deferrable=True)
    xs = [torch.randn(2, 4, generator=gen) for _ in range(2)]
    deferral = WeightGradDeferral()

    def plain_grad() -> torch.Tensor:
        ref = torch.nn.Parameter(w.detach().clone())
        for x in xs:
            deferrable_linear(x, ref, None, None).tanh().sum().backward()
        return ref.grad

    for step in range(2):
        if step:  # same values and shape, now a transposed view: leaf_grads no longer stands in for it
            w.data = w.detach().t().contiguous().t()
            assert not w.is_contiguous()
        want, w.grad = plain_grad(), None
        with OpCount() as ops, deferral.reusing_graphs():
            for x in xs:
                with deferral.collecting() as work:
                    deferrable_linear(x, w, None, deferral).tanh().sum().backward()
                work.run()
            assert len(deferral._anchors._routes) == 1  # one parameter list, one route, reused
        assert not deferral._anchors._routes  # forgotten at the step's end
        assert ops.ops["aten.zeros"] == step  # step 1: W's one-node graph (built once, rerun)
        assert torch.equal(w.grad, want), step


def test_w_frees_each_layers_tensors_before_the_next_layers_gemms():
    """W runs the queue last in, first out and lets each layer's input and output gradient go as soon
    as its GEMMs ran (the next gradients reuse that memory), with gradients equal to a plain backward."""
    deferral = WeightGradDeferral()
    gen = torch.Generator().manual_seed(5)
    ws = [set_meta(torch.nn.Parameter(torch.randn(6, 6, generator=gen)), wgrad_deferrable=True) for _ in range(3)]
    x0 = torch.randn(4, 6, generator=gen)

    def forward(x):
        x = x.tanh()  # every layer's input an intermediate (a leaf stays alive in autograd's own records)
        for w in ws:
            x = deferrable_linear(x, w, None, deferral).tanh()
        return x.sum()

    forward(x0.clone().requires_grad_(True)).backward()
    plain = [w.grad.clone() for w in ws]
    for w in ws:
        w.grad = None
    inp = x0.clone().requires_grad_(True)
    with deferral.collecting() as work:
        forward(inp).backward(inputs=[inp])
    work.held = []  # the layers' tensors are now alive only in the queue
    alive = [[weakref.ref(t) for t in compute.__closure__ and
              [c.cell_contents for c in compute.__closure__ if isinstance(c.cell_contents, torch.Tensor)]]
             for _, compute in work._queue]
    assert all(len(refs) == 2 for refs in alive)  # x and grad of each of the three layers
    ran: list[int] = []
    for i, (_, compute) in enumerate(work._queue):
        def wrapped(i=i, compute=compute):
            later = range(i + 1, len(alive))  # queued after i: run before it (LIFO), freed by now
            assert all(r() is None for j in later for r in alive[j]), (i, ran)
            ran.append(i)
            return compute()
        work._queue[i] = (work._queue[i][0], wrapped)
    del compute, wrapped
    work.run()
    assert ran == [2, 1, 0]
    assert all(r() is None for refs in alive for r in refs)
    for w, g in zip(ws, plain):
        assert torch.equal(w.grad, g)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "graph"])
def test_w_key_follows_requires_grad_within_a_step(direct):
    """W's route and graph are keyed on its parameters and whether each requires grad, the key built as
    ``B`` queues (``DeferredWeightGrads._key``): a bias frozen for the second microbatch of a step gets
    a key of its own, so W (direct, or through a graph kept from the first microbatch, whose edge would
    reach the frozen bias) leaves the frozen bias's gradient as a plain backward does; the weight's is
    bitwise the plain backward's."""
    gen = torch.Generator().manual_seed(13)
    w = set_meta(torch.nn.Parameter(torch.randn(3, 4, generator=gen)), wgrad_deferrable=True)
    b = set_meta(torch.nn.Parameter(torch.randn(3, generator=gen)), wgrad_deferrable=True)
    xs = [torch.randn(2, 4, generator=gen) for _ in range(2)]

    def run(deferral: WeightGradDeferral | None) -> tuple[torch.Tensor, torch.Tensor]:
        w.grad = b.grad = None
        b.requires_grad_(True)
        with deferral.reusing_graphs() if deferral is not None else contextlib.nullcontext():
            for i, x in enumerate(xs):
                b.requires_grad_(i == 0)
                if deferral is None:
                    deferrable_linear(x, w, b, None).tanh().sum().backward()
                    continue
                with deferral.collecting() as work:
                    deferrable_linear(x, w, b, deferral).tanh().sum().backward()
                work.run()
            if deferral is not None:
                assert len(deferral._anchors._routes) == 2  # one key per requires-grad state
        return w.grad.clone(), b.grad.clone()

    want_w, want_b = run(None)
    got_w, got_b = run(WeightGradDeferral(direct=direct))
    assert torch.equal(got_w, want_w) and torch.equal(got_b, want_b)


def test_b_block_knows_whether_its_w_holds_a_tensor():
    """``DeferredWeightGrads.holds``: identity, not equality (the engine keeps a stage input's data for
    ``W`` only when a closure holds that very tensor, ``step_run``)."""
    deferral = WeightGradDeferral()
    w = set_meta(torch.nn.Parameter(torch.randn(3, 4)), wgrad_deferrable=True)
    x = torch.randn(2, 4, requires_grad=True)
    twin = x.detach().clone().requires_grad_(True)
    with deferral.collecting() as work:
        deferrable_linear(x, w, None, deferral).sum().backward(inputs=[x])
    assert work.holds(x) and not work.holds(twin) and not work.holds(w)
    work.run()
    assert not work.holds(x)  # W let go of what it held


def test_w_graph_kept_for_one_closure_split_is_not_reused_for_another():
    """W's kept graph takes its parameters in ``_params`` order (the last closure first), so its key must
    tell apart two queues with the same parameters split into closures differently: one closure over
    ``(a, b)`` queues ``_params`` (a, b), two closures ``(a,)`` then ``(b,)`` queue (b, a). A key that only
    lists the parameters in queued order gave both the same key and the second W the first one's graph:
    its gradients landed on each other's parameter (same shape, so silently). Reference: each gradient
    summed by hand."""
    gen = torch.Generator().manual_seed(5)
    a, b = (set_meta(torch.nn.Parameter(torch.randn(3, 4, generator=gen)), wgrad_deferrable=True) for _ in range(2))
    grads = [(torch.randn(3, 4, generator=gen), torch.randn(3, 4, generator=gen)) for _ in range(2)]
    deferral = WeightGradDeferral(direct=False)
    with deferral.reusing_graphs():
        (ga, gb) = grads[0]
        with deferral.collecting() as work:
            assert deferral.defer((a, b), lambda: (ga.clone(), gb.clone()), ())
        work.run()
        (ga2, gb2) = grads[1]
        with deferral.collecting() as work:
            assert deferral.defer((a,), lambda: (ga2.clone(),), ())
            assert deferral.defer((b,), lambda: (gb2.clone(),), ())
        work.run()
    assert torch.equal(a.grad, grads[0][0] + grads[1][0])
    assert torch.equal(b.grad, grads[0][1] + grads[1][1])
