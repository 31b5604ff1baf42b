"""The network model: a transfer costs what both ends can move (fan-out, fan-in), inside a node only
where placement puts every pair of replicas that exchange rows in one node, and the planner's
simulated boundaries agree with `place()` (and with the lowered program's transfers)."""

import math

import pytest

from opweave.cost import model as C
from opweave.hardware.catalog import load_catalog
from opweave.hardware.cluster import parse_cluster
from opweave.passes.placement import Group, place, transfer_locality

CATALOG = load_catalog()
H100, A100 = CATALOG["h100"], CATALOG["a100"]


def test_fan_out_is_limited_by_the_sender_and_each_receiver_separately():
    """1 H100 replica feeding 8 A100 replicas: the H100 pushes all rows through its NIC, each A100
    takes an eighth through its own; the step is the slower of the two, not all rows through the
    slower NIC."""
    per_token, rows = 8192, 64
    got = C.boundary_s(per_token, H100, rows, A100, rows // 8, 1, inter_node=True)
    send = per_token * rows / (H100.inter_link_bandwidth * C.INTER_LINK_EFFICIENCY)
    recv = per_token * rows / 8 / (A100.inter_link_bandwidth * C.INTER_LINK_EFFICIENCY)
    latency = max(H100.inter_link_latency, A100.inter_link_latency)
    assert got == pytest.approx(latency + max(send, recv))
    old = latency + per_token * rows / (min(H100.inter_link_bandwidth, A100.inter_link_bandwidth)
                                        * C.INTER_LINK_EFFICIENCY)
    assert got < old  # all rows through the slower NIC: what fan-out does not do


def test_fan_in_is_limited_by_the_receiver_taking_every_sender_rows():
    """8 A100 replicas feeding 1 H100 replica: each sends an eighth, the H100 receives all of them."""
    per_token, rows = 8192, 64
    got = C.boundary_s(per_token, A100, rows // 8, H100, rows, 1, inter_node=True)
    recv = per_token * rows / (H100.inter_link_bandwidth * C.INTER_LINK_EFFICIENCY)
    send = per_token * rows / 8 / (A100.inter_link_bandwidth * C.INTER_LINK_EFFICIENCY)
    assert got == pytest.approx(max(H100.inter_link_latency, A100.inter_link_latency) + max(send, recv))
    # the receiver's whole share counts: more than one sender's piece over the receiver's link
    assert got > per_token * rows / 8 / (H100.inter_link_bandwidth * C.INTER_LINK_EFFICIENCY)


def test_receiver_tp_fans_out_inside_its_node():
    plain = C.boundary_s(4096, H100, 16, H100, 16, 1, inter_node=False)
    fanned = C.boundary_s(4096, H100, 16, H100, 16, 4, inter_node=False)
    assert fanned == pytest.approx(plain + H100.intra_link_latency + 4096 * 16 / C.intra_bandwidth(H100))


def test_intra_node_is_cheaper_and_types_never_share_a_node():
    assert C.transfer_s(1e6, H100, H100, inter_node=False) < C.transfer_s(1e6, H100, H100, inter_node=True)
    assert C.transfer_s(1e6, H100, A100, inter_node=False) == C.transfer_s(1e6, H100, A100, inter_node=True)
    assert C.transfer_s(0, H100, H100, inter_node=True) == 0.0


def _local(spec, groups, rows):
    cluster = parse_cluster(spec, CATALOG)
    return transfer_locality(place(tuple(groups), cluster), cluster, rows)


def test_locality_follows_placement():
    two_tp4 = [Group(gpu="h100", tp=4, replicas=1), Group(gpu="h100", tp=4, replicas=1)]
    assert _local("h100x8", two_tp4, 8) == {(0, 1): True, (1, 0): True}
    assert _local("h100x64", two_tp4, 8) == {(0, 1): True, (1, 0): True}   # every set fills one node
    # 6 GPUs per set on 8-GPU nodes: set 1's TP4 group lands on the next node
    six = [Group(gpu="h100", tp=2, replicas=1), Group(gpu="h100", tp=4, replicas=1)]
    assert _local("h100x16", six, 8)[(0, 1)] is False
    assert _local("h100x8", six, 8)[(0, 1)] is True                        # one set only: inside node 0
    mixed = [Group(gpu="h100", tp=1, replicas=1), Group(gpu="a100", tp=1, replicas=8)]
    assert _local("h100x8+a100x8", mixed, 8) == {(0, 1): False, (1, 0): False}


def test_locality_looks_only_at_replicas_that_exchange_rows():
    """Replicas of two owners matched row for row (2 and 2) each sit with their partner even
    when the owners as a whole span two nodes."""
    groups = [Group(gpu="h100", tp=4, replicas=2), Group(gpu="h100", tp=4, replicas=2)]
    # set 0: owner 0's replicas take node 0, owner 1's node 1: partners on different nodes
    assert _local("h100x16", groups, 8)[(0, 1)] is False
    small = [Group(gpu="h100", tp=2, replicas=2), Group(gpu="h100", tp=2, replicas=2)]
    assert _local("h100x8", small, 8)[(0, 1)] is True
