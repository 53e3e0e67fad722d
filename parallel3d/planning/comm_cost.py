"""Communication times of one layout's groups on one cluster: ring/hierarchical collectives, P2P,
the context-parallel exchange (ring, all-gather, all-to-all) and the expert token exchange (all-to-all
over ep, gather / reduce-scatter over etp).

Invariant: a group's placement (members per node, nodes spanned) comes from the topology's own
rank order, so a collective runs at NVLink bandwidth only when its group really sits in one node, and
pays NCCL's ring latency (``ring_latency``, once per collective call) only when it spans nodes.
"""

from __future__ import annotations

from models.config import ModelConfig
from parallel3d.planning.cluster import ClusterSpec
from parallel3d.planning.layout import Layout
from parallel3d.topology import Topology

P2P_LATENCY_S = 20e-6  # per message: launch + handshake, small next to megabyte payloads

# NCCL's own latency model of a ring collective, Simple protocol (the one it runs for megabyte buckets):
# NVIDIA/nccl src/graph/tuning.cc, the same from v2.18.1-1 to v2.30.7-1: baseLat[Ring][Simple] 8.4 us,
# hwLat[NVLINK][Ring][Simple] 3.4 us and hwLat[NET][Ring][Simple] 14.0 us per ring step, and an
# inter-node ring's in-node steps at least the network post overhead (getNetOverhead: 1 us on x86) x 3
# for Simple. graph->latencyInter adds nothing on InfiniBand (the IB plugin reports latency 0).
NCCL_RING_BASE_S = 8.4e-6
NCCL_RING_NVLINK_STEP_S = 3.4e-6
NCCL_RING_NET_STEP_S = 14.0e-6
NCCL_RING_NET_OVERHEAD_S = 3 * 1.0e-6


class CommModel:
    """Ring collective and P2P times for the groups of one layout on one cluster."""

    def __init__(self, cluster: ClusterSpec, topology: Topology) -> None:
        self.cluster, self.topology = cluster, topology
        dev = cluster.device
        self.intra = dev.intra_node_bytes_per_s * dev.link_efficiency
        self.inter = dev.inter_node_bytes_per_s * dev.link_efficiency
        self._spans: dict[str, tuple[int, int, int]] = {}

    def _span(self, kind: str) -> tuple[int, int, int]:
        """(group size, nodes it spans, members per node) of rank 0's group of ``kind``.

        Every group of a kind has the same shape, so rank 0's stands for all. Its
        members are asked of the topology coordinate by coordinate, which is cheap
        even at thousands of ranks (``Topology.groups`` would build every group).
        """
        if kind not in self._spans:
            topo = self.topology
            if kind in ("tp", "cp", "dp", "pp"):
                ranks = [topo.rank_of(**{kind: i}) for i in range(topo.size(kind))]
            elif kind == "embedding":  # rank 0's tied-embedding pair: its first and last stage
                ranks = sorted({topo.rank_of(pp=0), topo.rank_of(pp=topo.pp - 1)})
            else:  # expert kinds (ep, ...) live on the expert grid
                ranks = topo.group_of(kind, 0)
            nodes, per_node = self.cluster.nodes_spanned(ranks)
            self._spans[kind] = (len(ranks), nodes, per_node)
        return self._spans[kind]

    def group_size(self, kind: str) -> int:
        return self._span(kind)[0]

    def ring_latency(self, kind: str) -> float:
        """NCCL's modelled latency of one reduce-scatter (or all-gather) call over the ``kind`` group
        (constants above): ``n - 1`` ring steps, ``nodes - 1`` of them over the network.

        Zero for a group inside one node: there NCCL's 8.4 + 3.4 x (n - 1) us per call is part of what
        the GEMM curve, fitted on the calibration rows, already absorbed with the in-node TP collectives;
        across nodes the per-step 14 us grows with the group, which no fitted constant can follow."""
        n, nodes, _ = self._span(kind)
        if nodes == 1:
            return 0.0
        in_node = max(NCCL_RING_NVLINK_STEP_S, NCCL_RING_NET_OVERHEAD_S)
        return NCCL_RING_BASE_S + (n - nodes) * in_node + (nodes - 1) * NCCL_RING_NET_STEP_S

    def reduce_scatter(self, nbytes: float, kind: str, calls: int = 1) -> float:
        """Time of a reduce-scatter (or all-gather) whose full, unsharded payload is ``nbytes``, cut
        into ``calls`` collective calls (gradient buckets), each paying ``ring_latency``.

        Hierarchical: within each node over NVLink, then across nodes where each of the
        ``per_node`` members drives its own NIC with 1/per_node of the data.
        """
        n, nodes, per_node = self._span(kind)
        if n == 1:
            return 0.0
        t = (per_node - 1) / per_node * nbytes / self.intra
        if nodes > 1:
            t += (nodes - 1) / nodes * nbytes / per_node / self.inter
        return t + calls * self.ring_latency(kind)

    def all_gather(self, nbytes: float, kind: str, calls: int = 1) -> float:
        return self.reduce_scatter(nbytes, kind, calls)

    def all_reduce(self, nbytes: float, kind: str, calls: int = 1) -> float:
        """A reduce-scatter and an all-gather, latency included. (NCCL's ring all-reduce model counts one
        base and 2 x nodes network steps, this two bases and 2 x (nodes - 1): 12.8 us less, before NCCL's
        x1.4 large-message factor; NCCL may pick its tree instead. Not refined: across nodes the priced
        frameworks all-reduce once per step, Megatron-LM 2021's whole buffer or the tied embedding.)"""
        return 2.0 * self.reduce_scatter(nbytes, kind, calls)

    def all_to_all(self, nbytes: float, kind: str) -> float:
        """An all-to-all in which each member sends ``nbytes`` in total, (n-1)/n of it away; the
        share bound for other nodes goes over the member's own NIC."""
        n, nodes, per_node = self._span(kind)
        if n == 1:
            return 0.0
        local = (per_node - 1) / n * nbytes / self.intra
        remote = (n - per_node) / n * nbytes / self.inter if nodes > 1 else 0.0
        return max(local, remote)

    def cp_hop(self, nbytes: float) -> float:
        """One ring step of the cp group: over NVLink when the whole group is in one node."""
        n, nodes, _ = self._span("cp")
        return P2P_LATENCY_S + nbytes / (self.intra if nodes == 1 else self.inter)

    def p2p(self, nbytes: float) -> float:
        """One activation/gradient message between neighbouring stages."""
        if self.topology.pp == 1:
            return 0.0
        nxt = self.topology.next_stage_rank(0)
        same_node = self.cluster.node_of(0) == self.cluster.node_of(nxt)
        return P2P_LATENCY_S + nbytes / (self.intra if same_node else self.inter)


def cp_times(config: ModelConfig, layout: Layout, comm: CommModel, att_t: float, e: int) -> tuple[float, float]:
    """Exposed context-parallel time of one layer, (forward, backward).

    p2p (ring): cp - 1 rounds each passing this rank's K and V block to the next rank, overlapped
    with the attention block computed meanwhile; the backward also returns dK, dV (twice the bytes).
    allgather: K and V gathered before attention (forward) and dK, dV reduce-scattered (backward),
    not overlapped. a2a (Ulysses): four all-to-alls of the [b, s/cp, h] q, k, v, out forward and
    backward. a2a+p2p: the a2a over ``cp_a2a_size`` ranks, the ring over the rest.
    """
    c = layout.cp
    if c == 1:
        return 0.0, 0.0
    tokens = layout.micro_batch_size * layout.seq_len / c
    kv = 2 * e * tokens * config.kv_heads * config.head_dim / layout.tp  # this rank's K and V block
    qkvo = 4 * e * tokens * config.hidden_size / layout.tp
    ring_ranks, a2a_ranks = c, 1
    if layout.cp_comm == "a2a":
        ring_ranks, a2a_ranks = 1, c
    elif layout.cp_comm == "a2a+p2p":
        a2a_ranks = layout.cp_a2a_size or c
        ring_ranks = c // a2a_ranks
    hop = comm.cp_hop(kv)
    if layout.cp_comm == "allgather":
        gather = comm.all_gather(kv * c, "cp")
        return gather, 2 * gather
    ring_f = max(0.0, (ring_ranks - 1) * hop - att_t) if ring_ranks > 1 else 0.0
    ring_b = max(0.0, 2 * (ring_ranks - 1) * hop - 2 * att_t) if ring_ranks > 1 else 0.0
    a2a = comm.all_to_all(qkvo, "cp") * (a2a_ranks - 1) / (c - 1) if a2a_ranks > 1 else 0.0
    return ring_f + a2a, ring_b + a2a


def ep_dispatch_bytes(config: ModelConfig, layout: Layout, act_bytes: float) -> float:
    """Bytes one rank sends in one dispatch (or combine) all-to-all: ``top_k`` copies of each of its
    tokens. ``act_bytes`` is the cp rank's ``[b, s / cp, h]``; the ranks of the expert grid hold
    different tokens (``parallel3d.moe.layer``'s contract: ``1 / tp`` of them each, sequence parallel),
    so a rank dispatches ``act_bytes / tp`` per copy, not the whole tp group's."""
    return act_bytes / layout.tp * config.moe.top_k


def ep_time(config: ModelConfig, layout: Layout, comm: CommModel, act_bytes: float) -> float:
    """The expert token exchange of one (MoE) layer in one pass, mean over the layers (dense ones have
    none); the same again in the other pass. Dispatch and combine are each an all-to-all over ep of
    ``ep_dispatch_bytes``, and with expert TP (``etp > 1``) an all-gather of the received rows over
    etp (dispatch) and a reduce-scatter of the partial outputs (combine), as
    ``parallel3d.moe.dispatcher_alltoall`` runs them; not overlapped with the expert GEMMs."""
    if not config.moe.enabled:
        return 0.0
    sent = ep_dispatch_bytes(config, layout, act_bytes)
    etp = layout.etp or layout.tp
    per_layer = 2 * comm.all_to_all(sent, "ep") if layout.ep > 1 else 0.0
    if etp > 1:  # each etp rank receives ``sent`` rows on balance; the gather holds all etp ranks'
        per_layer += 2 * comm.all_gather(sent * etp, "etp")
    moe_layers = sum(config.moe.is_moe_layer(i) for i in range(config.num_layers))
    return per_layer * moe_layers / config.num_layers
