"""Expert and context-parallel cost terms of the planner (issue 26), each against a hand computation.

- the expert token exchange (``comm_cost.ep_time``): all-to-all of each rank's own ``1 / tp`` of the
  tokens, ``top_k`` copies, plus expert TP's all-gather / reduce-scatter, priced from the cluster's
  link bandwidths by hand;
- the routed experts' GEMM rows (``gemm.matmul_seconds``): ``tokens / tp * etp * top_k / E * ep``
  per expert, walked weight by weight here;
- a cp rank's embedding, head and pipeline message hold ``seq / cp`` tokens: the same as a cp = 1
  layout of ``seq / cp`` tokens, and the P2P column by hand;
- a published run's ``cp_comm`` reaches the priced layout, and a bad one is refused by the loader.
"""

from __future__ import annotations

import pytest

from models import ModelConfig
from models.moe_config import MoEConfig
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.comm_cost import P2P_LATENCY_S, CommModel, ep_time
from parallel3d.planning.cost import _end_times, estimate_step
from parallel3d.planning.gemm import GemmCurve, matmul_seconds
from parallel3d.planning.layout import Layout
from parallel3d.planning.published import load_published_runs, parse_run
from parallel3d.planning.validation import run_layout


def _moe(top_k: int = 2, experts: int = 8) -> ModelConfig:
    return ModelConfig(arch="llama", num_layers=4, hidden_size=1024, num_heads=8, num_kv_heads=4,
                       ffn_hidden_size=4096, vocab_size=32000, max_seq_len=4096,
                       moe=MoEConfig(num_experts=experts, top_k=top_k, ffn_hidden_size=2048))


def _links(cluster: ClusterSpec) -> tuple[float, float]:
    dev = cluster.device
    return dev.intra_node_bytes_per_s * dev.link_efficiency, dev.inter_node_bytes_per_s * dev.link_efficiency


@pytest.mark.parametrize("tp, ep, etp, dp", [(2, 4, 2, 4), (2, 8, 1, 4), (1, 8, 1, 8), (4, 4, 1, 4)])
def test_expert_exchange_is_each_ranks_own_tokens(tp, ep, etp, dp):
    config, cluster = _moe(), ClusterSpec.build(tp * dp, 8, "h100_80gb")
    layout = Layout(tp=tp, pp=1, dp=dp, ep=ep, etp=etp, seq_len=4096, micro_batch_size=2, global_batch_size=2 * dp,
                    sequence_parallel=tp > 1, precision="bf16")
    comm = CommModel(cluster, layout.topology)
    intra, _ = _links(cluster)
    act = 2 * 2 * 4096 * 1024  # bf16 [b, s, h] of the micro-batch
    # By hand: a grid rank holds 1/tp of the tokens and sends top_k copies; in one node an all-to-all moves
    # (ep-1)/ep of them over NVLink, and etp's gather receives (etp-1) ranks' rows.
    sent = act / tp * 2
    want = 2 * (ep - 1) / ep * sent / intra + 2 * (etp - 1) * sent / intra
    assert ep * etp <= 8  # the expert group sits in one node here
    assert ep_time(config, layout, comm, act) == pytest.approx(want, rel=1e-12)


def test_expert_exchange_across_nodes_goes_over_the_nics():
    config, cluster = _moe(experts=16), ClusterSpec.build(32, 8, "h100_80gb")
    layout = Layout(tp=1, pp=1, dp=32, ep=16, seq_len=4096, micro_batch_size=1, global_batch_size=32)
    comm = CommModel(cluster, layout.topology)
    intra, inter = _links(cluster)
    sent = 2 * 4096 * 1024 * 2
    # 16 ranks on 2 nodes: 7/16 of the rows stay in the node, 8/16 cross a NIC, the slower one ends it
    want = 2 * max(7 / 16 * sent / intra, 8 / 16 * sent / inter)
    assert ep_time(config, layout, comm, 2 * 4096 * 1024) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("tp, ep, etp", [(2, 4, 1), (2, 4, 2), (4, 2, 1), (4, 8, 2)])
def test_expert_gemm_rows_are_the_grid_ranks_tokens(tp, ep, etp):
    config = _moe(top_k=2, experts=8)
    curve = GemmCurve(peak_flops=1e15, max_efficiency=0.7, knee=300.0)
    tokens = 2 * 1024
    got = matmul_seconds(config, curve, tp=tp, ep=ep, etp=etp, micro_batch_size=2, seq_len=1024)
    want = 0.0
    for layer in config.shape.layers:
        for t in layer.tensors:
            if not t.matmul:
                continue
            flops = 2.0 * t.numel * t.active * tokens / tp
            if t.expert is not None:
                out, inp = t.shape
                n, k = (out // etp, inp) if inp == config.hidden_size else (out, inp // etp)
                rows = tokens / tp * 2 / 8 * ep * etp  # own tokens x top_k / E, from ep ranks, gathered over etp
            else:
                (n, k), rows = t.local_shape(tp), tokens
            want += flops / (curve.peak_flops * curve.efficiency(rows, n, k))
    assert got == pytest.approx(want / config.num_layers, rel=1e-12)


@pytest.mark.parametrize("cp", [2, 4])
def test_head_and_embedding_price_the_cp_ranks_share(cp):
    config = _moe()
    cluster = ClusterSpec.build(8 * cp, 8, "h100_80gb")
    long = Layout(tp=2, pp=1, dp=4, cp=cp, seq_len=4096, micro_batch_size=1, global_batch_size=4,
                  sequence_parallel=True)
    short = Layout(tp=2, pp=1, dp=4 * cp, seq_len=4096 // cp, micro_batch_size=1, global_batch_size=4 * cp,
                   sequence_parallel=True)
    got = _end_times(long, cluster, CommModel(cluster, long.topology), config)
    want = _end_times(short, cluster, CommModel(cluster, short.topology), config)
    assert got == pytest.approx(want, rel=1e-12)


def test_pipeline_message_holds_the_cp_ranks_tokens():
    config = _moe()
    cluster = ClusterSpec.build(64, 8, "h100_80gb")
    layout = Layout(tp=2, pp=2, dp=4, cp=4, seq_len=8192, micro_batch_size=1, global_batch_size=16,
                    sequence_parallel=True, precision="bf16")
    step = estimate_step(config, layout, cluster)
    # tp, cp fill a node, so the next stage is on another node: its NIC, one message per boundary.
    _, inter = _links(cluster)
    msg = 2 * 1 * 8192 / 4 * 1024 / 2  # bf16, this cp rank's tokens, 1/tp under sequence parallel
    m = layout.num_microbatches
    assert dict(step.breakdown)["pp"] == pytest.approx(2 * m * (P2P_LATENCY_S + msg / inter), rel=1e-12)


def test_published_cp_comm_reaches_the_priced_layout():
    runs = {r.id: r for r in load_published_runs()}
    assert run_layout(runs["llama3_405b_128k_16384gpus"]).cp_comm == "allgather"
    assert run_layout(runs["folding_mixtral_8x22b_folding_128k_1024gpus"]).cp_comm == "p2p"


def test_loader_refuses_an_unknown_cp_comm():
    import yaml
    from parallel3d.planning.published import RUNS_FILE

    raw = next(r for r in yaml.safe_load(RUNS_FILE.read_text())["runs"] if r["id"] == "llama3_405b_128k_16384gpus")
    raw = {**raw, "layout": {**raw["layout"], "cp_comm": "ring"}}
    with pytest.raises(ValueError, match="layout.cp_comm='ring'"):
        parse_run(raw)
