"""Full models at tp = 2 and 4 (with and without sequence parallel) against the tp=1 model.

The tp=1 model built on every rank with ``ParallelState.single_process()`` is the
reference: same seed, so (layout-independent init) the same weights. We compare
gathered logits, the loss and every gathered gradient in float64.
"""

from __future__ import annotations

import pytest
import torch

from models import build_model, config_names, count_parameters, get_config
from models.blocks import ForwardContext
from models.llama import rotary_tables
from models.state import full_grads, full_state_dict
from parallel3d.param_meta import is_tied_embedding, no_weight_decay, tp_split_dim
from parallel3d.parallel_state import ParallelState
from parallel3d.tensor_parallel import gather_last_dim
from parallel3d.topology import Topology
from tests.harness import run_on_ranks
from tests.saved_bytes import saved_bytes

B, S = 2, 8


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (B, S), generator=gen)
    labels = torch.randint(0, vocab, (B, S), generator=gen)
    labels[0, -2:] = -100  # ignored tokens take part in no mean
    return ids, labels


def compare_with_reference(pstate: ParallelState, cfg, *, sequence_parallel: bool, recompute: str = "none",
                           seed: int = 7) -> dict[str, float]:
    """Max relative errors of a tp-sharded model vs the single-process model (float64)."""
    ids, labels = _batch(cfg.vocab_size)
    ref = build_model(cfg, ParallelState.single_process(), seed=seed, dtype=torch.float64)
    model = build_model(cfg, pstate, seed=seed, dtype=torch.float64, sequence_parallel=sequence_parallel,
                        recompute=recompute)
    sharded_init, ref_init = full_state_dict(model), full_state_dict(ref)
    init_equal = sharded_init.keys() == ref_init.keys() and all(torch.equal(sharded_init[k], v)
                                                                for k, v in ref_init.items())
    logits = gather_last_dim(model(ids), pstate)[..., : cfg.vocab_size]
    ref_loss = ref(ids, labels=labels)
    ref_loss.backward()
    loss = model(ids, labels=labels)
    loss.backward()
    grads, ref_grads = full_grads(model), full_grads(ref)
    assert set(grads) == set(ref_grads)
    return {
        "init_equal": float(init_equal),
        "logits": _rel(logits, ref(ids)),
        "loss": _rel(loss.detach(), ref_loss.detach()),
        "grads": max(_rel(grads[k], ref_grads[k]) for k in ref_grads),
    }


def _parity_cases(rank: int, world: int, cases: list[tuple[str, int, bool, dict]]) -> list[dict[str, float]]:
    out = []
    for name, tp, sp, overrides in cases:
        pstate = ParallelState(Topology(tp=tp, pp=1, dp=world // tp))
        out.append(compare_with_reference(pstate, get_config(name, **overrides), sequence_parallel=sp))
    return out


TP2_CASES = [
    ("gpt_tiny", 2, False, {}),
    ("llama_tiny", 2, False, {}),  # GQA: 4 heads, 2 kv heads -> one kv head per rank
    ("gpt_tiny", 2, True, {}),
    ("llama_tiny", 2, True, {}),
    ("gpt_tiny", 2, False, {"vocab_size": 509}),  # padded vocabulary
    ("gpt_tiny", 2, True, {"dropout": 0.1}),  # dropout masks are layout independent (train mode)
    ("llama_tiny", 2, False, {"dropout": 0.1}),
    # fused_kernels=False: the loss goes through parallel3d's own vocab_parallel_cross_entropy
    # (otherwise through kernels.dispatch.vocab_sharded_cross_entropy).
    ("gpt_tiny", 2, True, {"fused_kernels": False, "vocab_size": 509}),
    ("llama_tiny", 2, False, {"fused_kernels": False}),
    # per-head q/k norms: their weight gradients are partial over tp (heads split) with or without sp
    ("llama_tiny", 2, False, {"qk_norm": True, "kv_channels": 8, "qkv_bias": True}),
    ("llama_tiny", 2, True, {"qk_norm": True}),
]

TP4_CASES = [
    ("gpt_tiny", 4, False, {}),
    ("gpt_tiny", 4, True, {"vocab_size": 510}),
    ("llama_tiny", 4, True, {"num_kv_heads": 4}),
    ("llama_tiny", 2, True, {"dropout": 0.1}),  # tp=2 x dp=2 on four ranks
    ("gpt_tiny", 4, False, {"vocab_size": 3}),  # the last rank's vocabulary shard is all padding
]


@pytest.mark.slow
def test_tp4_matches_tp1():
    results = run_on_ranks(_parity_cases, 4, TP4_CASES, timeout=240)
    for rank_result in results:
        for case, r in zip(TP4_CASES, rank_result):
            assert r["init_equal"] == 1.0, case
            assert r["logits"] < 1e-10 and r["loss"] < 1e-6 and r["grads"] < 1e-6, (case, r)


def _sp_pipeline_slices(rank: int, world: int) -> list[dict[str, float]]:
    """Two pipeline slices under tp=2 sequence parallel: hidden [b, s/2, h] flows between them."""
    pstate = ParallelState(Topology(tp=2, pp=1, dp=1))
    out = []
    for name in ("gpt_tiny", "llama_tiny"):
        cfg = get_config(name)
        ids, labels = _batch(cfg.vocab_size)
        build = dict(seed=4, dtype=torch.float64, sequence_parallel=True)
        whole = build_model(cfg, pstate, **build)
        first, last = (build_model(cfg, pstate, layer_range=r, **build) for r in ((0, 2), (2, 4)))
        hidden = first(ids)
        assert hidden.shape == (B, S // 2, cfg.hidden_size), hidden.shape
        loss, ref = last(hidden, labels=labels), whole(ids, labels=labels)
        loss.backward()
        ref.backward()
        grads: dict[str, torch.Tensor] = {}
        for stage in (first, last):
            for key, g in full_grads(stage).items():
                grads[key] = grads[key] + g if key in grads else g
        ref_grads = full_grads(whole)
        assert grads.keys() == ref_grads.keys()
        out.append({"loss": _rel(loss, ref), "grads": max(_rel(grads[k], g) for k, g in ref_grads.items())})
    return out


@pytest.mark.slow
def test_tp2_matches_tp1():
    for rank_result in run_on_ranks(_sp_pipeline_slices, 2, timeout=240):
        for r in rank_result:
            assert r["loss"] < 1e-12 and r["grads"] < 1e-10, r
    results = run_on_ranks(_parity_cases, 2, TP2_CASES, timeout=240)
    for rank_result in results:
        for case, r in zip(TP2_CASES, rank_result):
            assert r["init_equal"] == 1.0, case
            # tp=1 computes the loss in float32 (kernels.dispatch), hence 1e-6 not 1e-12 for loss and grads.
            assert r["logits"] < 1e-10 and r["loss"] < 1e-6 and r["grads"] < 1e-6, (case, r)


# ---- parameter counts (meta device) ---------------------------------------------------
PUBLISHED = {
    # Radford et al. 2019 / HF "gpt2": 124,439,808 with the output head tied to wte.
    "gpt2_124m": 124_439_808,
    # Touvron et al. 2023 (Llama 2), HF meta-llama/Llama-2-7b-hf: 6,738,415,616.
    "llama2_7b": 6_738_415_616,
    # Meta Llama 3 model cards (HF meta-llama/Meta-Llama-3-8B, -70B; Llama-3.1-405B safetensors totals).
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
    "llama31_405b": 405_853_388_800,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_published(name, capsys):
    assert count_parameters(get_config(name)) == PUBLISHED[name]
    assert f"{PUBLISHED[name]:,}" in capsys.readouterr().out


def test_gpt3_175b_count():
    # Brown et al. 2020, Table 2.1 lists "175.0B"; the architecture (96 x 12288, 96 heads, 2048
    # positions, GPT-2 vocabulary, tied head) gives exactly 12*L*d^2 + 13*L*d + (V + 2048)*d + 2d.
    L, d, V = 96, 12288, 50257
    exact = 12 * L * d * d + 13 * L * d + (V + 2048) * d + 2 * d
    got = count_parameters(get_config("gpt3_175b"))
    assert got == exact and abs(got - 175.0e9) / 175.0e9 < 0.005


def test_named_configs():
    assert set(config_names()) >= {"gpt_tiny", "llama_tiny", "gpt2_124m", "gpt3_175b", "llama2_7b", "llama3_8b",
                                    "llama3_70b", "llama31_405b"}
    for name in ("gpt_tiny", "llama_tiny"):
        cfg = get_config(name)
        assert cfg.num_layers >= 4 and cfg.hidden_size <= 128 and cfg.num_heads % 4 == 0 and cfg.vocab_size % 4 == 0
    assert get_config("llama_tiny").kv_heads == 2
    assert get_config("gpt_tiny", num_layers=6).num_layers == 6
    with pytest.raises(ValueError, match=r"unknown model config 'gpt5'; known: \['gpt_tiny'"):
        get_config("gpt5")


# ---- single-process properties --------------------------------------------------------
def test_recompute_does_not_change_results():
    cfg = get_config("llama_tiny", dropout=0.1)
    ids, labels = _batch(cfg.vocab_size)
    results = {}
    for mode in ("none", "selective", "full"):
        model = build_model(cfg, ParallelState.single_process(), seed=3, dtype=torch.float64, recompute=mode)
        loss = model(ids, labels=labels, step=2)
        loss.backward()
        results[mode] = (loss.detach(), full_grads(model))
    for mode in ("selective", "full"):
        assert torch.equal(results[mode][0], results["none"][0])
        for key, grad in results["none"][1].items():
            assert torch.allclose(results[mode][1][key], grad, rtol=1e-12, atol=1e-14), (mode, key)


@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny"])
def test_pipeline_slices_compose_to_the_whole_model(name):
    cfg = get_config(name)
    ids, labels = _batch(cfg.vocab_size)
    single = ParallelState.single_process()
    whole = build_model(cfg, single, seed=9, dtype=torch.float64)
    stages = [build_model(cfg, single, seed=9, dtype=torch.float64, layer_range=r) for r in ((0, 1), (1, 3), (3, 4))]
    assert [(m.pre_process, m.post_process) for m in stages] == [(True, False), (False, False), (False, True)]
    hidden = stages[0](ids)
    assert hidden.shape == (B, S, cfg.hidden_size)
    loss = stages[2](stages[1](hidden), labels=labels)
    ref = whole(ids, labels=labels)
    assert torch.equal(loss, ref)
    loss.backward()
    ref.backward()
    grads = {}
    for stage in stages:
        for key, g in full_grads(stage).items():
            grads[key] = grads[key] + g if key in grads else g  # the tied embedding's two copies add up
    ref_grads = full_grads(whole)
    assert grads.keys() == ref_grads.keys()
    for key, g in ref_grads.items():
        assert torch.allclose(grads[key], g, rtol=1e-12, atol=1e-15), key


@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny"])
def test_empty_end_chunks_compose_to_the_whole_model(name):
    """The embedding alone, all layers, then the final norm and head alone (Llama 3 405B's ends): the
    same loss and gradients as one module (the tied gpt's two word-embedding copies add up)."""
    cfg = get_config(name)
    ids, labels = _batch(cfg.vocab_size)
    single = ParallelState.single_process()
    whole = build_model(cfg, single, seed=9, dtype=torch.float64)
    flags = [(True, False), (False, False), (False, True)]
    stages = [build_model(cfg, single, seed=9, dtype=torch.float64, layer_range=r, pre_process=pre, post_process=post)
              for r, (pre, post) in zip(((0, 0), (0, 4), (4, 4)), flags)]
    assert [len(m.layers) for m in stages] == [0, 4, 0]
    hidden = stages[0](ids)
    assert hidden.shape == (B, S, cfg.hidden_size)  # the p2p message is the hidden state, as for any chunk
    loss = stages[2](stages[1](hidden), labels=labels)
    ref = whole(ids, labels=labels)
    assert torch.allclose(loss, ref, rtol=1e-12, atol=0)
    loss.backward()
    ref.backward()
    grads = {}
    for stage in stages:
        for key, g in full_grads(stage).items():
            grads[key] = grads[key] + g if key in grads else g
    ref_grads = full_grads(whole)
    assert grads.keys() == ref_grads.keys()
    for key, g in ref_grads.items():
        assert torch.allclose(grads[key], g, rtol=1e-12, atol=1e-15), key
    with pytest.raises(ValueError, match=r"layer_range=\(2, 2\) is empty"):
        build_model(cfg, single, device="meta", layer_range=(2, 2), pre_process=False, post_process=False)


def test_parameter_metadata():
    cfg = get_config("gpt_tiny")
    topology = Topology(tp=2, pp=2, dp=1)
    first = build_model(cfg, ParallelState.without_groups(topology, 0), device="meta", layer_range=(0, 2))
    last = build_model(cfg, ParallelState.without_groups(topology, topology.rank_of(pp=1)), device="meta",
                       layer_range=(2, 4))
    whole = build_model(cfg, ParallelState.single_process(), device="meta")
    for module in (first, last, whole):
        for name, p in module.named_parameters():
            assert p.global_name == name
            assert no_weight_decay(p) == (p.ndim < 2)
    params = dict(first.named_parameters())
    assert tp_split_dim(params["layers.0.attn.qkv.weight"]) == 0
    assert tp_split_dim(params["layers.0.attn.out.weight"]) == 1
    assert tp_split_dim(params["layers.0.attn.out.bias"]) is None
    assert tp_split_dim(params["layers.0.norm1.weight"]) is None
    assert params["embedding.word.weight"].shape == (256, 64)
    # The tied word embedding: flagged on both pipeline ends, not when one module holds both.
    assert is_tied_embedding(params["embedding.word.weight"])
    assert is_tied_embedding(dict(last.named_parameters())["embedding.word.weight"])
    assert "embedding.position.weight" not in dict(last.named_parameters())
    assert not is_tied_embedding(dict(whole.named_parameters())["embedding.word.weight"])
    llama_last = build_model(get_config("llama_tiny"), ParallelState.single_process(), device="meta",
                             layer_range=(2, 4))
    assert "head.weight" in dict(llama_last.named_parameters())
    assert not any(n.startswith("embedding") for n, _ in llama_last.named_parameters())


# ---- bad input ---------------------------------------------------------------------------
def test_bad_input_errors():
    single = ParallelState.single_process()
    tp8 = ParallelState.without_groups(Topology(tp=8, pp=1, dp=1), 0)
    with pytest.raises(ValueError, match="num_heads=4 is not divisible by tp=8"):
        build_model(get_config("gpt_tiny"), tp8, device="meta")
    with pytest.raises(ValueError, match="num_kv_heads=2 is not divisible by tp=4"):
        build_model(get_config("llama_tiny"), ParallelState.without_groups(Topology(tp=4, pp=1, dp=1), 0), device="meta")
    with pytest.raises(ValueError, match="hidden_size=66 is not divisible by model.num_heads=4"):
        get_config("gpt_tiny", hidden_size=66)
    with pytest.raises(ValueError, match=r"ffn_hidden_size=174 is not divisible by tp=4"):
        build_model(get_config("llama_tiny", num_kv_heads=4, ffn_hidden_size=174),
                    ParallelState.without_groups(Topology(tp=4, pp=1, dp=1), 0), device="meta")
    with pytest.raises(ValueError, match=r"layer_range=\(2, 9\)"):
        build_model(get_config("gpt_tiny"), single, layer_range=(2, 9))
    with pytest.raises(ValueError, match="recompute='some'"):
        build_model(get_config("gpt_tiny"), single, recompute="some")
    model = build_model(get_config("gpt_tiny"), single)
    with pytest.raises(ValueError, match="sequence length 65 exceeds model.max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        model(torch.zeros(1, 8))


def _sp_odd_sequence(rank: int, world: int) -> str:
    model = build_model(get_config("gpt_tiny"), ParallelState(Topology(tp=2, pp=1, dp=1)), sequence_parallel=True)
    try:
        model(torch.zeros(1, 7, dtype=torch.long))
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_sequence_parallel_needs_divisible_sequence():
    for message in run_on_ranks(_sp_odd_sequence, 2, timeout=120):
        assert "sequence length 7 is not divisible by tp=2" in message


# ---- activation memory ------------------------------------------------------------------
@pytest.mark.parametrize("name, overrides", [("gpt_tiny", {}), ("gpt_tiny", {"num_kv_heads": 2}),
                                             ("llama_tiny", {})])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_attention_keeps_q_k_v_at_their_own_size(name, overrides, recompute):
    """Attention keeps its input, q, k, v (GQA keys/values not expanded to every query head, no
    fused-QKV buffer kept alive by a view next to copies of it), its output and the log-sum-exp."""
    cfg = get_config(name, **overrides)
    model = build_model(cfg, ParallelState.single_process(), seed=1, recompute=recompute)
    s, hq, kv, d = 16, cfg.num_heads, cfg.kv_heads, cfg.head_dim
    x = torch.randn(B, s, cfg.hidden_size, requires_grad=True)
    rope = rotary_tables(s, d, cfg.rope_base, x.device) if cfg.spec.rotary else None
    run = ForwardContext(rope=rope, sample_ids=None, step=0, training=False)
    attn = model.layers["0"].attn
    got, out = saved_bytes(lambda: attn(x, run), exclude=[*model.parameters(), *(rope or ())])
    out.sum().backward()
    element = x.element_size()
    expected = element * B * s * (cfg.hidden_size + (hq + 2 * kv) * d + hq * d)  # input, q k v, output
    expected += 4 * B * s * hq  # log-sum-exp (fp32), kept unless the core is recomputed
    assert got <= expected, (got, expected)
