"""What a described cluster would run: the cost model (jaxdp/sync/costmodel.py) on a cluster's
all-reduce time line instead of a measured one, for `python -m jaxdp.bench plan`.

    rows = predict(Cluster(nodes, devices, link_bits_per_s, latency_s), compute_seconds, params)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from jaxdp.sync.codecs.base import Tree
from jaxdp.sync.costmodel import CommModel, ladder, predicted_step_s, pseudo_gradient_codec, pseudo_topk
from jaxdp.sync.rules import abilities



@dataclasses.dataclass(frozen=True)
class Cluster:
    """`nodes` x `devices` per node; each node's link carries `link_bits_per_s` each way with
    `latency_s` per message; inside a node `local_bits_per_s` (inf: free beside the link)."""

    nodes: int
    devices: int
    link_bits_per_s: float
    latency_s: float = 0.0
    local_bits_per_s: float = math.inf

    def allreduce(self, hierarchical: bool = False) -> CommModel:
        """The all-reduce time line of a bandwidth-optimal ring over this cluster.

        Flat: one ring over every device, ordered by node, so one hop per node crosses its link;
        every hop of a ring of P moves 2 (P - 1) / P of the buffer over the run, so each node's link
        carries that much each way, in 2 (P - 1) steps of one message each. Hierarchical
        (`--hierarchy auto`): the devices of a node sum inside it, then a ring of the nodes alone
        (P = nodes) crosses the links, then the sum is broadcast inside: the same bytes per link
        for a large P, but 2 (nodes - 1) messages instead of 2 (nodes x devices - 1), and inside
        the node 2 (devices - 1) / devices of the buffer more over the local bandwidth."""
        ring = self.nodes if hierarchical or self.devices == 1 else self.nodes * self.devices
        if self.nodes == 1:  # one node: the link carries nothing
            ring = 1
        per_byte = 2 * (ring - 1) / ring * 8 / self.link_bits_per_s if ring > 1 else 0.0
        if self.devices > 1 and (hierarchical or self.nodes == 1):
            per_byte += 2 * (self.devices - 1) / self.devices * 8 / self.local_bits_per_s
        return CommModel(latency_s=2 * (ring - 1) * self.latency_s, seconds_per_byte=per_byte)


def predict(cluster: Cluster, compute_seconds: float, params: Tree, *, strategy: str = "ring",
            sync_every: Sequence[int] = (1, 4, 16)) -> list[dict[str, Any]]:
    """Predicted seconds per step on `cluster` for every candidate of the ladder (int8 / int4 with
    the ring) at every H of `sync_every` (H > 1: local steps, without and with --overlap; the ladder's
    codecs that send every value, and top-k pseudo-gradients, `costmodel.pseudo_topk`), flat and,
    with several devices per node, hierarchical. `compute_seconds`: one step's forward and backward
    pass on one device at its share of the batch. PowerSGD's own matmuls and quantizing are not in
    it (a small part of the step on the testbed's MLP). Rows: {"compression",
    "sync_every", "overlap", "hierarchy", "payload_bytes", "allreduce_s", "step_s"}."""
    hierarchies = ("flat", "auto") if cluster.devices > 1 and cluster.nodes > 1 else ("flat",)
    devices = cluster.nodes * cluster.devices
    rows = []
    for hierarchy in hierarchies:
        model = cluster.allreduce(hierarchy == "auto")
        ring_size = cluster.nodes if hierarchy == "auto" else devices
        dense = ladder(params, quantized_devices=ring_size if strategy == "ring" else None, devices=devices)
        sparse = pseudo_topk(params, devices, abilities(strategy))
        for codec in dense + sparse:
            payload = codec.payload_bytes(params)
            seconds = model.seconds(payload, codec.collectives)
            for h in sync_every:
                if (h > 1 and codec in dense and not pseudo_gradient_codec(codec)) or (h == 1 and codec in sparse):
                    continue
                for overlap in ((False, True) if h > 1 else (False,)):
                    rows.append({"compression": codec.name, "sync_every": h, "overlap": overlap, "hierarchy": hierarchy,
                                 "payload_bytes": payload, "allreduce_s": seconds,
                                 "step_s": predicted_step_s(compute_seconds, seconds, h, overlap)})
    return rows
