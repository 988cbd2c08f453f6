"""`zaya_jax.perf.predict`: replica groups -> mesh axes, node placement, prices, and (8 fake
devices) the collectives of the tiny config's compiled step against a hand count from its
shapes."""

import math

import pytest

from zaya_jax.perf import predict

MESH = {"data": 2, "fsdp": 2, "expert": 2}  # device p = 4 data + 2 fsdp + expert
TARGET = {"data": 16, "fsdp": 8, "expert": 8}
NET = predict.Network(intra_bandwidth=400e9, inter_bandwidth=50e9, intra_latency=1e-5,
                      inter_latency=2e-5, devices_per_node=8)


@pytest.mark.parametrize("attrs, axes", [
    ("replica_groups={{0,1},{2,3},{4,5},{6,7}}", ("expert",)),
    ("replica_groups={{0,2},{1,3},{4,6},{5,7}}", ("fsdp",)),
    ("replica_groups={{0,4},{1,5},{2,6},{3,7}}", ("data",)),
    ("replica_groups={{0,1,4,5},{2,3,6,7}}", ("data", "expert")),
    ("replica_groups=[4,2]<=[8]", ("expert",)),
    ("replica_groups=[4,2]<=[2,2,2]T(0,2,1)", ("fsdp",)),  # ids [[0,2],[1,3],[4,6],[5,7]]
    ("replica_groups=[2,4]<=[2,4]T(1,0)", ("data", "expert")),  # [[0,4,1,5],[2,6,3,7]]
    ("replica_groups={}", ("data", "fsdp", "expert")),
    ("replica_groups=mesh['data'=2,'fsdp'=2,'expert'=2] {'data','expert'}", ("data", "expert")),
    ("source_target_pairs={{0,1},{1,0},{2,3},{3,2}}", ("expert",)),
    ("source_target_pairs={{0,4},{4,0}}", ("data",)),
])
def test_group_axes_reads_every_spelling(attrs, axes):
  assert predict.group_axes(attrs, MESH) == axes


def test_group_axes_without_groups_names_the_op():
  with pytest.raises(ValueError, match="no replica groups"):
    predict.group_axes("dimensions={0}", MESH)


def test_node_split_follows_the_device_order():
  # expert is innermost: 8 experts fill a node; fsdp and data span nodes one device each.
  assert predict.node_split(("expert",), TARGET, 8) == (8, 1)
  assert predict.node_split(("fsdp",), TARGET, 8) == (1, 8)
  assert predict.node_split(("data", "fsdp"), TARGET, 8) == (1, 128)
  assert predict.node_split(("data", "fsdp", "expert"), TARGET, 8) == (8, 128)
  # A 4-wide expert axis leaves room for 2 fsdp devices in the node.
  assert predict.node_split(("fsdp",), {"data": 2, "fsdp": 4, "expert": 4}, 8) == (2, 2)


def test_collective_time_is_the_ring_formula():
  s = 64 * 2**20
  # all-gather over 8 in one node: 7/8 of the buffer over the link, 7 steps.
  assert predict.collective_time("all-gather", s, 8, 8, NET) == pytest.approx(
      7 * 1e-5 + s * 7 / 8 / 400e9)
  # all-reduce over 16 nodes, one device each: twice (15/16 over one NIC + 15 steps).
  assert predict.collective_time("all-reduce", s, 16, 1, NET) == pytest.approx(
      2 * (15 * 2e-5 + s * 15 / 16 / 50e9))
  # all-to-all over 8 x 2 nodes: 7/16 inside, 8/16 out through the NIC.
  assert predict.collective_time("all-to-all", s, 16, 8, NET) == pytest.approx(
      7 * 1e-5 + 1 * 2e-5 + s * 7 / 16 / 400e9 + s * 8 / 16 / 50e9)
  assert predict.collective_time("all-reduce", s, 1, 1, NET) == 0.0


def test_scaled_bytes_rules():
  small, big = MESH, TARGET
  # the MoE exchange: per-device input fixed; a gather grows with its group.
  assert predict.scaled_bytes("all-gather", 100, ("expert",), True, small, big) == 400
  assert predict.scaled_bytes("all-to-all", 100, ("expert",), True, small, big) == 100
  # outside it: an fsdp shard unless fsdp is among the group's axes.
  assert predict.scaled_bytes("all-reduce", 800, ("data",), False, small, big) == 200
  assert predict.scaled_bytes("all-gather", 800, ("fsdp",), False, small, big) == 800
  assert predict.scaled_bytes("all-reduce", 800, ("data", "fsdp", "expert"), False, small, big) == 800


def test_network_rejects_bad_figures():
  with pytest.raises(ValueError, match="Network.inter_bandwidth=0"):
    predict.Network(intra_bandwidth=1e9, inter_bandwidth=0)
